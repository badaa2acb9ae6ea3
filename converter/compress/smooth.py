"""SmoothQuant-style folds for W8A8: move an MLP down projection's input outliers into weights.

One per-tensor int8 scale cannot hold SmolLM2's down-projection inputs: a few intermediate
channels reach 3,058 (layer 11) while the median input range is 5.2, so the scale that keeps
them zeroes every ordinary value (top-1 0.60, issue 12). Per-channel activation scales cannot
sit inside an int8 x int8 accumulation, but they can be folded into weights:

    down(silu(g) * u)  =  (W_down diag(s)) (silu(g) * (u / s))  =  W_down' (silu(g) * u')

with ``u / s`` the up projection's rows divided by ``s`` (``silu(g) * (u / s) = (silu(g) * u)
/ s``: the gate is untouched) and the down projection's input columns multiplied by ``s``.
The down input becomes ``x / s``, whose channels the per-tensor int8 scale then serves alike.

``s_j = max|x_j|**alpha / max_i|W_down[i, j]|**(1 - alpha)`` (SmoothQuant's migration
strength, alpha 0.5), from the fp16 program's own down inputs on the calibration text (MIL
evaluator), rounded to a power of two: multiplying or dividing an fp16 weight by 2**k is exact
(barring overflow and subnormals, both checked), so the fold changes no function value, only
where the int8 rounding falls. Each fold is recorded (layer, scale range, why).

Not folded here (issue 12 lists them; left for later): the output projection's input into the
value rows (query heads sharing a kv head share a scale) and the q/k/v and gate/up inputs into
the preceding norm's weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from converter.compress.sites import WeightSite
from converter.errors import InputError

ALPHA = 0.5  # SmoothQuant's migration strength: half the outlier moves into the weights
WHY = (
    "silu(g) * (u / s) = (silu(g) * u) / s and W_down diag(s) (x / s) = W_down x; s is a power "
    "of two, so both weight changes are exact in fp16"
)


@dataclass(frozen=True)
class Fold:
    """One recorded fold: the down projection's input scales into the up rows and down
    columns of one MLP."""

    down: str  # torch name of the down weight (its input columns are multiplied by s)
    gate_up: str  # torch name of the fused gate/up weight (its up rows are divided by s)
    scales: np.ndarray  # (I,) powers of two
    input_max_before: float  # max |x| of the down input over the calibration text
    input_max_after: float  # the same, divided by s channel by channel
    limited: int = 0  # channels whose scale moved toward 1 to keep the fold exact

    def to_json(self) -> dict[str, Any]:
        """The record in the manifest."""
        log2 = np.log2(self.scales)
        return {
            "down": self.down,
            "up_rows_of": self.gate_up,
            "scales": "powers of two, one per intermediate channel",
            "log2_scale_min": int(log2.min()),
            "log2_scale_max": int(log2.max()),
            "input_max_before": self.input_max_before,
            "input_max_after": self.input_max_after,
            "channels_limited_for_exactness": self.limited,
            "why_exact": WHY,
        }


def down_pairs(sites: list[WeightSite]) -> list[tuple[WeightSite, WeightSite]]:
    """(gate_up, down) weight sites of every MLP (``<prefix>.gate_up.weight`` beside
    ``<prefix>.down.weight``)."""
    by_name = {s.name: s for s in sites}
    pairs = []
    for site in sites:
        if site.name.endswith(".down.weight"):
            prefix = site.name[: -len(".down.weight")]
            gate_up = by_name.get(f"{prefix}.gate_up.weight")
            if gate_up is not None:
                pairs.append((gate_up, site))
    return pairs


def measure_folds(
    function: Any,
    evaluator: Any,
    feeds: list[dict[str, np.ndarray]],
    pairs: list[tuple[WeightSite, WeightSite]],
) -> list[Fold]:
    """The fold of every (gate_up, down) pair from the down convs' inputs over ``feeds``."""
    consts = {op.outputs[0].name: op for op in function.operations if op.op_type == "const"}
    const_of = {s.name: s.const for pair in pairs for s in pair}
    inputs: dict[str, str] = {}
    for op in function.operations:
        if op.op_type == "conv" and op.inputs["weight"].name in {d.const for _, d in pairs}:
            if "bias" in op.inputs and op.inputs["bias"] is not None:
                raise InputError(f"{op.name}: smoothing a down projection with a bias")
            inputs[op.inputs["weight"].name] = op.inputs["x"].name
    peak = {name: None for name in inputs.values()}
    for feed in feeds:
        captured = evaluator.run(feed, capture=list(peak)).captured
        for name, value in captured.items():
            m = np.abs(np.asarray(value, np.float32)).max(axis=(0, 2, 3))
            peak[name] = m if peak[name] is None else np.maximum(peak[name], m)  # type: ignore[call-overload]
    folds = []
    for gate_up, down in pairs:
        x = np.asarray(peak[inputs[down.const]], np.float64)
        w = np.abs(np.asarray(consts[down.const].outputs[0].val, np.float64)).max(axis=(0, 2, 3))
        raw = np.where((x > 0) & (w > 0), x**ALPHA / np.maximum(w, 1e-12) ** (1 - ALPHA), 1.0)
        wanted = np.round(np.log2(raw)).astype(int)
        down_w = np.asarray(consts[const_of[down.name]].outputs[0].val, np.float32)
        up_w = np.asarray(consts[const_of[gate_up.name]].outputs[0].val, np.float32)
        exponents, limited = exact_exponents(down_w, up_w[down_w.shape[1] :], wanted)
        scales = 2.0**exponents
        folds.append(
            Fold(
                down.name, gate_up.name, scales, float(x.max()), float((x / scales).max()),
                limited,
            )
        )  # fmt: skip
    return folds


