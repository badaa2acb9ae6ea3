"""fp16 error of three spellings of SiLU against exact SiLU, on programs anec emits.

    python bench/silu_forms.py [--low -16] [--high 16] [--json FILE]

Issue 23, item 4 (recipe ``silu_form``). Each spelling is a one-op torch module converted by
anec's own `converter.coreml.program.to_mlprogram` (fp16, macOS14) and run by anec's MIL evaluator
over every finite fp16 x in [low, high]:

* ``silu op``: ``F.silu`` -> one MIL ``silu`` op (silu_form: op, the default);
* ``x*sigmoid(x)``: a ``sigmoid`` and a ``mul`` (silu_form: mul-sigmoid);
* ``tanh form``: ``x * 0.5 * (1 + tanh(x / 2))``, exact in real arithmetic (not offered:
  measured here to show why).

Profiles: ``fp16`` (each op exact in fp32, its result rounded to fp16: the gated profile),
``fp16-acc`` (fp16 subnormals flushed too) and ``device-margin`` (fp16-acc plus the errors
others report for the NE's ops, `parity.mil.deviations`; worst over its seeds). The reference
is SiLU of the same fp16 x in float64. Every figure is the evaluator's arithmetic, measured
here; none is a measurement of a chip (the NE's own sigmoid, tanh and silu are unpublished).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from converter.coreml.program import TensorIO, live_ops, to_mlprogram, trace
from parity.mil import Evaluator
from parity.mil.deviations import SEEDS

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu op": torch.nn.functional.silu,
    "x*sigmoid(x)": lambda x: x * torch.sigmoid(x),
    "tanh form": lambda x: x * 0.5 * (1.0 + torch.tanh(x * 0.5)),
}
PROFILES = ("fp16", "fp16-acc", "device-margin")
# x ranges the table reports apart (the NE figures others report are binned by |x|).
BINS: tuple[tuple[float, float], ...] = (
    (-math.inf, -8), (-8, -4), (-4, -2), (-2, -0.5), (-0.5, 0.5), (0.5, 2), (2, 4), (4, 8),
    (8, math.inf),
)  # fmt: skip


class _Form(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def fp16_grid(low: float, high: float) -> np.ndarray:
    """Every finite fp16 value in [low, high], ascending (subnormals and both zeros' one)."""
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16)
    values = np.unique(values[np.isfinite(values)])
    return values[(values >= low) & (values <= high)]


def run_form(name: str, x: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The form's outputs on x under each profile (device-margin: the worst seed per x) and
    the program's op counts."""
    import coremltools as ct

    spec = [TensorIO("x", (1, 1, 1, x.size), "float16", "x")]
    out = [TensorIO("y", (1, 1, 1, x.size), "float16", "y")]
    module = _Form(FORMS[name])
    with contextlib.redirect_stderr(io.StringIO()):  # coremltools' progress bars, warnings
        mlmodel = to_mlprogram(trace(module, spec), spec, out, ct.target.macOS14, "float16")
    program = mlmodel._mil_program
    feed = {"x": x.reshape(1, 1, 1, -1)}
    exact = _exact(x)
    outputs: dict[str, np.ndarray] = {}
    for profile in PROFILES:
        seeds = SEEDS if profile == "device-margin" else (0,)
        runs = [
            Evaluator(program, profile, seed=seed).run(feed).outputs["y"].reshape(-1)
            for seed in seeds
        ]
        errors = np.stack([np.abs(r.astype(np.float64) - exact) for r in runs])
        outputs[profile] = np.stack(runs)[errors.argmax(axis=0), np.arange(x.size)]
    return outputs, dict(live_ops(mlmodel))


def _exact(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / (1.0 + np.exp(-x64))


def summary(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Max and mean |y - SiLU(x)| overall and per bin; the largest excess over the error of
    SiLU(x) correctly rounded to fp16 (the best an fp16 result can be: the form's own error)
    and the share of x where y is that correctly rounded value."""
    exact = _exact(x)
    error = np.abs(y.astype(np.float64) - exact)
    rounded = exact.astype(np.float16)
    best = np.abs(rounded.astype(np.float64) - exact)
    row = {
        "max": float(error.max()),
        "mean": float(error.mean()),
        "max_excess": float((error - best).max()),
        "correctly_rounded": float(np.mean(y.astype(np.float16) == rounded)),
    }
    for lo, hi in BINS:
        inside = (x >= lo) & (x < hi)
        if inside.any():
            row[_bin(lo, hi)] = float(error[inside].max())
    return row


def _bin(lo: float, hi: float) -> str:
    if math.isinf(lo):
        return f"x<{hi:g}"
    if math.isinf(hi):
        return f"x>={lo:g}"
    return f"[{lo:g},{hi:g})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low", type=float, default=-16.0)
    parser.add_argument("--high", type=float, default=16.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    x = fp16_grid(args.low, args.high)
    print(f"{x.size} finite fp16 values of x in [{args.low:g}, {args.high:g}]; reference: "
          "SiLU(x) in float64; error = |program output - reference| (anec's MIL evaluator); "
          "excess: the largest error beyond SiLU(x) correctly rounded to fp16; the x columns: "
          "max error in that range of x")  # fmt: skip
    results: dict[str, dict[str, object]] = {}
    for name in FORMS:
        outputs, ops = run_form(name, x)
        results[name] = {
            "ops": ops,
            "profiles": {p: summary(x, y) for p, y in outputs.items()},
        }
        print(f"\n{name}: program ops {ops}")
        header = ["profile", "max", "mean", "excess", "corr.rnd"]
        header += [_bin(lo, hi) for lo, hi in BINS]
        print("  " + "  ".join(f"{h:>9}" for h in header))
        for profile, row in results[name]["profiles"].items():  # type: ignore[attr-defined]
            cells = [f"{row['max']:9.2e}", f"{row['mean']:9.2e}", f"{row['max_excess']:9.2e}",
                     f"{row['correctly_rounded']:9.1%}"]  # fmt: skip
            cells += [f"{row.get(_bin(lo, hi), float('nan')):9.2e}" for lo, hi in BINS]
            print(f"  {profile:>9}  " + "  ".join(cells))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
