"""``method: scaled``: per-output-channel scales as an explicit exact rewrite, then k-means
palettes (stored as ``lut`` stores them) of the scaled weights.

``W = diag(s) W'``: each output channel (row) ``i`` of a 1x1 conv weight is divided by
``s_i``, the power of two nearest its largest |w| (moved toward 1 where a value would lose a
bit: a power of two divides an fp16 value exactly otherwise), so every row of ``W'`` spans
about [-1, 1] and one palette (per tensor, or per group of rows) serves rows whose ranges
differed by orders of magnitude. ``W'`` is palettized; the program multiplies the conv's
output by ``s`` (a ``mul`` after the conv, ``s`` fp16 of shape (1, O, 1, 1)):
``conv(x, diag(s) W') = s * conv(x, W')`` per output channel, exact in real arithmetic and,
``s`` being a power of two, exact in fp16 too.

Not coremltools' ``enable_per_channel_scale``: that takes the maximum across the output-channel
axis (one scale per *input* column) and, with grouped palettes, multiplies the table count
(issue 12: a 512x256 lut4 group-8 weight went from 0.258x to 2.25x the fp16 bytes).

Every extra byte counts: ``s`` (O fp16 values) is added to the weight's record. The torch level
multiplies the same conv outputs by ``s`` through a forward hook (``Inspected.wrap``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Inspected,
    Problem,
    Scheme,
    Selection,
    VariantFields,
)
from converter.compression.methods.lut import METHOD as LUT

_SUFFIX = "_row_scale"


class Scaled(CompressionMethod):
    """Rows scaled by powers of two (an exact rewrite), then palettized."""

    name = "scaled"
    summary = (
        "rows divided by a power-of-two scale each (undone by a mul after the conv), then "
        "palettized"
    )
    order = 60
    tasks = frozenset({"text-generation"})

    def check(self, variant: VariantFields) -> list[Problem]:
        return LUT.check(variant)

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        return LUT.features(variant)

    def scheme(self, variant: VariantFields) -> Scheme:
        return LUT.scheme(variant)

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with each planned weight's rows divided by their scale and a ``mul`` by
        the scale after its conv; the scales by weight name."""
        from converter.compression.methods.base import quiet_progress
        from parity.mil import load_package

        function = load_package(ctx.fp16_package).functions["main"]
        consts = {op.outputs[0].name: op for op in function.operations if op.op_type == "const"}
        scales: dict[str, tuple[str, np.ndarray]] = {}
        for site in ctx.sites:
            if site.name in plan:
                w = np.asarray(consts[site.const].outputs[0].val, np.float32)
                scales[site.name] = (site.const, row_scales(w))
        with quiet_progress():
            return apply_keeping_muls(mlmodel, scale_rows_pass(scales)), scales

    def extra_bytes(self, state: Any) -> dict[str, int]:
        """Per weight: its row scales, fp16."""
        return {name: s.size * 2 for name, (_, s) in state.items()}

    def effective(self, decoded: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]:
        """The weights the program computes with: each decoded row times its scale."""
        out = dict(decoded)
        for name, (_, s) in state.items():
            if name in out:
                w = out[name].astype(np.float32)
                out[name] = (w * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float16)
        return out

    def inspect(self, function: Any, state: Any, selection: Selection) -> Inspected | None:
        scales: dict[str, tuple[str, np.ndarray]] = state

        def wrap(module: Any) -> contextlib.AbstractContextManager[Any]:
            return scaled_outputs(module, {n: s for n, (_, s) in scales.items()})

        log2 = [np.log2(s) for _, s in scales.values()]
        doc = {
            "row_scales": {
                "rule": "the power of two nearest each row's max |w|, moved toward 1 where a "
                "value would lose a bit; undone by a mul after the conv",
                "log2_min": int(min(v.min() for v in log2)) if log2 else 0,
                "log2_max": int(max(v.max() for v in log2)) if log2 else 0,
                "extra_bytes": sum(self.extra_bytes(scales).values()),
            }
        }
        text = (
            f"row scales: {len(scales)} weights, powers of two 2^{doc['row_scales']['log2_min']}"
            f"..2^{doc['row_scales']['log2_max']}, {doc['row_scales']['extra_bytes']} extra "
            "bytes counted in the records"
        )
        return Inspected(wrap=wrap, check=None, doc=doc, text=text)


