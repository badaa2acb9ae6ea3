"""coremltools' fp16 cast pass gets the same overflow answer for every op when it is read
from each constant's range (converter.coreml._overflow_checked_by_range), and the pass then
casts the same ops."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from converter.coreml import _overflow_checked_by_range

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
}


def _program() -> Any:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 3))])
    def prog(x: Any) -> Any:
        outs = [mb.add(x=x, y=c, name=name.replace(" ", "_")) for name, c in CONSTANTS.items()]
        outs.append(mb.mul(x=x, y=np.float32(1.0e5), name="scalar_over"))
        outs.append(mb.mul(x=x, y=np.float32(0.5), name="scalar_in"))
        joined = mb.concat(values=[x, np.full((1, 3), 8.0e4, np.float32)], axis=0, name="listed")
        outs.append(mb.reduce_sum(x=joined, axes=[0], keep_dims=True))
        return tuple(outs)

    return prog


def _structure(prog: Any) -> list[tuple[str, list[str]]]:
    """Each op's type and output dtypes, in order (generated names aside)."""
    return [
        (op.op_type, [str(v.dtype) for v in op.outputs]) for op in prog.functions["main"].operations
    ]


def test_every_op_gets_coremltools_own_answer() -> None:
    ops = list(_program().functions["main"].operations)
    exact = [FP16ComputePrecision.fp16_overflow(op) for op in ops]
    with _overflow_checked_by_range():
        ranged = [FP16ComputePrecision.fp16_overflow(op) for op in ops]
    assert ranged == exact
    # the cases that matter are all there: some ops overflow, some do not
    by_name = {op.name: answer for op, answer in zip(ops, exact, strict=True)}
    assert by_name["in_range"] is False and by_name["masks"] is False
    assert by_name["just_over"] and by_name["mask_and_overflow"] and by_name["listed"]
    assert by_name["scalar_over"] and not by_name["scalar_in"]


def test_the_pass_casts_the_same_ops_and_the_check_is_put_back() -> None:
    original = FP16ComputePrecision.__dict__["fp16_overflow"]
    plain, ranged = _program(), _program()
    PASS_REGISTRY["common::add_fp16_cast"](plain)
    with _overflow_checked_by_range():
        PASS_REGISTRY["common::add_fp16_cast"](ranged)
    assert _structure(ranged) == _structure(plain)
    assert "cast" in {op_type for op_type, _ in _structure(plain)}
    assert FP16ComputePrecision.__dict__["fp16_overflow"] is original


def test_the_check_is_put_back_after_an_error() -> None:
    original = FP16ComputePrecision.__dict__["fp16_overflow"]
    with pytest.raises(RuntimeError), _overflow_checked_by_range():
        raise RuntimeError("a conversion that failed")
    assert FP16ComputePrecision.__dict__["fp16_overflow"] is original
