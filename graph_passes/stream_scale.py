"""Keep every fp16 value of a decoder finite by exact power-of-two rescaling (SPEC section 2).

Two scales, both powers of two chosen from ranges measured in fp32 on the fixtures:

* **The residual stream scale** ``s``: the whole stream is carried as ``s * h``. It is folded
  into the embedding scale (the host table included) and into whatever writes into the stream:
  the output and down projections of a pre-norm block, or the gains of the norms after each
  branch (placement ``both``, Gemma), stored as the effective gain ``s * (offset + w)`` since a
  norm ignores its input's scale. Every norm that reads the stream gets ``eps * s^2``, which
  makes it compute exactly what it computed before: ``(s x) / sqrt(mean((s x)^2) + s^2 eps)
  = x / sqrt(mean(x^2) + eps)``. The LM head reads the final norm's output, so the logits do
  not change.
* **A branch scale** ``b`` where a value inside a branch would overflow although the stream
  does not: the MLP's ``act(gate) * up`` product or the down projection's output (scaled
  through the up projection: the product is linear in ``up``), or the attention output
  before its post-norm (scaled through the value projection: attention is linear in ``v``).
  A post-norm reading the branch gets ``eps * b^2``; without one, the output projection
  carries ``s / b`` instead of ``s``.

Multiplying by a power of two changes only the exponent, so no value is rounded, except that
small weights can fall into fp16's subnormal range (below 2^-14) or to zero (below 2^-25):
`ScaledTensor` counts them, because hardware that flushes subnormals would zero them (the
``fp16-acc`` evaluator profile flushes them and shows the effect).

Activations that feed a nonlinearity (the q/k/v and gate/up projections' outputs) cannot be
scaled exactly; they are measured and reported, and the fp16 gates judge them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from graph_passes.model import Block
from graph_passes.spec import CanonicalModel, LayerSpec, NormSpec

FP16_MAX = 65504.0
# The largest |value| the stream and the scalable branch values may reach on the fixtures:
# half of fp16's range (65,504 < 2^16), so inputs pushing a value to twice the largest one
# measured still stay finite. No lower: each halving moves the scaled weights one binade
# closer to fp16's subnormals.
LIMIT = 2.0**15
FP16_MIN_NORMAL = 2.0**-14


@dataclass
class LayerRange:
    """Largest |value| in one layer over the fixtures (every position, padding included), in
    fp32 on the unscaled model."""

    layer: int
    stream: float = 0.0  # the residual stream entering, inside and leaving the layer
    attention_out: float = 0.0  # output projection's output, before any post-norm
    mlp_product: float = 0.0  # act(gate) * up: the down projection's input
    mlp_out: float = 0.0  # down projection's output, before any post-norm
    projections: float = 0.0  # q/k/v and gate/up outputs: feed nonlinearities, not scalable


@dataclass(frozen=True)
class BranchScale:
    """A power-of-two scale on one branch of one layer, and the value that needed it."""

    layer: int
    branch: str  # "attention" or "mlp"
    scale: float
    measured: float  # the largest |value| inside the branch, unscaled

    @property
    def where(self) -> str:
        """The projection carrying the scale."""
        return f"layers.{self.layer}." + ("attn.v" if self.branch == "attention" else "mlp.up")


@dataclass(frozen=True)
class ScaledTensor:
    """One tensor multiplied by a power of two, and what that did to it in fp16."""

    name: str
    factor: float
    elements: int
    to_subnormal: int  # fp16-normal before, subnormal after
    to_zero: int  # non-zero in fp16 before, zero in fp16 after


@dataclass(frozen=True)
class StreamScaling:
    """The scales chosen for a decoder and the ranges they were chosen from."""

    scale: float  # the residual stream scale s
    peak: float  # the largest |h| on the residual stream (unscaled)
    branches: tuple[BranchScale, ...]
    layers: tuple[LayerRange, ...]
    tensors: tuple[ScaledTensor, ...] = ()  # filled by `apply_stream_scaling`

    @property
    def identity(self) -> bool:
        """True when nothing needs scaling."""
        return self.scale == 1.0 and not self.branches

    @property
    def to_subnormal(self) -> int:
        """Weights the scaling pushed into fp16 subnormals, over every scaled tensor."""
        return sum(t.to_subnormal for t in self.tensors)

    @property
    def to_zero(self) -> int:
        """Weights the scaling pushed to zero in fp16, over every scaled tensor."""
        return sum(t.to_zero for t in self.tensors)


def power_of_two_below(peak: float, limit: float = LIMIT) -> float:
    """The largest power of two ``k <= 1`` with ``peak * k <= limit``."""
    if not math.isfinite(peak):
        raise ValueError(f"a measured range is not finite ({peak}): the fp32 model overflows")
    if peak <= limit:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(peak / limit))


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().amax())


@contextmanager
def recording_ranges(layers: list[Block]) -> Iterator[list[LayerRange]]:
    """Hooks that record each layer's `LayerRange` while the model runs inside the block."""
    ranges = [LayerRange(i) for i in range(len(layers))]
    handles = []

    def keep(row: LayerRange, field: str, value: float) -> None:
        setattr(row, field, max(getattr(row, field), value))

    for row, layer in zip(ranges, layers, strict=True):
        down = layer.mlp.get_submodule("down")

        def on_input(_: nn.Module, args: tuple[torch.Tensor, ...], row: LayerRange = row) -> None:
            keep(row, "stream", _amax(args[0]))

        def on_output(field: str, row: LayerRange = row) -> Callable[..., None]:
            def hook(_: nn.Module, __: object, out: torch.Tensor) -> None:
                keep(row, field, _amax(out))

            return hook

        def on_product(_: nn.Module, args: tuple[torch.Tensor, ...], row: LayerRange = row) -> None:
            keep(row, "mlp_product", _amax(args[0]))

        handles += [
            layer.register_forward_pre_hook(on_input),
            layer.register_forward_hook(on_output("stream")),
            layer.mlp_norm.register_forward_pre_hook(on_input),  # the stream mid-layer
            layer.attention.register_forward_hook(on_output("attention_out")),
            layer.attention.qkv.register_forward_hook(on_output("projections")),
            down.register_forward_pre_hook(on_product),
            down.register_forward_hook(on_output("mlp_out")),
        ]
        for out_norm in (layer.attention_out_norm, layer.mlp_out_norm):
            if out_norm is not None:  # what a post-norm adds to the stream
                handles.append(out_norm.register_forward_hook(on_output("stream")))
        for name in ("gate_up", "up"):  # a gated or a plain MLP
            if hasattr(layer.mlp, name):
                handles.append(
                    layer.mlp.get_submodule(name).register_forward_hook(on_output("projections"))
                )
    try:
        yield ranges
    finally:
        for handle in handles:
            handle.remove()