def _exact(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def exact_exponents(down: np.ndarray, up: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, int]:
    """Per channel j, the power-of-two exponent nearest ``wanted[j]`` (moving toward 0) for
    which ``down[:, j] * 2**k`` and ``up[j] / 2**k`` are exact in fp16 (no overflow, no bit
    lost in a subnormal); and how many channels had to move. k = 0 is always exact."""
    out = wanted.copy()
    limited = 0
    for j, k in enumerate(wanted):
        while k != 0:
            s = np.float32(2.0**k)
            if _exact(down[:, j] * s) and _exact(up[j] / s):
                break
            k += -1 if k > 0 else 1
        if k != wanted[j]:
            limited += 1
        out[j] = k
    return out, limited


def folded_weights(
    function: Any, sites: list[WeightSite], folds: list[Fold]
) -> dict[str, np.ndarray]:
    """The new values (fp16) of every weight constant a fold changes, by constant name;
    raises when a change would overflow fp16 or create a subnormal (then it is not exact)."""
    consts = {op.outputs[0].name: op for op in function.operations if op.op_type == "const"}
    const_of = {s.name: s.const for s in sites}
    out: dict[str, np.ndarray] = {}
    for fold in folds:
        down = np.asarray(consts[const_of[fold.down]].outputs[0].val, np.float32)
        gate_up = np.asarray(consts[const_of[fold.gate_up]].outputs[0].val, np.float32)
        inter = down.shape[1]
        if gate_up.shape[0] != 2 * inter:
            raise InputError(f"{fold.gate_up}: {gate_up.shape[0]} rows, expected 2 x {inter}")
        s = fold.scales.astype(np.float32)
        new_down = down * s[None, :, None, None]
        new_gate_up = gate_up.copy()
        new_gate_up[inter:] = gate_up[inter:] / s[:, None, None, None]  # the up half
        for name, after in ((fold.down, new_down), (fold.gate_up, new_gate_up)):
            # exact unless a value overflows fp16 or loses bits as a subnormal: refuse then
            if not np.array_equal(after.astype(np.float16).astype(np.float32), after):
                raise InputError(f"{name}: a power-of-two fold leaves fp16's exact range")
        out[const_of[fold.down]] = new_down.astype(np.float16)
        out[const_of[fold.gate_up]] = new_gate_up.astype(np.float16)
    return out


def replace_constants(mlmodel: Any, values: dict[str, np.ndarray]) -> Any:
    """A new MLModel whose named const ops hold ``values`` (names kept: plans find them)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.models.utils import _apply_graph_pass

    from converter.compress.methods.base import quiet_progress

    class Replace(AbstractGraphPass):
        def apply(self, prog: Any) -> None:
            f = prog.functions["main"]
            ops = {op.outputs[0].name: op for op in f.operations if op.op_type == "const"}
            missing = sorted(set(values) - set(ops))
            if missing:
                raise KeyError(f"constants not in the program: {missing[:5]}")
            with f:
                for name, value in values.items():
                    old = ops[name]
                    new = mb.const(val=value, before_op=old)
                    f.replace_uses_of_var_after_op(
                        anchor_op=old, old_var=old.outputs[0], new_var=new
                    )
                    f.remove_ops([old])
                    new.name = name
                    new.op.name = name

    with quiet_progress():
        return _apply_graph_pass(mlmodel, Replace())
