"""anec's own MIL graph passes, run after coremltools' default pipeline.

``anec::fold_whole_slice_update``: coremltools reads a whole-tensor assignment to a state
(``cache[:, :, :, :] = value``, the only form its torch frontend turns into a state write)
as ``slice_update(x=read_state(cache), update=value, begin=0, end_mask=all)`` followed by
``coreml_update_state``. Such a slice_update returns ``value`` itself, so the pass removes it:
the state is written with ``value`` directly, and the program holds no ``slice_update``, which
the NE compilers reject when it stands alone (anemll-profile: "Cannot support standalone
slice_update"; ../shared/research/ane_rules.md O-SLUPD).

Before::

    %u = slice_update(x=%s, update=%v, begin=[0, 0, 0, 0], end=[0, 0, 0, 0],
                      stride=[1, 1, 1, 1], end_mask=[True] * 4, squeeze_mask=[False] * 4)
    %w = coreml_update_state(state=%cache, value=%u)

After::

    %w = coreml_update_state(state=%cache, value=%v)

``anec::reduce_transposes_in_order`` replaces coremltools' ``common::reduce_transposes`` (run
three times by the default pipeline). coremltools 9.0's ``_TransposeOptimization``
(coremltools/converters/mil/mil/passes/defs/optimize_repeat_ops.py) collects the transposes
it may remove in Python sets of ops (``_LazyTransposeHypotheticalValue.transpose_ops``, hashed
by object address) and fills its ``transpose_op_to_cancel_ops`` / ``..._materialize_ops``
dicts by iterating them; ``apply_transform`` then removes transposes in that dict order, and
the reshapes, transposes and consts it inserts take their generated names (``reshape_36``)
from a counter in that order. The program was the same but its names were not: a cached
decoder's decode function named its reshapes differently in every process (measured on a
tiny Llama: ``reshape_36`` / ``reshape_37`` swapped, 22 op outputs; 36 on SmolLM2). The pass
below is coremltools' own, with both dicts put in block order before they are used.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from coremltools.converters.mil.mil.passes.defs import optimize_repeat_ops
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.helper import block_context_manager
from coremltools.converters.mil.mil.passes.pass_registry import register_pass

FOLD_WHOLE_SLICE_UPDATE = "anec::fold_whole_slice_update"
REDUCE_TRANSPOSES_IN_ORDER = "anec::reduce_transposes_in_order"
# coremltools' passes replaced by anec's in the conversion pipeline (converter.coreml.program)
REPLACED_PASSES = {"common::reduce_transposes": REDUCE_TRANSPOSES_IN_ORDER}


def _const(op: Any, name: str) -> np.ndarray | None:
    var = op.inputs.get(name)
    return None if var is None or var.val is None else np.asarray(var.val)


def is_whole_slice_update(op: Any) -> bool:
    """A slice_update that replaces all of ``x`` with an ``update`` of the same shape."""
    if op.op_type != "slice_update" or op.update.shape != op.x.shape:
        return False
    if op.update.dtype != op.x.dtype:
        return False
    begin, stride = _const(op, "begin"), _const(op, "stride")
    begin_mask, end_mask = _const(op, "begin_mask"), _const(op, "end_mask")
    squeeze = _const(op, "squeeze_mask")
    if (
        begin is None
        or not (begin == 0).all()
        and not (begin_mask is not None and begin_mask.all())
    ):
        return False
    if stride is not None and not (stride == 1).all():
        return False
    if squeeze is not None and squeeze.any():
        return False
    return end_mask is not None and bool(end_mask.all())


@register_pass(namespace="anec")
class fold_whole_slice_update(AbstractGraphPass):  # noqa: N801 (coremltools' pass naming)
    """Replace a whole-tensor slice_update by its update (see the module docstring)."""

    def apply(self, prog: Any) -> None:
        for function in prog.functions.values():
            self._fold(function)

    @block_context_manager
    def _fold(self, block: Any) -> None:
        for op in list(block.operations):
            for inner in op.blocks:
                self._fold(inner)
            if is_whole_slice_update(op):
                block.replace_uses_of_var_after_op(
                    anchor_op=op, old_var=op.outputs[0], new_var=op.update
                )
                block.remove_ops([op])


def _in_block_order(by_op: dict[Any, list[Any]], block: Any) -> defaultdict[Any, list[Any]]:
    """``by_op`` with its keys (ops of ``block``) in the order they appear in the block."""
    position = {op: i for i, op in enumerate(block.operations)}
    ordered = sorted(by_op.items(), key=lambda item: position[item[0]])
    return defaultdict(list, ordered)


class _TransposeOptimizationInOrder(optimize_repeat_ops._TransposeOptimization):
    """coremltools' transpose optimization, deciding and rewriting in block order."""

    # set by coremltools' __init__ (transpose op -> its cancel ops / (materialize op, var)s)
    transpose_op_to_cancel_ops: defaultdict[Any, list[Any]]
    transpose_op_to_materialize_ops: defaultdict[Any, list[Any]]

    def _verify_cancellable_transposes(self) -> None:
        # Both dicts were filled by iterating sets of ops; this method adds keys to the
        # cancel dict in the materialize dict's order, and apply_transform walks the cancel
        # dict: order both by position, before and after.
        self.transpose_op_to_materialize_ops = _in_block_order(
            self.transpose_op_to_materialize_ops, self.block
        )
        self.transpose_op_to_cancel_ops = _in_block_order(
            self.transpose_op_to_cancel_ops, self.block
        )
        super()._verify_cancellable_transposes()
        self.transpose_op_to_cancel_ops = _in_block_order(
            self.transpose_op_to_cancel_ops, self.block
        )


@register_pass(namespace="anec")
class reduce_transposes_in_order(optimize_repeat_ops.reduce_transposes):  # noqa: N801
    """``common::reduce_transposes`` with names that do not depend on the process (module
    docstring)."""

    @staticmethod
    def _reduce_transposes_block(block: Any) -> None:
        # coremltools' reduce_transposes._reduce_transposes_block, with the ordered class:
        # only flat blocks are optimized.
        if any(op.blocks for op in block.operations):
            return
        with block:
            optimization = _TransposeOptimizationInOrder(block)
            optimization.block_traversal()
            optimization.apply_transform()