def plan_stream_scaling(specs: tuple[LayerSpec, ...], ranges: list[LayerRange]) -> StreamScaling:
    """Choose ``s`` and the branch scales from the measured ranges (see the module docstring).

    In a pre-norm block the output projections write into the stream, so ``s`` covers their
    outputs too; a post-norm block's branch outputs never reach the stream.
    """
    peak = 0.0
    for spec, row in zip(specs, ranges, strict=True):
        if spec.placement == "post":
            raise ValueError("the residual stream scale applies to pre- and both-norm blocks")
        peak = max(peak, row.stream)
        if spec.placement == "pre":
            peak = max(peak, row.attention_out, row.mlp_out)
    scale = power_of_two_below(peak)
    branches = []
    for spec, row in zip(specs, ranges, strict=True):
        inside = {"mlp": row.mlp_product}
        if spec.placement == "both":  # before the post-norm: the branch's own scale
            inside = {"attention": row.attention_out, "mlp": max(row.mlp_product, row.mlp_out)}
        for branch, value in inside.items():
            b = power_of_two_below(value)
            if b != 1.0:
                branches.append(BranchScale(row.layer, branch, b, value))
    return StreamScaling(scale, peak, tuple(branches), tuple(ranges))


def _scaled(name: str, tensor: torch.Tensor, factor: float) -> tuple[torch.Tensor, ScaledTensor]:
    return tensor * factor, _record(name, tensor, factor)


_CHUNK = 1 << 22  # elements per step of a record: fp16 copies and masks of a chunk, not a table


