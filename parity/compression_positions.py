"""An all-positions copy of a decoder program, for scoring a compressed variant at MIL level.

A draft program returns logits at its last ``n`` window positions only (``io.logits:
last``): the last layer's output is cut by one ``slice_by_index`` on the position axis before
the final norm and the LM head. Scoring 1,000 held-out positions through it would take 1,000
evaluations, one per prefix. Instead the same program - the same constant and ``constexpr_*``
ops, so byte-identical weights - has that one slice removed and every later op's output type
re-inferred: one evaluation then scores every position of a window. Nothing else changes: the
final norm and the LM head act per position, so each position's logits are the ones the
emitted program computes when that position is the last.
"""

from __future__ import annotations

from typing import Any

import numpy as np

POSITION_AXIS = 3  # BC1L: (batch, channels, 1, length)
# The logit outputs: (batch, positions, 1, V_k), the vocabulary last (graph_passes.logits_layout).
OUTPUT_POSITION_AXIS = 1


class NotALastPositionProgram(ValueError):
    """The program has no single position slice before its head."""


def position_slice(function: Any) -> Any | None:
    """The op cutting the last layer's output to the last window positions, or None when the
    function already returns every position. Raises when more than one op could be it."""
    found = []
    for op in function.operations:
        if op.op_type != "slice_by_index":
            continue
        x = op.inputs["x"]
        if x.rank != 4 or op.outputs[0].shape[POSITION_AXIS] == x.shape[POSITION_AXIS]:
            continue
        begin = np.asarray(op.inputs["begin"].val)
        if not np.all(begin[:POSITION_AXIS] == 0):
            continue
        if op.outputs[0].shape[:POSITION_AXIS] != x.shape[:POSITION_AXIS]:
            continue
        found.append(op)
    if len(found) > 1:
        names = ", ".join(op.name for op in found)
        raise NotALastPositionProgram(f"{len(found)} position slices ({names}); expected one")
    return found[0] if found else None


def all_positions(program: Any, function: str = "main") -> int:
    """Remove ``function``'s last-position slice in place and re-infer every later op's output
    type; returns how many positions the outputs now hold. Constants are not touched."""
    f = program.functions[function]
    op = position_slice(f)
    if op is None:
        return int(f.outputs[0].shape[OUTPUT_POSITION_AXIS])
    source, cut = op.inputs["x"], op.outputs[0]
    ops = list(f.operations)
    later = ops[ops.index(op) + 1 :]
    f.replace_uses_of_var_after_op(
        anchor_op=op, old_var=cut, new_var=source, no_check_var_types=True
    )
    f.remove_ops([op])
    with f:  # coremltools' type inference may build helper values inside the function
        for child in later:
            if child.op_type != "const":
                child.type_value_inference(overwrite_output=True)
    positions = {int(v.shape[OUTPUT_POSITION_AXIS]) for v in f.outputs}
    if positions != {int(source.shape[POSITION_AXIS])}:
        raise NotALastPositionProgram(f"outputs hold {sorted(positions)} positions after the cut")
    return positions.pop()
