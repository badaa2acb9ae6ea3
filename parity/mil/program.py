"""Reading an emitted ``.mlpackage``: its MIL program, functions, ops and constants.

coremltools reads both the program and its weight file on Linux; nothing here needs macOS.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

CONST_OP_PREFIX = "constexpr_"


def load_package(package: Path) -> Any:
    """The MIL program of a saved ``.mlpackage`` with its weights (coremltools ``Program``)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as load_milproto

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    weights = Path(package) / "Data" / "com.apple.CoreML" / "weights"
    return load_milproto(
        spec, specification_version=spec.specificationVersion, file_weights_dir=str(weights)
    )


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
