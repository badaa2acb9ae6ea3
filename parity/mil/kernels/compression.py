"""Compressed weights and activation quantization: the ``constexpr_*`` decompression ops
(iOS 16 and iOS 18 forms), ``quantize`` and ``dequantize``.

The evaluator runs the ``constexpr_*`` kernels once, when it prepares a program; their results
are stored like any other constant under the profile.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parity.mil.kernels._axes import norm_axis
from parity.mil.registry import Call, kernel

_QUANT_RANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def unpack_bits(packed: np.ndarray, nbits: int, count: int) -> np.ndarray:
    """``count`` unsigned ``nbits``-bit fields packed LSB first, byte after byte (iOS 16)."""
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")
    if bits.size < nbits * count:
        raise ValueError(f"{packed.size} bytes cannot hold {count} {nbits}-bit indices")
    fields = bits[: nbits * count].reshape(count, nbits).astype(np.int64)
    return (fields << np.arange(nbits)).sum(axis=1)


def _along(values: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A scalar or a vector for ``axis``, shaped to broadcast against a rank-``rank`` tensor."""
    values = np.asarray(values)
    if values.ndim == 0:
        return values
    shape = [1] * rank
    shape[axis] = -1
    return values.reshape(shape)


def _blocks(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Repeat per-block ``values`` (each axis dividing ``shape``) to ``shape``."""
    for axis, (size, blocks) in enumerate(zip(shape, values.shape, strict=True)):
        if size % blocks:
            raise ValueError(f"axis {axis}: {blocks} blocks do not divide {size}")
        if blocks != size:
            values = np.repeat(values, size // blocks, axis=axis)
    return values


@kernel("constexpr_affine_dequantize", attributes=("axis", "dtype:quantized_data"))
def affine_dequantize(call: Call) -> np.ndarray:
    """``scale * (quantized_data - zero_point)``; scale and zero point per ``axis`` or scalar."""
    data = np.asarray(call["quantized_data"]).astype(np.float32)
    axis = norm_axis(call.integer("axis"), data.ndim)
    scale = _along(np.asarray(call["scale"], np.float32), axis, data.ndim)
    zero = _along(np.asarray(call["zero_point"]).astype(np.float32), axis, data.ndim)
    return scale * (data - zero)


def _check_lut(op: Any) -> str | None:
    if "shape" in op.input_spec.input_types:
        size = op.lut.shape[0]
        return None if size in (2, 4, 16, 64, 256) else f"palette of {size} entries"
    return None


@kernel(
    "constexpr_lut_to_dense",
    attributes=("has:shape", "dtype:indices", "vector_axis"),
    check=_check_lut,
)
def lut_to_dense(call: Call) -> np.ndarray:
    """Palettized weights: each index picks a value (or a vector) from its group's table.

    iOS 16: one table ``lut`` [P] for the whole tensor, indices packed into bytes, ``shape``.
    iOS 18: indices [*S] unpacked; ``lut`` [*G, P, V] holds one table per block of indices
    (G divides S axis by axis); V > 1 fills V consecutive values along ``vector_axis``.
    """
    lut = np.asarray(call["lut"])
    if "shape" in call.op.input_spec.input_types:  # the iOS 16 form
        dense = [int(s) for s in np.asarray(call["shape"]).reshape(-1)]
        nbits = int(math.log2(lut.size))
        packed = unpack_bits(call["indices"], nbits, math.prod(dense))
        return lut.reshape(-1)[packed].reshape(dense)
    indices = np.asarray(call["indices"]).astype(np.int64)
    shape = indices.shape
    groups, palette, vector = lut.shape[:-2], lut.shape[-2], lut.shape[-1]
    if indices.size and indices.max() >= palette:
        raise IndexError(f"index {indices.max()} outside a palette of {palette}")
    # The flat number of each index's table: its block coordinate on every axis.
    group = np.zeros(shape, dtype=np.int64)
    for axis, (size, count) in enumerate(zip(shape, groups, strict=True)):
        if size % count:
            raise ValueError(f"axis {axis}: {count} tables do not divide {size}")
        coord = np.arange(size) // (size // count)
        group = group * count + coord.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    values = lut.reshape(-1, palette, vector)[group, indices]  # (*S, V)
    if vector == 1:
        return values[..., 0]
    axis = norm_axis(call.integer("vector_axis"), len(shape))
    out_shape = list(shape)
    out_shape[axis] *= vector
    return np.moveaxis(values, -1, axis + 1).reshape(out_shape)


@kernel("constexpr_blockwise_shift_scale", attributes=("dtype:data", "dtype:offset"))
def blockwise_shift_scale(call: Call) -> np.ndarray:
    """``scale * (data - offset)`` with one scale (and offset) per block of ``data``."""
    data = np.asarray(call["data"]).astype(np.float32)
    scale = _blocks(np.asarray(call["scale"], np.float32), data.shape)
    offset = call.get("offset")
    if offset is not None:
        data = data - _blocks(np.asarray(offset).astype(np.float32), data.shape)
    return scale * data


@kernel("constexpr_cast")
def constexpr_cast(call: Call) -> np.ndarray:
    """An fp16 constant widened to fp32."""
    return np.asarray(call["source_val"], np.float32)


@kernel("constexpr_sparse_to_dense", attributes=("has:shape",))
def sparse_to_dense(call: Call) -> np.ndarray:
    """Zeros, with ``nonzero_data`` where the bit mask is set (row-major order)."""
    nonzero = np.asarray(call["nonzero_data"])
    mask = np.asarray(call["mask"])
    if "shape" in call.op.input_spec.input_types:  # iOS 16: mask packed into bytes
        shape = [int(s) for s in np.asarray(call["shape"]).reshape(-1)]
        bits = np.unpackbits(mask.astype(np.uint8), bitorder="little")[: math.prod(shape)]
    else:  # iOS 18: mask is a uint1 tensor of the output's shape
        shape = [int(s) for s in mask.shape]
        bits = mask.reshape(-1)
    if int(bits.sum()) != nonzero.size:
        raise ValueError(f"{int(bits.sum())} set bits for {nonzero.size} values")
    out = np.zeros(math.prod(shape), dtype=nonzero.dtype)
    out[bits.astype(bool)] = nonzero.reshape(-1)
    return out.reshape(shape)


def _check_quantize(op: Any) -> str | None:
    dtype = op.output_dtype.val
    return None if dtype in _QUANT_RANGE else f"quantize to {dtype!r}"


@kernel("quantize", attributes=("output_dtype", "axis"), check=_check_quantize)
def quantize(call: Call) -> np.ndarray:
    """``clip(round_half_even(input / scale) + zero_point)`` to int8 or uint8."""
    x = np.asarray(call["input"], np.float32)
    axis = call.get("axis")
    axis_n = norm_axis(int(axis), x.ndim) if axis is not None else 0
    scale = _along(np.asarray(call["scale"], np.float32), axis_n, x.ndim)
    q = np.round(x / scale)
    zero = call.get("zero_point")
    if zero is not None:
        q = q + _along(np.asarray(zero).astype(np.float32), axis_n, x.ndim)
    low, high = _QUANT_RANGE[call.text("output_dtype")]
    return np.clip(q, low, high).astype(np.int16)


@kernel("dequantize", attributes=("axis",))
def dequantize(call: Call) -> np.ndarray:
    """``scale * (input - zero_point)``."""
    x = np.asarray(call["input"]).astype(np.float32)
    axis = call.get("axis")
    axis_n = norm_axis(int(axis), x.ndim) if axis is not None else 0
    scale = _along(np.asarray(call["scale"], np.float32), axis_n, x.ndim)
    zero = call.get("zero_point")
    if zero is not None:
        x = x - _along(np.asarray(zero).astype(np.float32), axis_n, x.ndim)
    return scale * x
