"""The MIL evaluator's fast paths keep every bit: a kernel that borrows its weight
(`KernelSpec.borrows`: conv, linear) reads a packed fp16 constant widened into one reused
buffer, and a product with a 0 / 1 mask is not rounded again (`Call.exact`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from mil_ops import program, rand

from parity.mil import Evaluator
from parity.mil.numerics import round_fp16
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
    buffers: list[np.ndarray] = []
    borrowed = evaluator._borrowed

    def seen(value: Any) -> Any:
        out = borrowed(value)
        buffers.append(evaluator._scratch)
        return out

    evaluator._borrowed = seen  # type: ignore[method-assign]
    result = evaluator.run({"x": x}, capture=["first", "second"])
    assert max(b.size for b in buffers) == 48 * 16  # grown to the largest borrowed weight
    assert evaluator._scratch.size == 0  # and let go after the run
    for value in [*result.captured.values(), *result.outputs.values()]:
        assert not any(np.shares_memory(value, b) for b in buffers)
    again = evaluator.run({"x": x}, capture=["first", "second"])
    np.testing.assert_array_equal(again.outputs["out"], result.outputs["out"])


def _blend(x: Any) -> Any:
    from coremltools.converters.mil import Builder as mb

    keep = np.array([1.0, 0.0, 1.0, 1.0], np.float16).reshape(1, 1, 1, 4)  # a slot mask
    h = mb.cast(x=mb.mul(x=x, y=np.float32(3.1)), dtype="fp16")  # values not all fp16 sums
    kept = mb.mul(x=h, y=keep, name="kept")
    scaled = mb.mul(x=h, y=np.float16(0.3), name="scaled")  # a real product: rounded
    return mb.add(x=kept, y=scaled, name="out")


@pytest.mark.parametrize("profile", ["fp16", "fp16-acc", "device-margin"])
def test_a_product_with_a_mask_is_not_rounded_again_and_keeps_its_bits(
    profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import parity.mil.kernels.elementwise as elementwise

    x = rand(1, 8, 1, 4, seed=6) * 1e3
    prog = program(_blend, x)
    names = ["kept", "scaled"]
    skipped = Evaluator(prog, profile).run({"x": x}, capture=names)
    monkeypatch.setattr(elementwise, "_is_mask", lambda a: False)
    rounded = Evaluator(prog, profile).run({"x": x}, capture=names)
    for name in names:
        np.testing.assert_array_equal(
            skipped.captured[name].view(np.uint32), rounded.captured[name].view(np.uint32)
        )
    np.testing.assert_array_equal(skipped.outputs["out"], rounded.outputs["out"])
    for name in names:  # every stored value is an fp16 value, the real product's too
        value = skipped.captured[name]
        np.testing.assert_array_equal(round_fp16(value), value)


def test_only_a_zero_one_operand_makes_a_product_exact() -> None:
    from parity.mil.kernels.elementwise import _is_mask

    assert _is_mask(np.array([0.0, 1.0, -0.0], np.float32))
    assert not _is_mask(np.array([0.0, 1.0, 0.5], np.float32))
    assert not _is_mask(np.array([0.5, 0.0, 1.0], np.float32))
    assert not _is_mask(np.array([np.nan, 1.0], np.float32))
    assert not _is_mask(np.zeros(0, np.float32))
    assert not _is_mask(np.array([1, 0], np.int32))  # integer products are not rounded anyway
    assert not _is_mask(np.ones(70_000, np.float32))  # large operands are not scanned
