"""``method: outliers``: k-means palettes (stored as ``lut`` stores them) plus, for every
compressed weight, its ``outlier_columns`` input columns with the largest |w| kept exact.

Why columns: a projection's error is ``sum_j (w_ij - w'_ij) x_j``, so a palette's error on an
input column is multiplied by that input's magnitude. SmolLM2's ``layers.11.mlp.down_proj``
has two weights near 6 (median row peak 0.79) on the intermediate channels that feed the
|h| ~ 27k sink, and those inputs reach 3,058: a per-tensor 4-bit palette there alone gives
KL 11 (issue 12). The columns are chosen by weight magnitude (largest max |w_ij| first).

How, exactly: after the weight is palettized, the program gets a second 1x1 conv on those
input channels whose fp16 weights are the palette's residual on the columns,
``r = w[:, cols] - decode(w')[:, cols]``, added to the palettized conv's output::

    y = conv(x, decode(w')) + conv(gather(x, cols, axis=1), r)

so the columns' effective weights are ``decode(w') + r``, equal to ``w`` up to the fp16
rounding of ``r``. Every extra byte is counted in the weight's record: ``r`` (out x k fp16)
and the column indices (k int32). The torch level adds the same correction through a forward
hook (``Inspected.wrap``), so the fp32 check compares the program with the same function.
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

# Names of the ops added for a weight constant ``<const>``.
_SUFFIX = "_outlier"


class Outliers(CompressionMethod):
    """Palettized weights with their largest-magnitude input columns kept exact."""

    name = "outliers"
    summary = (
        "k-means palettes plus each weight's outlier_columns largest-|w| input columns kept "
        "exact by a second fp16 conv on those inputs"
    )
    order = 50
    tasks = frozenset({"text-generation"})
    fields = {"outlier_columns": None}

    def check(self, variant: VariantFields) -> list[Problem]:
        problems = LUT.check(variant)
        k = variant.outlier_columns
        if k is None or k < 1:
            problems.append(
                (("outlier_columns",), "an outliers variant needs outlier_columns >= 1")
            )
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        return LUT.features(variant)

    def scheme(self, variant: VariantFields) -> Scheme:
        return LUT.scheme(variant)

    def finish(
        self,
        ctx: BuildContext,
        variant: VariantFields,
        compressed: Any,
        plan: dict[str, Scheme],
        state: Any,
    ) -> tuple[Any, Any]:
        """The palettized model with each planned weight's exact columns added."""
        from coremltools.models.utils import _apply_graph_pass

        from converter.compression.methods.base import quiet_progress
        from converter.compression.records import decoded_weight

        assert variant.outlier_columns is not None  # check()
        function = compressed._mil_program.functions["main"]
        corrections: dict[str, Correction] = {}
        outputs = {v.name for v in function.outputs}
        for site in ctx.sites:
            if site.name not in plan or _feeds_output(function, site.const, outputs):
                continue
            out_channels = site.shape[0]
            w = ctx.subject.module.get_parameter(site.name).detach().half().numpy()
            w = w.reshape(out_channels, -1).astype(np.float32)  # (O, I): 1x1 conv weights
            decoded = decoded_weight(function, site.const).astype(np.float32)
            decoded = decoded.reshape(out_channels, -1)
            cols = outlier_columns(w, variant.outlier_columns)
            residual = (w[:, cols] - decoded[:, cols]).astype(np.float16)  # (O, k)
            corrections[site.const] = Correction(site.name, site.const, cols, residual)
        graph_pass = add_columns_pass(corrections)
        with quiet_progress():
            return _apply_graph_pass(compressed, graph_pass), corrections

    def extra_bytes(self, state: Any) -> dict[str, int]:
        """Per weight: the residual columns (fp16) and their indices (int32)."""
        return {c.weight: c.residual.size * 2 + len(c.columns) * 4 for c in state.values()}

    def inspect(self, function: Any, state: Any, selection: Selection) -> Inspected | None:
        corrections: dict[str, Correction] = state

        def wrap(module: Any) -> contextlib.AbstractContextManager[Any]:
            return exact_columns(module, corrections)

        k = len(next(iter(corrections.values())).columns) if corrections else 0
        doc = {
            "outliers": {
                "columns_per_weight": k,
                "chosen_by": "largest max |w_ij| over the output channels",
                "columns": {c.weight: c.columns for c in corrections.values()},
                "extra_bytes": sum(self.extra_bytes(corrections).values()),
            }
        }
        text = (
            f"outliers: {k} input column(s) of each of {len(corrections)} weights kept exact "
            f"(a second fp16 conv on those inputs); {doc['outliers']['extra_bytes']} extra "
            "bytes, counted in each weight's record"
        )
        return Inspected(wrap=wrap, check=None, doc=doc, text=text)

    def effective(self, decoded: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]:
        """The weights the program computes with: the decoded palette plus the exact columns."""
        out = dict(decoded)
        for c in state.values():
            w = out[c.weight].astype(np.float32).copy()
            flat = w.reshape(w.shape[0], -1)  # a view: (O, I)
            flat[:, c.columns] += c.residual.astype(np.float32)
            out[c.weight] = w.astype(np.float16)
        return out

    def describe_variant(self, variant: VariantFields) -> str:
        return f"{LUT.describe(self.scheme(variant))} + {variant.outlier_columns} exact columns"


