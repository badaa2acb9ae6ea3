"""Single-op MIL programs for kernel tests: build with coremltools' builder, run with anec's
evaluator, compare with torch.

Every tested op reads at least one placeholder input: an op whose inputs are all constants
would be folded by the builder and never reach the evaluator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from parity.mil import Evaluator


def _spec(array: np.ndarray) -> Any:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    dtypes = {
        np.dtype(np.float32): types.fp32,
        np.dtype(np.float16): types.fp16,
        np.dtype(np.int32): types.int32,
        np.dtype(np.bool_): types.bool,
        np.dtype(np.int8): types.int8,
        np.dtype(np.uint8): types.uint8,
    }
    return mb.TensorSpec(shape=array.shape, dtype=dtypes[array.dtype])


def program(build: Callable[..., Any], *inputs: np.ndarray, opset: str = "iOS17") -> Any:
    """A one-function program whose inputs x, y, z have the given arrays' shapes and types."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    specs = [_spec(a) for a in inputs]
    target = getattr(ct.target, opset)
    if len(inputs) == 1:

        @mb.program(input_specs=specs, opset_version=target)
        def one(x: Any) -> Any:
            return build(x)

        return one
    if len(inputs) == 2:

        @mb.program(input_specs=specs, opset_version=target)
        def two(x: Any, y: Any) -> Any:
            return build(x, y)

        return two

    @mb.program(input_specs=specs, opset_version=target)
    def three(x: Any, y: Any, z: Any) -> Any:
        return build(x, y, z)

    return three


def run(
    build: Callable[..., Any],
    *inputs: np.ndarray,
    profile: str = "fp32",
    opset: str = "iOS17",
) -> list[np.ndarray]:
    """Build the program and evaluate it under ``profile``; the outputs in order."""
    prog = program(build, *inputs, opset=opset)
    names = ["x", "y", "z"][: len(inputs)]
    result = Evaluator(prog, profile).run(dict(zip(names, inputs, strict=True)))
    return list(result.outputs.values())


def run1(
    build: Callable[..., Any], *inputs: np.ndarray, profile: str = "fp32", opset: str = "iOS17"
) -> np.ndarray:
    """The single output of ``run``."""
    (out,) = run(build, *inputs, profile=profile, opset=opset)
    return out


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Standard normal fp32 values."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
