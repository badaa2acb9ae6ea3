"""coremltools, run faster with the same output: each context manager replaces a check or a
comparison inside coremltools' conversion or combining by one that gives every answer the
original gives, without its cost (measured on SmolLM2's cached decoder with py-spy).
Each is tested against coremltools' own (tests/test_coreml_fast.py, test_validated_once.py).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def validated_once() -> Iterator[None]:
    """Validate each program once, after coremltools' pass pipeline, not after every pass.

    ``PassPipelineManager.apply_pipeline`` re-checks the whole program (every op's inputs
    against its producers' consumers) after each of its ~90 passes: in a profile of
    tests/test_kv_pipeline.py that was 81 of the pipeline's 151 s. The checks only read the
    program, so running them once on the final program finds the same invalid state, at the
    end rather than after the pass that caused it.
    """
    from coremltools.converters.mil.mil.program import Program

    check = Program.validate
    programs: list[Any] = []

    def record(self: Any, check_essential_scope: bool | None = False) -> None:
        if not any(p is self for p in programs):
            programs.append(self)

    Program.validate = record
    try:
        yield
    finally:
        Program.validate = check
    for program in programs:
        check(program)


FP16_MAX = 65504.0
# coremltools checks constants with fewer values than this for values cast to zero.
_UNDERFLOW_CHECKED_BELOW = 400


def _in_fp16_range(value: Any) -> bool:
    """Whether every value lies in [-65504, 65504] (False for a NaN: its min / max is NaN)."""
    array = np.asarray(value)
    if array.size == 0:
        return True
    return bool(array.min() >= -FP16_MAX) and bool(array.max() <= FP16_MAX)


@contextlib.contextmanager
def fp16_checks_without_copies() -> Iterator[None]:
    """coremltools' fp16 cast pass's two per-constant checks, without copying each weight.

    * ``fp16_overflow`` asks, for every op, whether an fp32 constant input would overflow
      fp16, by building ``abs(value)`` and a boolean-indexed copy of it (22 s of the 125 s
      that converting SmolLM2's cached decoder's three functions took). A constant within
      [-65504, 65504] cannot overflow, so an op whose constants all are gets False at once;
      any other op (a value out of range, an inf mask, a NaN) gets coremltools' own answer.
    * ``_check_underflow_to_zero`` flattens (copies) every cast constant only to see whether
      it holds fewer than 400 values, and does nothing otherwise (4.3 s of the same); a
      constant of 400 values or more now returns at once, any other goes to coremltools.
    """
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    overflow = FP16ComputePrecision.__dict__["fp16_overflow"]
    underflow = FP16ComputePrecision._check_underflow_to_zero
    exact = FP16ComputePrecision.fp16_overflow

    def fp16_overflow(op: Any) -> bool:
        for inputs in op.inputs.values():
            for var in inputs if isinstance(inputs, list | tuple) else [inputs]:
                if (
                    var.op is not None
                    and var.op.op_type == "const"
                    and var.is_tensor_or_scalar_of(dtype="fp32")
                    and not _in_fp16_range(var.op.val.val)
                ):
                    return bool(exact(op))
        return False

    def check_underflow_to_zero(self: Any, new_var: Any, var: Any) -> None:
        if var.val is not None and np.size(var.val) >= _UNDERFLOW_CHECKED_BELOW:
            return
        underflow(self, new_var, var)

    FP16ComputePrecision.fp16_overflow = staticmethod(fp16_overflow)
    FP16ComputePrecision._check_underflow_to_zero = check_underflow_to_zero
    try:
        yield
    finally:
        FP16ComputePrecision.fp16_overflow = overflow
        FP16ComputePrecision._check_underflow_to_zero = underflow


@contextlib.contextmanager
def same_arrays_compared_once() -> Iterator[None]:
    """coremltools' cross-function const deduplication, comparing an array with itself at once.

    ``save_multifunction`` compares every const with the earlier ones of equal hash key by
    ``np.allclose``; the combine loads equal weights as one array
    (`parity.mil.program.loads_sharing_equal_constants`), so for a cached decoder's functions
    nearly every comparison is of an array with itself: 7.9 s of SmolLM2's 21 s combine
    (py-spy). ``allclose(a, a)`` is true unless ``a`` holds a NaN, which is what the
    replacement answers for one array; any two arrays go to numpy's own ``allclose``.
    """
    # The module, not the pass class of the same name its package exports.
    dedup: Any = importlib.import_module(
        "coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication"
    )
    numpy = dedup.np
    dedup.np = _NumpyComparingSameArrays()
    try:
        yield
    finally:
        dedup.np = numpy


class _NumpyComparingSameArrays:
    """numpy, with ``allclose`` answering at once for an array compared with itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def allclose(a: Any, b: Any, *args: Any, **kwargs: Any) -> bool:
        if a is b and isinstance(a, np.ndarray):
            return not _has_nan(a)
        return bool(np.allclose(a, b, *args, **kwargs))


def _has_nan(a: np.ndarray) -> bool:
    if a.size == 0 or a.dtype.kind not in "fc":
        return False
    if a.dtype.kind == "f":
        return bool(np.isnan(a.max()))  # a NaN anywhere makes the max NaN
    return bool(np.isnan(a).any())
