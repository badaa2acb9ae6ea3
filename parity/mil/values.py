"""How the MIL evaluator holds a value: every float an op reads is an fp32 array (holding
fp16 values under fp16 storage); an fp16 constant is kept packed, as the program's own fp16
array, and widened when an op reads it; integers in their numpy type."""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.mil.numerics import Arithmetic, has_fp16_subnormal, to_fp16, widen_fp16

FLOAT_TYPES = frozenset({"fp16", "fp32", "fp64", "bf16"})
INT_TYPES: dict[str, type[np.generic]] = {
    "bool": np.bool_,
    "int4": np.int8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint1": np.uint8,
    "uint2": np.uint8,
    "uint3": np.uint8,
    "uint4": np.uint8,
    "uint6": np.uint8,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
}


def coerce(value: Any, dtype: str, arith: Arithmetic) -> Any:
    """A kernel result (or constant) in the evaluator's representation of ``dtype``."""
    if dtype in FLOAT_TYPES:
        return arith.store(np.asarray(value))
    if dtype in INT_TYPES:
        return np.asarray(value).astype(INT_TYPES[dtype], copy=False)
    return value  # strings and other non-tensor constants


def packed_fp16(value: Any, arith: Arithmetic) -> np.ndarray | None:
    """An fp16 constant as the evaluator holds it: the program's fp16 array itself, or (a
    profile that flushes subnormals, and the array holds one) a flushed fp16 copy; None for a
    value that is not an fp16 array. Its fp32 widening (`widen`) is exactly what ``coerce``
    stores for it."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float16:
        return None
    if arith.profile.flush_subnormals and has_fp16_subnormal(value):
        return to_fp16(arith.store(value))  # flushed fp16 values: exact in fp16
    return value


def pack_if_exact(value: Any) -> Any:
    """A decoded (``constexpr_*``) fp16 weight held in fp16 when that is exact: under fp16
    storage always; under fp32 storage only if every value is an fp16 value."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.size == 0:
        return value
    packed = to_fp16(value)
    return packed if np.array_equal(widen_fp16(packed), value) else value


def widen(value: Any) -> Any:
    """A value as ops read it: a packed fp16 constant as fp32 (exact), anything else as is
    (no other value the evaluator holds is an fp16 array)."""
    if isinstance(value, np.ndarray) and value.dtype == np.float16:
        return widen_fp16(value)
    return value
