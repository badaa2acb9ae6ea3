"""What keeps W8A8 on SmolLM2 from top-1 0.97: each projection input's cost, the folds' effect.

    python bench/smollm2_w8a8.py ARTIFACT [--alpha 0.5 --alpha 0.75 ...] [--json PATH]

ARTIFACT is the fp16 artifact directory an ``anec convert`` of
``recipes/smollm2-135m-draft-w8a8.yaml`` wrote (its program is what the folds are measured
on, as ``method: w8a8`` measures them). Everything else runs in torch fp32 on the BC1L module
with fp16-rounded weights, scored on the recipe's held-out slice (1,026 positions) against
that module: top-1 agreement and mean KL(fp16 || variant). What the variant stores:

* weights: int8 per output channel, symmetric, rounded to nearest (scale max|row| / 127, as
  coremltools' ``linear_symmetric``), after the folds;
* inputs: int8 per tensor, symmetric, scale max|x| / 127 over the calibration slice, measured
  here in torch fp32 on the folded module (the pipeline measures them in the MIL evaluator's
  fp16 profile: the figures differ slightly, which the table header says);
* folds: ``compress.smooth`` on the program, the same powers of two the pipeline folds.

It prints (1) int8 weights alone; (2) with no folds, the MLP down folds only, and every fold
at each ``--alpha``: the folded int8 weights alone (what the folds cost the weights) and W8A8;
(3) the same at the best alpha with one fold kind only; with ``--each-input``, (4) the inputs
of one projection kind quantized, the rest fp16, and (5) every input quantized alone, then
W8A8 with the k most costly inputs kept fp16, for k until top-1 reaches 0.97 or 32; with
``--split``, (6) each projection's widest input channels taken out of the int8 path into an
fp16 side conv (LLM.int8()-style), with static per-tensor input scales and with per-token
scales (which Core ML's static ``quantize`` op cannot express: a bound, not a method). A torch
measurement, not the converted program; the pipeline's figures for the same variants are in
bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "smollm2-135m-draft-w8a8.yaml"
KINDS = ("attention.qkv", "attention.o", "mlp.gate_up", "mlp.down")


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output row (dim 0), rounded to nearest, decoded to fp16 values."""
    scale = w.abs().amax(dim=tuple(range(1, w.ndim)), keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((w / scale).round().clamp(-127, 127) * scale).half().float()


class Setup:
    """The module, its held-out scorer, the calibration batches and the program's folds."""

    def __init__(self, artifact: Path) -> None:
        from converter.checkpoints.loading import load_checkpoint
        from converter.compression.calibrate import fp16_copy
        from converter.compression.decoder_variants import DecoderSubject
        from converter.compression.methods.base import split_sites
        from converter.compression.search import Scorer
        from converter.compression.sites import weight_sites
        from converter.recipe import load_recipe
        from converter.recipe.schema import DecoderRecipe
        from converter.tasks.text_generation import held_out, rewrite_decoder
        from parity.decoder_gates import module_inputs
        from parity.fixtures import make_batches
        from parity.mil import Evaluator, load_package

        recipe = load_recipe(RECIPE)
        assert isinstance(recipe, DecoderRecipe) and recipe.compression is not None
        ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
        rw = rewrite_decoder(recipe, ckpt)
        self.held = held_out(recipe, ckpt, rw)
        self.module = fp16_copy(rw.module)
        self.embed = rw.embed_table
        program = load_package(artifact / f"{recipe.name}.mlpackage")
        self.function = program.functions["main"]
        names = [n for n, _ in rw.module.named_parameters()]
        self.sites = weight_sites(self.function, names)
        c = recipe.compression
        self.projections, _ = split_sites(self.sites, c.keep_fp16, c.min_weight_elements)
        self.evaluator = Evaluator(program, "fp16")
        subject = DecoderSubject(rw.module, rw.embed_table, self.held, 1e-3)
        self.feeds = subject.calibration_feeds(self.evaluator)
        self.scorer = Scorer(self.module, self.held.fixtures, self.embed, self.held.pad_id)
        io = self.module.io
        self.calibration = [
            module_inputs(self.module, b, self.embed, torch.float32)
            for b in make_batches(self.held.calibration, io.batch, io.length, self.held.pad_id)
        ]
        self.fp16 = {s.name: self.module.get_parameter(s.name).detach().clone() for s in self.sites}
        self.convs = {s.name: s.name.rsplit(".", 1)[0] for s in self.projections}

    def folds(self, alpha: float | None, kinds: tuple[str, ...] = ()) -> list[Any]:
        """The program's folds at ``alpha`` (None: none), only ``kinds`` when given."""
        from converter.compression.smooth import smooth

        if alpha is None:
            return []
        s = smooth(
            self.function, self.module, self.sites, self.projections, self.evaluator, self.feeds,
            alpha,
        )  # fmt: skip
        return [f for f in s.folds if not kinds or f.kind in kinds]

    @contextlib.contextmanager
    def variant(self, folds: list[Any], quantized: list[str]) -> Iterator[None]:
        """The module with ``folds`` applied, every projection weight int8 and the inputs of
        the ``quantized`` projections (weight names) int8, restored on exit."""
        from converter.compression.activations import fake_quantized_inputs
        from converter.compression.smooth import scale_tensors

        scale_tensors(self.module, folds, set())
        params = dict(self.module.named_parameters())
        try:
            # ranges of the folded fp16 model, as the pipeline measures them on its program
            scales = self._scales([self.convs[n] for n in quantized])
            with torch.no_grad():
                for s in self.projections:
                    params[s.name].copy_(int8_rows(params[s.name]))
            with fake_quantized_inputs(self.module, scales):
                yield
        finally:
            with torch.no_grad():
                for name, value in self.fp16.items():
                    params[name].copy_(value)
            scale_tensors(self.module, folds, {s.name for s in self.projections}, inverse=True)

    def _scales(self, convs: list[str]) -> dict[str, float]:
        """max |x| / 127 of each conv's input over the calibration batches (torch fp32)."""
        peaks = self.channel_peaks()
        return {n: max(float(peaks[n].max()), 1e-8) / 127 for n in convs}

    def score(self, folds: list[Any], quantized: list[str]) -> tuple[float, float]:
        """(top-1, mean KL) of the variant against the fp16 module on the held-out slice."""
        with self.variant(folds, quantized):
            kl, top1 = self.scorer.compare()
        return top1, kl

    def channel_peaks(self) -> dict[str, torch.Tensor]:
        """Each projection input's max |x| per channel over the calibration batches."""
        modules = dict(self.module.named_modules())
        peaks: dict[str, torch.Tensor] = {}
        handles = []
        for conv in self.convs.values():

            def hook(_: Any, args: tuple[torch.Tensor, ...], n: str = conv) -> None:
                m = args[0].detach().abs().amax(dim=(0, 2, 3))
                peaks[n] = torch.maximum(peaks[n], m) if n in peaks else m

            handles.append(modules[conv].register_forward_pre_hook(hook))
        with torch.no_grad():
            for x, mask in self.calibration:
                self.module(x, mask)
        for h in handles:
            h.remove()
        return peaks

    def score_split(self, folds: list[Any], rule: Any, per_token: bool) -> tuple[float, float, int]:
        """W8A8 with each projection's ``rule(peaks)`` input channels taken out of the int8
        path (LLM.int8()-style): their weight columns zeroed before the int8 rows (so the row
        scales ignore them), their exact product added by an fp16 side conv on the original
        inputs; the int8 input scale is the other channels' max (static, per tensor) or, with
        ``per_token``, each position's max over them (dynamic: a static ``quantize`` op
        cannot express it). Returns (top-1, mean KL, channels kept fp16 in all)."""
        import torch.nn.functional as F

        from converter.compression.activations import fake_quantize
        from converter.compression.smooth import scale_tensors

        modules = dict(self.module.named_modules())
        params = dict(self.module.named_parameters())
        scale_tensors(self.module, folds, set())
        handles, kept = [], 0
        try:
            base = {s.name: params[s.name].detach().clone() for s in self.projections}
            peaks = self.channel_peaks()
            for weight, conv in self.convs.items():
                cols = rule(peaks[conv])
                kept += len(cols)
                w = base[weight]
                int8_part = w.clone()
                int8_part[:, cols] = 0
                with torch.no_grad():
                    params[weight].copy_(int8_rows(int8_part))
                side = w[:, cols].clone()
                rest = torch.ones_like(peaks[conv], dtype=torch.bool)
                rest[cols] = False
                static = max(float(peaks[conv][rest].max()) if rest.any() else 0.0, 1e-8) / 127
                seen: dict[str, torch.Tensor] = {}

                def keep_input(_: Any, args: Any, seen: Any = seen) -> None:
                    seen["x"] = args[0]

                def quantize(_: Any, args: Any, s: float = static, rest: Any = rest) -> Any:
                    x = args[0]
                    if not per_token:
                        return (fake_quantize(x, s),)
                    scale = x[:, rest].abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
                    return (torch.clamp(torch.round(x / scale), -128, 127) * scale,)

                def add_side(_: Any, a: Any, out: Any, seen: Any = seen, cols=cols, side=side):
                    if not cols:
                        return out
                    return out + F.conv2d(seen["x"][:, cols], side.to(out.dtype))

                module = modules[conv]
                handles += [
                    module.register_forward_pre_hook(keep_input),
                    module.register_forward_pre_hook(quantize),
                    module.register_forward_hook(add_side),
                ]
            kl, top1 = self.scorer.compare()
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for name, value in self.fp16.items():
                    params[name].copy_(value)
            scale_tensors(self.module, folds, {s.name for s in self.projections}, inverse=True)
        return top1, kl, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="fp16 artifact directory of the w8a8 recipe")
    parser.add_argument("--alpha", type=float, action="append", help="default 0.5, 0.75, 0.9")
    parser.add_argument(
        "--each-input", action="store_true", help="also each input's cost (120 runs, ~20 min)"
    )
    parser.add_argument(
        "--split", action="store_true", help="also input channels kept fp16, per-token scales"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # many small ops: one thread is faster (bench/README.md)
    start = time.perf_counter()
    setup = Setup(args.artifact)
    every = [s.name for s in setup.projections]
    rows: dict[str, Any] = {"positions": setup.held.positions}
    print(f"held-out: {setup.held.positions} positions; torch fp32, fp16-rounded weights")

    def show(label: str, top1: float, kl: float) -> None:
        print(f"  {label:<58} top-1 {top1:.3f}  mean KL {kl:.4f}", flush=True)

    print("(1) int8 weights per row, inputs fp16")
    rows["int8_weights"] = setup.score([], [])
    show("120 weights int8", *rows["int8_weights"])

    print("(2) folds: int8 weights with the folds (inputs fp16) / W8A8, every input int8")
    rows["folds"] = {}
    best: tuple[float, float | None] = (-1.0, None)
    for label, alpha, kinds in (
        ("no folds", None, ()),
        ("MLP down folds only, alpha 0.5", 0.5, ("mlp-down",)),
        *((f"every fold, alpha {a}", a, ()) for a in (args.alpha or [0.5, 0.75, 0.9])),
    ):
        folds = setup.folds(alpha, kinds)
        weights, w8a8 = setup.score(folds, []), setup.score(folds, every)
        rows["folds"][label] = {"int8_weights": weights, "w8a8": w8a8}
        show(f"{label}: weights", *weights)
        show(f"{label}: W8A8", *w8a8)
        if kinds == () and alpha is not None and w8a8[0] > best[0]:
            best = (w8a8[0], alpha)
    alpha = best[1]

    print(f"(3) at alpha {alpha}, one fold kind only: weights / W8A8, every input int8")
    rows["fold_kind"] = {}
    for kind in ("mlp-down", "attention-o", "norm"):
        folds = setup.folds(alpha, (kind,))
        weights, w8a8 = setup.score(folds, []), setup.score(folds, every)
        rows["fold_kind"][kind] = {"int8_weights": weights, "w8a8": w8a8}
        show(f"{kind} folds: weights", *weights)
        show(f"{kind} folds: W8A8", *w8a8)

    if args.each_input:
        folds = setup.folds(alpha)
        print(f"(4) every fold at alpha {alpha}; one projection kind's inputs int8")
        rows["by_kind"] = {}
        for kind in KINDS:
            chosen = [n for n in every if f".{kind}." in n]
            rows["by_kind"][kind] = setup.score(folds, chosen)
            show(f"{kind} inputs int8 ({len(chosen)})", *rows["by_kind"][kind])
        print("(5) each input int8 alone (its cost), then the most costly kept fp16")
        alone = {n: setup.score(folds, [n]) for n in every}
        order = sorted(every, key=lambda n: (alone[n][0], -alone[n][1]))
        rows["alone"] = {n: alone[n] for n in order}
        for n in order[:10]:
            show(f"{n} alone", *alone[n])
        rows["keep"] = {}
        for k in (0, 1, 2, 4, 8, 16, 32):
            top1, kl = setup.score(folds, order[k:])
            rows["keep"][k] = (top1, kl)
            show(f"{k} most costly inputs kept fp16, {len(every) - k} int8", top1, kl)
            if top1 >= 0.97:
                break
    if args.split:
        print("(6) input channels taken out of int8 (fp16 side conv), static / per-token scales")
        rows["split"] = {}
        rules = {
            "no channel": lambda peak: [],
            "4 widest channels": lambda peak: sorted(torch.argsort(-peak)[:4].tolist()),
            "16 widest channels": lambda peak: sorted(torch.argsort(-peak)[:16].tolist()),
            "channels above 4x median": lambda peak: (
                torch.nonzero(peak > 4 * peak.median()).flatten().tolist()
            ),
        }
        for fold_label, fold_alpha in (("no folds", None), ("every fold, alpha 0.5", 0.5)):
            folds = setup.folds(fold_alpha)
            for scales in ("static", "per-token"):
                for rule_label, rule in rules.items():
                    label = f"{fold_label}; {scales}; {rule_label}"
                    top1, kl, kept = setup.score_split(folds, rule, scales == "per-token")
                    rows["split"][label] = {"top1": top1, "kl": kl, "kept_channels": kept}
                    show(f"{label} ({kept} kept)", top1, kl)
    rows["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{rows['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=float))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
