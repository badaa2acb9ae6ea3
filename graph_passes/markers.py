"""Stable names for each transformer layer's output, from the torch trace into the MIL program.

MIL value names come from TorchScript debug names. After ``torch.jit.trace`` the output of
each call to ``self.layers[i]`` gets the debug name ``layer_<i>_out``; coremltools keeps it
through its passes (in an fp16 program with the suffix ``_cast_fp16`` its fp16 cast pass adds),
so the MIL evaluator can read every layer's output and compare it with the torch module's,
layer by layer. A marker that does not survive is an error, never a silent skip.
"""

from __future__ import annotations

from typing import Any

from graph_passes.errors import AnecError

# The suffixes coremltools' passes append to a value's name; a marker may carry one.
_SUFFIXES = ("", "_cast_fp16")


class MarkerError(AnecError):
    """A layer marker is missing from the traced graph or from the converted program."""

    exit_code = 1


def layer_marker(index: int) -> str:
    """The name given to layer ``index``'s output value."""
    return f"layer_{index}_out"


def mark_layer_outputs(traced: Any, count: int, container: str = "layers") -> list[str]:
    """Name the output of every ``self.<container>[i](...)`` call in ``traced``'s graph.

    Returns the marker names in layer order; raises MarkerError unless exactly ``count``
    layer calls, each with a single tensor output, were found.
    """
    graph = traced.graph
    found: dict[int, Any] = {}
    for node in graph.nodes():
        if node.kind() != "prim::CallMethod":
            continue
        module = node.inputsAt(0).node()
        if module.kind() != "prim::GetAttr":
            continue
        parent = module.inputsAt(0).node()
        if parent.kind() != "prim::GetAttr" or parent.s("name") != container:
            continue
        index = int(module.s("name"))
        if node.outputsSize() != 1 or index in found:
            raise MarkerError(f"layer {index}: not one call with one output in the trace")
        found[index] = node.outputsAt(0)
    if sorted(found) != list(range(count)):
        raise MarkerError(
            f"the trace calls {container}[{sorted(found)}], expected {container}[0..{count - 1}]"
        )
    for index, value in found.items():
        value.setDebugName(layer_marker(index))
    return [layer_marker(i) for i in range(count)]


def find_markers(function: Any, count: int) -> list[str]:
    """The names of the ``count`` layer outputs in a MIL function, in layer order.

    Raises MarkerError naming every marker the program lost.
    """
    names = {var.name for op in function.operations for var in op.outputs}
    result, missing = [], []
    for i in range(count):
        candidates = [layer_marker(i) + s for s in _SUFFIXES if layer_marker(i) + s in names]
        if not candidates:
            missing.append(layer_marker(i))
        else:
            result.append(candidates[0])
    if missing:
        raise MarkerError(
            f"the converted program lost the layer output marker(s) {', '.join(missing)}: "
            "the per-layer MIL comparison cannot run"
        )
    return result
