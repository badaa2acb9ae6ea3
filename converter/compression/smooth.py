"""SmoothQuant-style folds for W8A8: move a projection's input outliers into weights, exactly.

One per-tensor int8 scale cannot hold SmolLM2's projection inputs: a few MLP intermediate
channels reach 3,058 (layer 11) while the median input range is 5.2, so the scale that keeps
them zeroes every ordinary value (top-1 0.60, issue 12). Per-channel activation scales cannot
sit inside an int8 x int8 accumulation, but they can be folded into weights: a projection
``W x`` computes ``(W diag(s)) (x / s)``, and ``x / s`` is made by dividing, channel by channel,
whatever produces ``x``. Three producers allow that exactly:

* ``mlp-down``: the down input is ``act(g) * u``; dividing the up rows (and bias) by ``s``
  gives ``act(g) * (u / s) = (act(g) * u) / s``, the gate untouched.
* ``attention-o``: the o input is each head's ``softmax(q k^T) v``, linear in ``v``; dividing
  the value rows (and bias) by ``s`` divides the head output. Query heads sharing a kv head
  read the same value rows, so they share the scale (one per kv head and head channel).
* ``norm``: the q/k/v and gate/up inputs are a norm's ``normalised * gamma``; dividing
  ``gamma`` by ``s`` divides the norm's output (only when every reader of it is a projection
  taking the fold).

``s_j = max|x_j|**alpha / max_i|W[i, j]|**(1 - alpha)`` (SmoothQuant's migration strength),
from the fp16 program's own inputs on the calibration text (MIL evaluator), rounded to a power
of two: multiplying or dividing an fp16 value by 2**k is exact barring overflow and subnormals,
so each channel's exponent moves toward 0 until every value it touches stays exact. The folded
program then computes bit for bit what the fp16 program computes; only where int8 rounding
falls changes. Each fold is recorded (kind, projection, scale range, why exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from converter.compression.sites import WeightSite
from converter.errors import InputError

ALPHA = 0.5  # SmoothQuant's default migration strength: half the outlier moves into weights
KINDS = ("mlp-down", "attention-o", "norm")  # the order folds are measured and applied in
WHY = {
    "mlp-down": "act(g) * (u / s) = (act(g) * u) / s and (W diag(s)) (x / s) = W x",
    "attention-o": "softmax(q k^T) (v / s) = (softmax(q k^T) v) / s, one s per kv head's "
    "channel for the query heads sharing it, and (W diag(s)) (x / s) = W x",
    "norm": "normalised * (gamma / s) = (normalised * gamma) / s and (W diag(s)) (x / s) = W x",
}
POWER_OF_TWO = "s is a power of two per channel, so every changed fp16 value is exact"


@dataclass(frozen=True)
class Scaling:
    """``tensor[start : start + len(factors)]`` along ``axis`` multiplied by ``factors``
    (powers of two): the same change to a torch tensor and to the program constant holding it."""

    tensor: str  # torch parameter or buffer name
    const: str  # the program's const op name
    axis: int
    start: int
    factors: np.ndarray  # float32 powers of two


@dataclass(frozen=True)
class Fold:
    """One recorded fold: the input of ``consumer`` divided by ``scales``, its producer
    divided and its columns multiplied to match (``scalings``)."""

    kind: str
    consumer: str  # torch name of the projection weight whose input becomes x / s
    scales: np.ndarray  # (C,) per input channel of the consumer
    input_max_before: float  # max |x| over the calibration text
    input_max_after: float  # the same, divided by s channel by channel
    limited: int  # scale groups moved toward 1 to keep every value exact
    scalings: tuple[Scaling, ...]

    def to_json(self) -> dict[str, Any]:
        """The record in the manifest."""
        log2 = np.log2(self.scales)
        return {
            "kind": self.kind,
            "projection": self.consumer,
            "divided": sorted({s.tensor for s in self.scalings} - {self.consumer}),
            "scales": "powers of two, one per input channel",
            "log2_scale_min": int(log2.min()),
            "log2_scale_max": int(log2.max()),
            "input_max_before": self.input_max_before,
            "input_max_after": self.input_max_after,
            "groups_limited_for_exactness": self.limited,
            "why_exact": f"{WHY[self.kind]}; {POWER_OF_TWO}",
        }


@dataclass(frozen=True)
class Candidate:
    """A fold that can be made: the consumer conv, its input, and what divides the input.

    ``divided`` holds (torch tensor, const, axis, start) of each producer slice; ``groups``
    maps each consumer input channel to its scale group (the producer slice's index)."""

    kind: str
    site: WeightSite
    input: str  # the program value the consumer conv reads
    divided: tuple[tuple[str, str, int, int], ...]
    groups: np.ndarray  # (C,) int


def _consts(function: Any) -> dict[str, Any]:
    return {op.outputs[0].name: op for op in function.operations if op.op_type == "const"}


def _bias(op: Any) -> str | None:
    bias = op.inputs.get("bias")
    return None if bias is None else bias.name


def candidates(
    function: Any, module: Any, sites: list[WeightSite], consumers: list[WeightSite]
) -> tuple[list[Candidate], dict[str, str]]:
    """The folds possible for each of ``consumers`` (projections whose input is quantized),
    in ``KINDS`` order, and why each other consumer gets none."""
    graph = _Graph(
        {s.name: s for s in sites},
        {op.inputs["weight"].name: op for op in function.operations if op.op_type == "conv"},
        _consts(function),
        module,
    )
    found: list[Candidate] = []
    skipped: dict[str, str] = {}
    for site in consumers:
        conv = graph.convs.get(site.const)
        leaf = site.name.rsplit(".", 2)[-2]
        make = {"down": _mlp_down, "o": _attention_o, "qkv": _norm, "gate_up": _norm}.get(leaf)
        if conv is None:
            skipped[site.name] = "no conv reads it"
        elif make is None:
            skipped[site.name] = "no producer anec knows how to divide"
        else:
            made = make(graph, site, conv)
            if isinstance(made, str):
                skipped[site.name] = made
            else:
                found.append(made)
    found.sort(key=lambda c: KINDS.index(c.kind))
    return found, skipped


@dataclass(frozen=True)
class _Graph:
    sites: dict[str, WeightSite]  # by torch name
    convs: dict[str, Any]  # conv op by its weight const's name
    consts: dict[str, Any]
    module: Any


def _mlp_down(g: _Graph, site: WeightSite, conv: Any) -> Candidate | str:
    prefix = site.name.rsplit(".", 2)[0]
    width = site.shape[1]
    producer = g.sites.get(f"{prefix}.gate_up.weight")
    up_conv = g.convs.get(producer.const) if producer else None
    if producer is None or up_conv is None or producer.shape[0] != 2 * width:
        return "no fused gate/up projection of twice its width"
    divided = [(producer.name, producer.const, 0, width)]  # the up half: act(gate) * up
    if (b := _bias(up_conv)) is not None:
        divided.append((f"{prefix}.gate_up.bias", b, 0, width))
    return Candidate("mlp-down", site, conv.inputs["x"].name, tuple(divided), np.arange(width))


def _attention_o(g: _Graph, site: WeightSite, conv: Any) -> Candidate | str:
    prefix = site.name.rsplit(".", 2)[0]
    width = site.shape[1]
    producer = g.sites.get(f"{prefix}.qkv.weight")
    qkv_conv = g.convs.get(producer.const) if producer else None
    try:
        spec = g.module.get_submodule(prefix).spec
    except AttributeError:
        spec = None
    if producer is None or qkv_conv is None or spec is None:
        return "no fused qkv projection beside it"
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    if width != heads * d or producer.shape[0] != (heads + 2 * kv) * d:
        return f"{width} inputs do not match {heads} heads of {d}"
    start = (heads + kv) * d  # the value rows follow the query and key rows
    divided = [(producer.name, producer.const, 0, start)]
    if (b := _bias(qkv_conv)) is not None:
        divided.append((f"{prefix}.qkv.bias", b, 0, start))
    head, channel = np.divmod(np.arange(width), d)
    groups = (head // spec.group_size) * d + channel  # query head h reads kv head h // group
    return Candidate("attention-o", site, conv.inputs["x"].name, tuple(divided), groups)


def _norm(g: _Graph, site: WeightSite, conv: Any) -> Candidate | str:
    block, leaf = site.name.rsplit(".", 3)[0], site.name.rsplit(".", 2)[-2]
    norm_name = f"{block}.{'attention_norm' if leaf == 'qkv' else 'mlp_norm'}"
    why = _norm_problem(conv, g.consts, g.module, norm_name)
    if why is not None:
        return why
    gamma = conv.inputs["x"].op.inputs["y"].name
    divided = ((f"{norm_name}.gamma", gamma, 1, 0),)
    return Candidate("norm", site, conv.inputs["x"].name, divided, np.arange(site.shape[1]))


def _norm_problem(conv: Any, consts: dict[str, Any], module: Any, norm_name: str) -> str | None:
    """Why the conv's input is not ``normalised * gamma`` of the torch norm ``norm_name`` read
    by this conv alone (None: it is)."""
    mul = conv.inputs["x"].op
    if mul is None or mul.op_type != "mul" or mul.inputs["y"].name not in consts:
        return "its input is not a norm's gain product"
    if [c.name for c in mul.outputs[0].child_ops] != [conv.name]:
        return "the norm's output has readers other than this projection"
    try:
        gamma = module.get_buffer(f"{norm_name}.gamma")
    except AttributeError:
        return f"no norm {norm_name} with a gain in the module"
    stored = np.asarray(consts[mul.inputs["y"].name].outputs[0].val, np.float32)
    if stored.shape != tuple(gamma.shape) or not np.array_equal(
        stored, gamma.detach().half().float().numpy()
    ):
        return f"the program's gain is not {norm_name}.gamma"
    return None


def input_peaks(
    evaluator: Any, feeds: list[dict[str, np.ndarray]], names: list[str]
) -> dict[str, np.ndarray]:
    """max |x| per channel of each named (B, C, 1, L) program value over ``feeds``."""
    peak: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, value in evaluator.run(feed, capture=names).captured.items():
            m = np.abs(np.asarray(value, np.float32)).max(axis=(0, 2, 3))
            peak[name] = np.maximum(peak[name], m) if name in peak else m
    return peak


def measure_folds(
    function: Any,
    evaluator: Any,
    feeds: list[dict[str, np.ndarray]],
    found: list[Candidate],
    alpha: float = ALPHA,
) -> list[Fold]:
    """Each candidate's fold, measured on the fp16 program's inputs over ``feeds`` and the
    weights as the folds before it left them (``found`` in ``KINDS`` order)."""
    touched = {c.site.const for c in found} | {d[1] for c in found for d in c.divided}
    values = {
        name: np.asarray(op.outputs[0].val, np.float32)
        for name, op in _consts(function).items()
        if name in touched
    }
    peaks = input_peaks(evaluator, feeds, sorted({c.input for c in found}))
    folds = []
    for c in found:
        fold = _fold(c, peaks[c.input].astype(np.float64), values, alpha)
        for s in fold.scalings:
            values[s.const] = _scaled(values[s.const], s)
        folds.append(fold)
    return folds


def _fold(c: Candidate, x: np.ndarray, values: dict[str, np.ndarray], alpha: float) -> Fold:
    weight = values[c.site.const]  # (O, C, 1, 1)
    columns = np.abs(weight).max(axis=(0, 2, 3)).astype(np.float64)
    count = int(c.groups.max()) + 1
    xg = np.zeros(count)
    wg = np.zeros(count)
    np.maximum.at(xg, c.groups, x)
    np.maximum.at(wg, c.groups, columns)
    ok = (xg > 0) & (wg > 0)
    raw = np.where(ok, xg ** alpha / np.maximum(wg, 1e-30) ** (1 - alpha), 1.0)  # fmt: skip
    wanted = np.round(np.log2(raw)).astype(int)
    members = [np.flatnonzero(c.groups == g) for g in range(count)]
    exps, limited = exact_exponents(
        weight, members, [(values[d[1]], d[2], d[3]) for d in c.divided], wanted
    )
    per_channel = (2.0 ** exps[c.groups]).astype(np.float32)
    per_group = (2.0**-exps).astype(np.float32)
    scalings = [Scaling(c.site.name, c.site.const, 1, 0, per_channel)]
    scalings += [Scaling(t, const, axis, start, per_group) for t, const, axis, start in c.divided]
    return Fold(
        c.kind, c.site.name, per_channel.astype(np.float64), float(x.max()),
        float((x / per_channel).max()), limited, tuple(scalings),
    )  # fmt: skip


def _exact(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def exact_exponents(
    weight: np.ndarray,
    members: list[np.ndarray],
    divided: list[tuple[np.ndarray, int, int]],
    wanted: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Per scale group g, the exponent nearest ``wanted[g]`` (moving toward 0) for which the
    consumer's columns ``members[g]`` times 2**k and each divided slice's index g over 2**k
    stay exact in fp16; and how many groups had to move. k = 0 is always exact."""
    out = wanted.copy()
    limited = 0
    for g, k in enumerate(wanted):
        cols = weight[:, members[g]]
        parts = [np.take(v, start + g, axis=axis) for v, axis, start in divided]
        while k != 0:
            s = np.float32(2.0**k)
            if _exact(cols * s) and all(_exact(p / s) for p in parts):
                break
            k += -1 if k > 0 else 1
        if k != wanted[g]:
            limited += 1
        out[g] = k
    return out, limited


def _scaled(value: np.ndarray, s: Scaling) -> np.ndarray:
    out = value.copy()
    index: list[Any] = [slice(None)] * value.ndim
    index[s.axis] = slice(s.start, s.start + s.factors.size)
    shape = [1] * value.ndim
    shape[s.axis] = s.factors.size
    out[tuple(index)] = value[tuple(index)] * s.factors.reshape(shape)
    return out


def folded_constants(function: Any, folds: list[Fold]) -> dict[str, np.ndarray]:
    """The new fp16 value of every program constant the folds change, by const name; raises
    when a value would leave fp16's exact range (then the fold is not exact)."""
    consts = _consts(function)
    out: dict[str, np.ndarray] = {}
    for fold in folds:
        for s in fold.scalings:
            before = out[s.const] if s.const in out else consts[s.const].outputs[0].val
            out[s.const] = _scaled(np.asarray(before, np.float32), s)
    for const, value in out.items():
        if not _exact(value):
            raise InputError(f"{const}: a power-of-two fold leaves fp16's exact range")
    return {const: value.astype(np.float16) for const, value in out.items()}


def scale_tensors(module: Any, folds: list[Fold], skip: set[str], inverse: bool = False) -> None:
    """Apply every fold's scalings to ``module``'s own tensors in place (``inverse``: undo
    them), except the tensors named in ``skip`` (those that already hold the program's
    decoded, folded values). Powers of two: applying and undoing restores every bit."""
    import torch

    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for fold in folds:
            for s in fold.scalings:
                if s.tensor in skip:
                    continue
                t = tensors[s.tensor]
                factors = torch.from_numpy(1.0 / s.factors if inverse else s.factors)
                shape = [1] * t.ndim
                shape[s.axis] = factors.numel()
                t.narrow(s.axis, s.start, factors.numel()).mul_(factors.reshape(shape).to(t.dtype))


def unfolded(decoded: dict[str, np.ndarray], folds: list[Fold]) -> dict[str, np.ndarray]:
    """The decoded weights with every fold undone: what they stand for in the original model
    (for the weight-error table; the program computes the same function)."""
    out = {name: np.asarray(value, np.float32) for name, value in decoded.items()}
    for fold in folds:
        for s in fold.scalings:
            if s.tensor in out:
                undo = Scaling(s.tensor, s.const, s.axis, s.start, 1.0 / s.factors)
                out[s.tensor] = _scaled(out[s.tensor], undo)
    return {name: value.astype(np.float16) for name, value in out.items()}


def replace_constants(mlmodel: Any, values: dict[str, np.ndarray]) -> Any:
    """A new MLModel whose named const ops hold ``values`` (names kept: plans find them)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.models.utils import _apply_graph_pass

    from converter.compression.methods.base import quiet_progress

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


@dataclass(frozen=True)
class Smoothing:
    """Every fold of one variant, with the projections left unfolded and why."""

    alpha: float
    folds: list[Fold]
    skipped: dict[str, str]  # consumer weight -> why it has no fold

    def to_json(self) -> dict[str, Any]:
        """The ``smoothing`` section of the manifest and parity report."""
        return {
            "alpha": self.alpha,
            "folds": [f.to_json() for f in self.folds],
            "not_folded": self.skipped,
        }

    def text(self) -> str:
        """Folds per kind and the widest input before and after, for parity.txt."""
        lines = [f"smoothing (alpha {self.alpha}): {len(self.folds)} folds, exact (powers of two)"]
        for kind in KINDS:
            mine = [f for f in self.folds if f.kind == kind]
            if mine:
                worst = max(mine, key=lambda f: f.input_max_before)
                lines.append(
                    f"  {kind:<12} {len(mine):>3} folds; widest input {worst.consumer}: max |x| "
                    f"{worst.input_max_before:.1f} -> {worst.input_max_after:.1f}"
                )
        for name, why in sorted(self.skipped.items()):
            lines.append(f"  not folded: {name}: {why}")
        return "\n".join(lines)


def smooth(
    function: Any,
    module: Any,
    sites: list[WeightSite],
    consumers: list[WeightSite],
    evaluator: Any,
    feeds: list[dict[str, np.ndarray]],
    alpha: float = ALPHA,
) -> Smoothing:
    """Every fold possible for ``consumers`` (projections whose input is quantized), measured
    on ``evaluator`` (the fp16 program) over ``feeds``."""
    found, skipped = candidates(function, module, sites, consumers)
    return Smoothing(alpha, measure_folds(function, evaluator, feeds, found, alpha), skipped)
