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


def mark_layer_outputs(
    traced: Any, count: int, container: str = "layers", first: int = 0
) -> list[str]:
    """Name the output of every ``self.<container>[i](...)`` call in ``traced``'s graph.

    Returns the marker names in layer order; raises MarkerError unless exactly the ``count``
    layer calls ``first .. first + count - 1`` (a chunk of a decoder's layers keeps their
    indices in the model), each with a single tensor output, were found.
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
        found[index] = _stream_output(node, index)
    indices = list(range(first, first + count))
    if sorted(found) != indices:
        raise MarkerError(
            f"the trace calls {container}[{sorted(found)}], expected "
            f"{container}[{first}..{first + count - 1}]"
        )
    if any(value.node().kind() == "prim::TupleUnpack" for value in found.values()):
        found = _inlined(graph, found)
    for index, value in found.items():
        value.setDebugName(layer_marker(index))
    return [layer_marker(i) for i in indices]


def _inlined(graph: Any, found: dict[int, Any]) -> dict[int, Any]:
    """The layer calls inlined into ``graph`` (the converter inlines them anyway) and each
    stream that a tuple unpack hands out replaced by the value the layer computed: the
    converter drops tuples, so a name on the unpacked value would not reach the program."""
    import torch

    torch._C._jit_pass_inline(graph)
    inner = {}
    for index, value in found.items():
        unpack = value.node()
        if unpack.kind() != "prim::TupleUnpack":
            inner[index] = value
            continue
        construct = unpack.inputsAt(0).node()
        if construct.kind() != "prim::TupleConstruct":
            raise MarkerError(f"layer {index}: its tuple is not built in the inlined graph")
        inner[index] = construct.inputsAt(list(unpack.outputs()).index(value))
    return inner


def _stream_output(call: Any, index: int) -> Any:
    """The value a layer call returns as the stream. A layer that also hands tensors out
    through a Python object (a cached decoder's `CachedKeys` rows) is traced returning a
    tuple, unpacked once, in no fixed order: the stream is the unpacked element shaped like
    the stream the call took."""
    value = call.outputsAt(0)
    if value.type().kind() != "TupleType":
        return value
    stream = call.inputsAt(1).type().sizes()
    unpacks = [use.user for use in value.uses() if use.user.kind() == "prim::TupleUnpack"]
    alike = [
        out
        for unpack in unpacks
        for out in unpack.outputs()
        if out.type().kind() == "TensorType" and out.type().sizes() == stream
    ]
    if len(unpacks) != 1 or len(alike) != 1:
        raise MarkerError(f"layer {index}: no single stream output among the call's tuple")
    return alike[0]


def find_markers(function: Any, count: int, first: int = 0) -> list[str]:
    """The names of the ``count`` layer outputs from layer ``first`` on in a MIL function,
    in layer order.

    Raises MarkerError naming every marker the program lost.
    """
    names = {var.name for op in function.operations for var in op.outputs}
    result, missing = [], []
    for i in range(first, first + count):
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
