"""A kernel that borrows its weight (`KernelSpec.borrows`: conv, linear) reads a packed fp16
constant widened into the evaluator's one reused buffer: every result has the bits it has
with a fresh fp32 copy per op, and no result holds the buffer."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from mil_ops import program, rand

from parity.mil import Evaluator
from parity.mil.registry import KERNELS


def _build(x: Any) -> Any:
    from coremltools.converters.mil import Builder as mb

    # Two convolutions and a linear layer, each with its own packed fp16 weight of a
    # different size, so the buffer is reused, grown and reused again.
    small = (rand(16, 8, 1, 1, seed=1) * 0.2).astype(np.float16)
    large = (rand(48, 16, 1, 1, seed=2) * 0.2).astype(np.float16)
    dense = (rand(5, 48, seed=3) * 0.2).astype(np.float16)
    h = mb.cast(x=x, dtype="fp16")
    h = mb.conv(x=h, weight=small, name="first")
    h = mb.conv(x=mb.relu(x=h), weight=large, name="second")
    h = mb.reshape(x=h, shape=[48, 4])
    return mb.linear(x=mb.transpose(x=h, perm=[1, 0]), weight=dense, name="out")


@pytest.mark.parametrize("profile", ["fp32", "fp16", "fp16-acc"])
def test_borrowed_weights_give_the_bits_of_fresh_copies(
    profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = rand(1, 8, 1, 4, seed=4)
    prog = program(_build, x)
    capture = ["first", "second"]
    borrowed = Evaluator(prog, profile).run({"x": x}, capture=capture)
    for op_type in ("conv", "linear"):
        assert KERNELS[op_type].borrows == ("weight",)
        monkeypatch.setitem(KERNELS, op_type, dataclasses.replace(KERNELS[op_type], borrows=()))
    fresh = Evaluator(prog, profile).run({"x": x}, capture=capture)
    for name in ("first", "second"):
        np.testing.assert_array_equal(
            borrowed.captured[name].view(np.uint32), fresh.captured[name].view(np.uint32)
        )
    np.testing.assert_array_equal(
        borrowed.outputs["out"].view(np.uint32), fresh.outputs["out"].view(np.uint32)
    )


def test_no_value_holds_the_buffer() -> None:
    x = rand(1, 8, 1, 4, seed=4)
    evaluator = Evaluator(program(_build, x), "fp16")
    result = evaluator.run({"x": x}, capture=["first", "second"])
    scratch = evaluator._scratch
    assert scratch.size == 48 * 16  # grown to the largest borrowed weight
    for value in [*result.captured.values(), *result.outputs.values()]:
        assert not np.shares_memory(value, scratch)
    again = evaluator.run({"x": x}, capture=["first", "second"])
    np.testing.assert_array_equal(again.outputs["out"], result.outputs["out"])
