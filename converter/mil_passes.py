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
"""

from __future__ import annotations

from typing import Any

import numpy as np
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.helper import block_context_manager
from coremltools.converters.mil.mil.passes.pass_registry import register_pass

FOLD_WHOLE_SLICE_UPDATE = "anec::fold_whole_slice_update"


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