def _record(name: str, tensor: torch.Tensor, factor: float, pre: float = 1.0) -> ScaledTensor:
    """What scaling ``tensor * pre`` by ``factor`` does to its fp16 values, counted a chunk at
    a time (Gemma 3's 262,144 x 640 embedding whole: 2.5 GB of temporaries)."""
    to_subnormal = to_zero = 0
    for part in tensor.reshape(-1).split(_CHUNK):
        before = part * pre if pre != 1.0 else part
        before16, after16 = before.half(), (before * factor).half()
        normal = before16.abs() >= FP16_MIN_NORMAL
        to_subnormal += int((normal & (after16.abs() < FP16_MIN_NORMAL) & (after16 != 0)).sum())
        to_zero += int(((before16 != 0) & (after16 == 0)).sum())
    return ScaledTensor(
        name=name,
        factor=factor,
        elements=tensor.numel(),
        to_subnormal=to_subnormal,
        to_zero=to_zero,
    )


def _with_eps(norm: NormSpec, factor: float) -> NormSpec:
    return replace(norm, eps=norm.eps * factor * factor)


def apply_stream_scaling(
    model: CanonicalModel, plan: StreamScaling
) -> tuple[CanonicalModel, StreamScaling]:
    """``model`` computing the same function with the scales of ``plan`` folded in (unchanged
    tensors are shared), and ``plan`` with the record of every tensor it scaled."""
    spec, s = model.spec, plan.scale
    weights = dict(model.weights)
    records: list[ScaledTensor] = []

    def scale(name: str, factor: float) -> None:
        if factor != 1.0 and name in weights:
            weights[name], record = _scaled(name, weights[name], factor)
            records.append(record)

    if s != 1.0:  # the embeddings: through the spec, so the host table gets it too
        name = "embed.weight (times the embedding scale)"
        records.append(_record(name, weights["embed.weight"], s, pre=spec.embed_scale))
    branch = {(b.layer, b.branch): b.scale for b in plan.branches}
    layers = []
    for i, ls in enumerate(spec.layers):
        p = f"layers.{i}"
        b_attn, b_mlp = branch.get((i, "attention"), 1.0), branch.get((i, "mlp"), 1.0)
        for name in ("attn.v.weight", "attn.v.bias"):
            scale(f"{p}.{name}", b_attn)
        for name in ("mlp.up.weight", "mlp.up.bias"):
            scale(f"{p}.{name}", b_mlp)
        if ls.placement == "both":
            assert ls.attention_out_norm is not None and ls.mlp_out_norm is not None
            # Each branch output is b times the original; its bias must follow.
            scale(f"{p}.attn.o.bias", b_attn)
            scale(f"{p}.mlp.down.bias", b_mlp)
            # The post-norm's gain carries s, stored as the effective gain s * (offset + w).
            for slot, norm in (
                ("attn_out_norm", ls.attention_out_norm),
                ("mlp_out_norm", ls.mlp_out_norm),
            ):
                name = f"{p}.{slot}.weight"
                weights[name] = weights[name] + norm.weight_offset
                scale(name, s)
            ls = replace(
                ls,
                attention_out_norm=replace(
                    _with_eps(ls.attention_out_norm, b_attn), weight_offset=0.0
                ),
                mlp_out_norm=replace(_with_eps(ls.mlp_out_norm, b_mlp), weight_offset=0.0),
            )
        else:  # the output projections write s * (the original) into the stream
            scale(f"{p}.attn.o.weight", s / b_attn)
            scale(f"{p}.attn.o.bias", s)
            scale(f"{p}.mlp.down.weight", s / b_mlp)
            scale(f"{p}.mlp.down.bias", s)
        attention_norm = ls.attention_norm and _with_eps(ls.attention_norm, s)
        mlp_norm = _with_eps(ls.mlp_norm, s)
        layers.append(replace(ls, attention_norm=attention_norm, mlp_norm=mlp_norm))
    new_spec = replace(
        spec,
        layers=tuple(layers),
        final_norm=_with_eps(spec.final_norm, s),
        stream_scale=spec.stream_scale * s,
    )
    return CanonicalModel(new_spec, weights), replace(plan, tensors=tuple(records))
