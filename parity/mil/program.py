"""Reading an emitted ``.mlpackage``: its MIL program, functions, ops and constants.

coremltools reads both the program and its weight file on Linux; nothing here needs macOS.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CONST_OP_PREFIX = "constexpr_"


def load_package(package: Path, shared: dict[Hashable, Any] | None = None) -> Any:
    """The MIL program of a saved ``.mlpackage`` with its weights (coremltools ``Program``),
    each weight blob held once however many functions name it.

    coremltools' own loader (``milproto.load``) makes one array per const: the prefill,
    decode and extend functions of a cached decoder name the same blobs, so it held three
    copies of every weight (with the next change, the Llama-1B shape's cached recipe peaked at
    10.52 GiB instead of 16.49: bench/README.md, ``llama_1b.py``). This is its
    ``load_mil_proto`` with a context that gives each const naming an already-read blob the
    array read first, as the const is made; the private names are coremltools 9.0's (pinned).
    The arrays are shared, so a change to one function's weight replaces its const op rather
    than writing into the array. ``shared``: arrays by content, filled and reused across calls
    (several packages holding the same weights load them once).
    """
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto
    from coremltools.converters.mil.mil import Program

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    program_spec = spec.mlProgram
    if spec.WhichOneof("Type") != "mlProgram" or program_spec.version != 1:
        raise ValueError(f"{package}: not an ML Program (version 1)")
    blobs: dict[str, tuple[str, int]] = {}  # the function being loaded: const -> (file, offset)
    weights = str(Path(package) / "Data" / "com.apple.CoreML" / "weights")
    if shared is None:
        context = _sharing_context(
            milproto.TranscriptionContext, weights, {}, lambda name, _value: blobs.get(name)
        )
    else:
        context = _sharing_context(milproto.TranscriptionContext, weights, shared, _content_key)
    program = Program()
    for name, function in program_spec.functions.items():
        blobs.clear()
        blobs.update(_const_blobs(function))
        loaded = milproto._load_function(context, function, spec.specificationVersion)
        program.add_function(name, loaded)
    milproto._load_program_spec_attributes(context, program_spec, program)
    return program


@dataclass(frozen=True)
class FunctionSet:
    """Single-function packages seen as one program: each package's ``main`` under the name
    of the function it is (a cached decoder's per-function layout); the evaluator reads only
    ``functions``."""

    functions: dict[str, Any]


def load_function_set(packages: dict[str, Path]) -> FunctionSet:
    """Each package of ``packages`` (function name -> single-function package) loaded, its
    ``main`` as that function; weights the packages hold alike are read once."""
    shared: dict[Hashable, Any] = {}
    return FunctionSet(
        {name: load_package(p, shared).functions["main"] for name, p in packages.items()}
    )


@contextmanager
def loads_sharing_equal_constants() -> Iterator[None]:
    """While open, coremltools' milproto loader gives every const whose bytes equal an
    earlier const's, in any package it loads, the array read first.

    ``ct.utils.save_multifunction`` loads each single-function package whole before it finds
    the weights they share, so combining a cached decoder's prefill, decode and extend held
    three copies of every weight (SmolLM2's three packages combined alone: peak 1.505 GiB, 1.019
    with this; bench/README.md). Sharing by content leaves the saved package unchanged:
    coremltools deduplicates equal consts by value either way.
    """
    from coremltools.converters.mil.frontend.milproto import load as milproto

    base = milproto.TranscriptionContext
    arrays: dict[Hashable, Any] = {}
    milproto.TranscriptionContext = lambda weights: _sharing_context(
        base, weights, arrays, _content_key
    )
    try:
        yield
    finally:
        milproto.TranscriptionContext = base


def _content_key(_name: str, value: Any) -> Hashable | None:
    """An array's type, shape and a digest of its bytes; None for a value that is no array."""
    if not isinstance(value, np.ndarray):
        return None
    digest = hashlib.blake2b(np.ascontiguousarray(value).data).digest()
    return (value.dtype.str, value.shape, digest)


def _const_blobs(function: Any) -> dict[str, tuple[str, int]]:
    """Each const of a function spec whose value is in a weight file: its (file, offset)."""
    blobs: dict[str, tuple[str, int]] = {}

    def walk(block: Any) -> None:
        for op in block.operations:
            value = op.attributes["val"] if op.type == "const" and "val" in op.attributes else None
            if value is not None and value.WhichOneof("value") == "blobFileValue":
                blob = value.blobFileValue
                blobs[op.outputs[0].name] = (blob.fileName, blob.offset)
            for inner in op.blocks:
                walk(inner)

    for block in function.block_specializations.values():
        walk(block)
    return blobs


def _sharing_context(
    base: type,
    weights: str,
    arrays: dict[Hashable, Any],
    key: Callable[[str, Any], Hashable | None],
) -> Any:
    """coremltools' loading context (``base``) for one package's weight folder, giving each
    const whose ``key`` (from its name and value) is already in ``arrays`` the array there."""

    class SharedConstants(base):
        def register_var_with_name(self, name: str, var: Any) -> None:
            super().register_var_with_name(name, var)
            if var.op is None or var.op.op_type != "const":
                return
            value = var._sym_val.val
            found = key(name, value)
            if found is None:
                return
            first = arrays.setdefault(found, value)
            if first is not value:  # the const's input and output hold the one array
                var._sym_val.val = first
                var.op.val._sym_val.val = first

    return SharedConstants(weights)


def dtype_name(var: Any) -> str:
    """A var's element type as MIL spells it: ``fp16``, ``fp32``, ``int32``, ``bool``, ..."""
    from coremltools.converters.mil.mil import types

    dtype = var.dtype
    if types.is_tensor(dtype):
        dtype = dtype.get_primitive()
    return str(types.builtin_to_string(dtype))


def is_constant(op: Any) -> bool:
    """True for ``const`` and the compile-time ``constexpr_*`` ops (decompressed weights)."""
    return bool(op.op_type == "const" or op.op_type.startswith(CONST_OP_PREFIX))


def walk_ops(program: Any) -> Iterator[tuple[str, Any]]:
    """Every op of every function, as (function name, op), in program order.

    Nested blocks (control flow) are walked too, so a coverage check sees their ops.
    """

    def walk(block: Any) -> Iterator[Any]:
        for op in block.operations:
            yield op
            for inner in op.blocks:
                yield from walk(inner)

    for name, function in program.functions.items():
        for op in walk(function):
            yield name, op


def const_array(var: Any) -> Any:
    """The value of a constant var as numpy data (strings stay strings)."""
    value = var.val
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value)
    if isinstance(value, bool | int | float):
        return np.asarray(value)
    return value