def row_scales(w: np.ndarray) -> np.ndarray:
    """Per output channel (axis 0) of ``w``: the power of two nearest its max |w| such that
    dividing the row by it is exact in fp16 (moved toward 1 until it is; 1 for a zero row)."""
    rows = w.reshape(w.shape[0], -1)
    peak = np.abs(rows).max(axis=1)
    out = np.ones(rows.shape[0], np.float32)
    for i, p in enumerate(peak):
        k = int(np.round(np.log2(p))) if p > 0 else 0
        while k != 0:
            row = rows[i] / np.float32(2.0**k)
            if np.array_equal(row.astype(np.float16).astype(np.float32), row):
                break
            k += -1 if k > 0 else 1
        out[i] = 2.0**k
    return out


@contextlib.contextmanager
def scaled_outputs(module: Any, scales: dict[str, np.ndarray]) -> Iterator[None]:
    """While active, each named weight's conv output is multiplied by its row scales."""
    import torch

    modules = dict(module.named_modules())
    handles = []
    for name, s in scales.items():
        owner = name.rsplit(".", 1)[0]
        t = torch.from_numpy(s.astype(np.float32))[None, :, None, None]

        def hook(_: Any, __: Any, out: Any, t: Any = t) -> Any:
            return out * t.to(out.dtype)

        handles.append(modules[owner].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def apply_keeping_muls(mlmodel: Any, graph_pass: Any) -> Any:
    """coremltools' ``_apply_graph_pass`` without ``common::fuse_conv_scale`` in the pipeline
    that follows: that pass folds a ``mul`` by a constant after a conv back into the conv's
    weight, undoing the rewrite before the weight is palettized."""
    import coremltools as ct
    from coremltools import _SPECIFICATION_VERSION_IOS_16
    from coremltools.converters.mil.converter import mil_convert
    from coremltools.converters.mil.frontend.milproto import load
    from coremltools.models.utils import _convert_model_spec_to_pymil_prog

    spec = mlmodel.get_spec()
    version = max(spec.specificationVersion, _SPECIFICATION_VERSION_IOS_16)
    prog = _convert_model_spec_to_pymil_prog(mlmodel, version, load.load)
    graph_pass.apply(prog)
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.remove_passes(["common::fuse_conv_scale"])
    return mil_convert(
        prog, convert_to="mlprogram", convert_from="milinternal",
        specification_version=version, compute_units=mlmodel.compute_unit,
        model_description=spec.description, skip_model_load=True, pass_pipeline=pipeline,
    )  # fmt: skip


def scale_rows_pass(scales: dict[str, tuple[str, np.ndarray]]) -> Any:
    """A coremltools graph pass: each weight constant's rows divided by its scales (same
    name), and a ``mul`` by the scales after the conv that reads it."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

    class ScaleRows(AbstractGraphPass):
        def apply(self, prog: Any) -> None:
            f = prog.functions["main"]
            ops = {op.outputs[0].name: op for op in f.operations if op.op_type == "const"}
            with f:
                for const, s in scales.values():
                    old = ops[const]
                    (conv,) = [c for c in old.outputs[0].child_ops if c.op_type == "conv"]
                    value = np.asarray(old.outputs[0].val, np.float32)
                    shape = (-1, *([1] * (value.ndim - 1)))
                    scaled = (value / s.reshape(shape)).astype(np.float16)
                    new = mb.const(val=scaled, before_op=old)
                    f.replace_uses_of_var_after_op(
                        anchor_op=old, old_var=old.outputs[0], new_var=new
                    )
                    f.remove_ops([old])
                    new.name, new.op.name = const, const
                    listing = list(f.operations)
                    after = listing[listing.index(conv) + 1]
                    factor = mb.const(
                        val=s.astype(np.float16).reshape(1, -1, 1, 1), name=const + _SUFFIX,
                        before_op=after,
                    )  # fmt: skip
                    out = mb.mul(x=conv.outputs[0], y=factor, before_op=after,
                                 name=const + _SUFFIX + "_mul")  # fmt: skip
                    f.replace_uses_of_var_after_op(
                        anchor_op=out.op, old_var=conv.outputs[0], new_var=out
                    )

    return ScaleRows()


METHOD = Scaled()
