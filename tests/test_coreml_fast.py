"""converter.coreml.fast_paths gives coremltools' own answers: the fp16 cast pass's overflow and
underflow checks (the pass casts the same ops to the same values) and the cross-function
const deduplication's comparisons."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from converter.coreml.fast_paths import _NumpyComparingSameArrays, fp16_checks_without_copies

FP16_MAX = 65504.0
CONSTANTS = {
    "in range": np.array([[1.0, -2.0, 3.0]], np.float32),
    "fp16 max": np.array([[FP16_MAX, -FP16_MAX, 0.0]], np.float32),
    "just over": np.array([[0.0, 65505.0, 1.0]], np.float32),
    "far under": np.array([[-7.0e4, 0.0, 1.0]], np.float32),
    "masks": np.array([[0.0, -np.inf, np.inf]], np.float32),
    "mask and overflow": np.array([[-np.inf, 7.0e4, 0.0]], np.float32),
    "huge but finite": np.array([[-3.0e38, 1.0, 2.0]], np.float32),
    "nan": np.array([[np.nan, 1.0, 2.0]], np.float32),
    # values fp16 rounds to zero: coremltools moves them to fp16's smallest subnormal
    "tiny": np.array([[1.0e-9, -1.0e-9, 0.0]], np.float32),
}
TINY_MANY = np.full((1, 400), 1.0e-9, np.float32)  # 400 values: left as zeros


def _program() -> Any:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 3))])
    def prog(x: Any) -> Any:
        outs = [mb.add(x=x, y=c, name=name.replace(" ", "_")) for name, c in CONSTANTS.items()]
        outs.append(mb.mul(x=x, y=np.float32(1.0e5), name="scalar_over"))
        outs.append(mb.mul(x=x, y=np.float32(0.5), name="scalar_in"))
        outs.append(mb.reduce_sum(x=mb.add(x=x, y=TINY_MANY[:, :3]), axes=[0]))
        wide = mb.tile(x=x, reps=[1, 400 // 3 + 1])
        outs.append(mb.add(x=mb.slice_by_size(x=wide, begin=[0, 0], size=[1, 400]), y=TINY_MANY))
        joined = mb.concat(values=[x, np.full((1, 3), 8.0e4, np.float32)], axis=0, name="listed")
        outs.append(mb.reduce_sum(x=joined, axes=[0], keep_dims=True))
        return tuple(outs)

    return prog


def _structure(prog: Any) -> list[tuple[str, list[str], bytes]]:
    """Each op's type, output dtypes and constant value bytes, in order (names aside)."""
    return [
        (
            op.op_type,
            [str(v.dtype) for v in op.outputs],
            np.asarray(op.outputs[0].val).tobytes() if op.op_type == "const" else b"",
        )
        for op in prog.functions["main"].operations
    ]


def test_every_op_gets_coremltools_own_answer() -> None:
    ops = list(_program().functions["main"].operations)
    exact = [FP16ComputePrecision.fp16_overflow(op) for op in ops]
    with fp16_checks_without_copies():
        ranged = [FP16ComputePrecision.fp16_overflow(op) for op in ops]
    assert ranged == exact
    # the cases that matter are all there: some ops overflow, some do not
    by_name = {op.name: answer for op, answer in zip(ops, exact, strict=True)}
    assert by_name["in_range"] is False and by_name["masks"] is False
    assert by_name["just_over"] and by_name["mask_and_overflow"] and by_name["listed"]
    assert by_name["scalar_over"] and not by_name["scalar_in"]


def test_the_pass_casts_the_same_ops_and_the_check_is_put_back() -> None:
    original = FP16ComputePrecision.__dict__["fp16_overflow"]
    underflow = FP16ComputePrecision._check_underflow_to_zero
    plain, ranged = _program(), _program()
    PASS_REGISTRY["common::add_fp16_cast"](plain)
    with fp16_checks_without_copies():
        PASS_REGISTRY["common::add_fp16_cast"](ranged)
    assert _structure(ranged) == _structure(plain)
    assert "cast" in {op_type for op_type, _, _ in _structure(plain)}
    subnormal = np.float16(2.0**-24).tobytes()
    values = [v for op_type, _, v in _structure(plain) if op_type == "const"]
    assert any(subnormal in v for v in values)  # the tiny constant was moved off zero
    assert FP16ComputePrecision.__dict__["fp16_overflow"] is original
    assert FP16ComputePrecision._check_underflow_to_zero is underflow


def test_the_check_is_put_back_after_an_error() -> None:
    original = FP16ComputePrecision.__dict__["fp16_overflow"]
    underflow = FP16ComputePrecision._check_underflow_to_zero
    with pytest.raises(RuntimeError), fp16_checks_without_copies():
        raise RuntimeError("a conversion that failed")
    assert FP16ComputePrecision.__dict__["fp16_overflow"] is original
    assert FP16ComputePrecision._check_underflow_to_zero is underflow


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float16).reshape(3, 4),
        np.array([1.0, np.nan], np.float32),
        np.array([np.inf, -np.inf], np.float32),
        np.zeros(0, np.float32),
        np.arange(6, dtype=np.uint8),
        np.array([1 + 1j, np.nan], np.complex64),
    ],
)
def test_an_array_compared_with_itself_gets_numpys_answer(array: np.ndarray) -> None:
    fast = _NumpyComparingSameArrays()
    assert fast.allclose(array, array, rtol=0.0, atol=1e-3) == np.allclose(
        array, array, rtol=0.0, atol=1e-3
    )
    other = array.copy()
    assert fast.allclose(array, other, rtol=0.0, atol=1e-3) == np.allclose(
        array, other, rtol=0.0, atol=1e-3
    )
    assert fast.sum is np.sum  # everything else is numpy's
