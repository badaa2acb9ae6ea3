"""Compressed-weight and quantization kernels against torch, with coremltools' own
decompression as a second opinion: iOS 16 and iOS 18 forms of every constexpr op anec may
emit, and activation quantize / dequantize."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from mil_ops import rand, run1

from parity.mil.kernels.compression import unpack_bits


def _pack(indices: np.ndarray, nbits: int) -> np.ndarray:
    """Pack indices LSB first, byte after byte (the iOS 16 layout), independently of anec."""
    bits = [(int(v) >> b) & 1 for v in indices.reshape(-1) for b in range(nbits)]
    bits += [0] * (-len(bits) % 8)
    return np.array(
        [sum(bit << i for i, bit in enumerate(bits[k : k + 8])) for k in range(0, len(bits), 8)],
        dtype=np.uint8,
    )


def _times_weight(weight_op: Any) -> Any:
    """A program computing x @ W.T from a decompressed weight, so the op is not folded."""
    from coremltools.converters.mil import Builder as mb

    return lambda x: mb.linear(x=x, weight=weight_op())


X = rand(3, 8, seed=60).astype(np.float16)  # the weights are fp16, so is the input


def _expected(dense: torch.Tensor) -> np.ndarray:
    return (torch.from_numpy(X).double() @ dense.double().T).float().numpy()


@pytest.mark.parametrize("nbits", [1, 2, 4, 6, 8])
def test_unpack_bits_inverts_lsb_first_packing(nbits: int) -> None:
    values = np.random.default_rng(nbits).integers(0, 2**nbits, size=37)
    np.testing.assert_array_equal(unpack_bits(_pack(values, nbits), nbits, 37), values)


@pytest.mark.parametrize("nbits", [2, 4, 6])
def test_lut_to_dense_ios16(nbits: int) -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.ops.defs.iOS16.constexpr_ops import (
        constexpr_lut_to_dense,
    )

    rng = np.random.default_rng(nbits)
    lut = rng.standard_normal(2**nbits).astype(np.float16)
    indices = rng.integers(0, 2**nbits, size=(5, 8))
    packed = _pack(indices, nbits)
    shape = np.array([5, 8], np.uint32)
    out = run1(
        _times_weight(lambda: mb.constexpr_lut_to_dense(indices=packed, lut=lut, shape=shape)),
        X,
        opset="iOS16",
    )
    dense = torch.from_numpy(lut.astype(np.float32))[torch.from_numpy(indices)]
    np.testing.assert_allclose(out, _expected(dense), rtol=1e-5, atol=1e-5)
    theirs = constexpr_lut_to_dense.decompress(lut, packed, shape)
    np.testing.assert_array_equal(dense.numpy(), theirs.astype(np.float32))


def test_affine_dequantize_ios16_per_channel() -> None:
    from coremltools.converters.mil import Builder as mb

    rng = np.random.default_rng(1)
    q = rng.integers(-128, 128, size=(5, 8)).astype(np.int8)
    scale = (rng.random(5) * 0.1 + 0.01).astype(np.float16)
    zero = rng.integers(-3, 4, size=5).astype(np.int8)
    out = run1(
        _times_weight(
            lambda: mb.constexpr_affine_dequantize(
                quantized_data=q, zero_point=zero, scale=scale, axis=0
            )
        ),
        X,
        opset="iOS16",
    )
    dense = torch.from_numpy(scale.astype(np.float32))[:, None] * (
        torch.from_numpy(q).float() - torch.from_numpy(zero).float()[:, None]
    )
    np.testing.assert_allclose(out, _expected(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vector", [1, 2])
def test_lut_to_dense_ios18_grouped_and_vector(vector: int) -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import (
        constexpr_lut_to_dense,
    )

    rng = np.random.default_rng(vector)
    rows = 6
    indices = rng.integers(0, 16, size=(rows, 8 // vector)).astype(types.np_uint4_dtype)
    # Two tables along the rows (3 rows each), one along the columns; 16 entries of V values.
    lut = rng.standard_normal((2, 1, 16, vector)).astype(np.float16)
    kwargs: dict[str, Any] = {"vector_axis": 1} if vector > 1 else {}
    out = run1(
        _times_weight(lambda: mb.constexpr_lut_to_dense(indices=indices, lut=lut, **kwargs)),
        X,
        opset="iOS18",
    )
    table = torch.from_numpy(lut.astype(np.float32))
    idx = torch.from_numpy(indices.astype(np.int64))
    dense = torch.stack(
        [
            torch.cat([table[r // 3, 0, int(i)] for i in idx[r]])  # V values per index
            for r in range(rows)
        ]
    )
    np.testing.assert_allclose(out, _expected(dense), rtol=1e-5, atol=1e-5)
    theirs = constexpr_lut_to_dense.decompress(indices, lut, 1 if vector > 1 else None)
    np.testing.assert_array_equal(dense.numpy(), theirs.astype(np.float32))


@pytest.mark.parametrize("with_offset", [False, True])
def test_blockwise_shift_scale_int4_blocks(with_offset: bool) -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    rng = np.random.default_rng(3)
    data = rng.integers(-8, 8, size=(6, 8)).astype(types.np_int4_dtype)
    scale = (rng.random((3, 2)) * 0.1 + 0.01).astype(np.float16)  # blocks of 2 x 4
    offset = rng.integers(-2, 3, size=(3, 2)).astype(types.np_int4_dtype)
    kwargs: dict[str, Any] = {"offset": offset} if with_offset else {}
    out = run1(
        _times_weight(lambda: mb.constexpr_blockwise_shift_scale(data=data, scale=scale, **kwargs)),
        X,
        opset="iOS18",
    )
    d = torch.from_numpy(data.astype(np.float32))
    s = torch.from_numpy(scale.astype(np.float32)).repeat_interleave(2, 0).repeat_interleave(4, 1)
    if with_offset:
        o = torch.from_numpy(offset.astype(np.float32))
        d = d - o.repeat_interleave(2, 0).repeat_interleave(4, 1)
    np.testing.assert_allclose(out, _expected(s * d), rtol=1e-5, atol=1e-5)


def test_sparse_to_dense_ios16() -> None:
    from coremltools.converters.mil import Builder as mb

    rng = np.random.default_rng(4)
    dense = rng.standard_normal((5, 8)).astype(np.float16)
    dense[rng.random((5, 8)) < 0.5] = 0
    mask = _pack((dense != 0).astype(np.int64), 1)
    nonzero = dense[dense != 0]
    shape = np.array([5, 8], np.uint32)
    out = run1(
        _times_weight(
            lambda: mb.constexpr_sparse_to_dense(nonzero_data=nonzero, mask=mask, shape=shape)
        ),
        X,
        opset="iOS16",
    )
    np.testing.assert_allclose(
        out, _expected(torch.from_numpy(dense.astype(np.float32))), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype,axis", [("int8", None), ("uint8", 1)])
def test_quantize_then_dequantize(dtype: str, axis: int | None) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 3, 5, seed=61) * 4
    x[0, 0, :3] = [1000.0, -1000.0, 0.25]  # clipped both ways; a tie rounds to even
    if axis is None:
        scale = np.float32(0.05)
        zero = np.int8(3) if dtype == "int8" else np.uint8(128)
    else:
        scale = np.array([0.05, 0.1, 0.02], np.float32)
        zero = np.array([128, 100, 150], np.uint8)
    kwargs: dict[str, Any] = {} if axis is None else {"axis": axis}

    def build(a: Any) -> Any:
        q = mb.quantize(input=a, scale=scale, zero_point=zero, output_dtype=dtype, **kwargs)
        return q, mb.dequantize(input=q, scale=scale, zero_point=zero, **kwargs)

    from mil_ops import run

    q, back = run(build, x)
    shape = (1, 3, 1) if axis is not None else ()
    s = torch.from_numpy(np.asarray(scale)).reshape(shape)
    z = torch.from_numpy(np.asarray(zero).astype(np.float32)).reshape(shape)
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    expected_q = torch.clamp(torch.round(torch.from_numpy(x) / s) + z, low, high)
    np.testing.assert_array_equal(q, expected_q.numpy().astype(q.dtype))
    np.testing.assert_allclose(back, (s * (expected_q - z)).numpy(), rtol=1e-6, atol=1e-6)