class Correction:
    """One weight's exact columns: which input columns and the residual there (out x k)."""

    def __init__(self, weight: str, const: str, columns: list[int], residual: np.ndarray):
        self.weight, self.const, self.columns, self.residual = weight, const, columns, residual


def _feeds_output(function: Any, const: str, outputs: set[str]) -> bool:
    """True when the conv reading ``const`` (palettized) is a function output (an LM head
    chunk): an add after it would rename the program's output, so it keeps no exact
    columns (its palette alone, counted as such)."""
    for op in function.operations:
        if op.op_type == "conv" and op.inputs["weight"].name.startswith(const):
            return op.outputs[0].name in outputs
    return False


def outlier_columns(w: np.ndarray, k: int) -> list[int]:
    """The ``k`` input columns of ``w`` (O, I) with the largest max |w_ij|, ascending."""
    peak = np.abs(w).max(axis=0)
    k = min(k, peak.size)
    return sorted(int(j) for j in np.argsort(-peak, kind="stable")[:k])


@contextlib.contextmanager
def exact_columns(module: Any, corrections: dict[str, Correction]) -> Iterator[None]:
    """While active, each corrected conv adds ``conv(x[:, cols], r)`` to its output."""
    import torch

    modules = dict(module.named_modules())
    handles = []
    for c in corrections.values():
        owner = c.weight.rsplit(".", 1)[0]
        r = torch.from_numpy(c.residual.astype(np.float32))[:, :, None, None]
        cols = torch.tensor(c.columns)

        def hook(_: Any, args: tuple[Any, ...], out: Any, r: Any = r, cols: Any = cols) -> Any:
            x = args[0]
            side = torch.nn.functional.conv2d(x[:, cols], r.to(x.dtype))
            return out + side

        handles.append(modules[owner].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def add_columns_pass(corrections: dict[str, Correction]) -> Any:
    """A coremltools graph pass adding each correction's gather + conv + add after the conv
    that reads the palettized weight."""
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

    class AddColumns(AbstractGraphPass):
        def apply(self, prog: Any) -> None:
            add_columns(prog, corrections)

    return AddColumns()


def add_columns(prog: Any, corrections: dict[str, Correction]) -> None:
    """Add every correction to ``prog``'s main function (in place)."""
    from coremltools.converters.mil import Builder as mb

    f = prog.functions["main"]
    produced = {op.outputs[0].name: op for op in f.operations if op.outputs}
    with f:
        for c in corrections.values():
            op = produced.get(c.const + "_palettized")
            if op is None:
                raise KeyError(f"{c.weight}: no palettized constant {c.const}_palettized")
            convs = [child for child in op.outputs[0].child_ops if child.op_type == "conv"]
            if len(convs) != 1:
                raise ValueError(f"{c.weight}: {len(convs)} convs read it; expected one")
            conv = convs[0]
            ops = list(f.operations)
            after = ops[ops.index(conv) + 1]
            base = c.const + _SUFFIX
            inputs = mb.gather(
                x=conv.inputs["x"], indices=np.asarray(c.columns, np.int32), axis=1,
                before_op=after, name=base + "_inputs",
            )  # fmt: skip
            weight = mb.const(
                val=c.residual[:, :, None, None], name=base + "_columns",
                before_op=after,
            )  # fmt: skip
            side = mb.conv(x=inputs, weight=weight, before_op=after, name=base + "_conv")
            total = mb.add(x=conv.outputs[0], y=side, before_op=after, name=base + "_add")
            f.replace_uses_of_var_after_op(
                anchor_op=total.op, old_var=conv.outputs[0], new_var=total
            )


METHOD = Outliers()
