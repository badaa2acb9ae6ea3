"""Numeric profiles: fp16 storage rounds between ops (overflow to inf, subnormals kept),
fp32 inside an op; fp16-acc holds running sums in fp16 and flushes subnormals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mil_ops import rand, run1

from parity.mil.numerics import (
    TORCH_FROM,
    Arithmetic,
    has_fp16_subnormal,
    round_fp16,
    to_fp16,
    widen_fp16,
)
from parity.mil.profiles import FP16, FP16_ACC, FP32


def test_round_fp16_is_ieee_round_to_nearest_even() -> None:
    # Ties at fp16 midpoints, the overflow threshold (65520 rounds to inf), subnormals.
    edges = [65504.0, 65519.99, 65520.0, 1e-7, -6e-8, 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-11]
    x = np.concatenate([rand(1000, seed=70) * 1e3, edges]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)  # numpy's conversion, independently
    np.testing.assert_array_equal(round_fp16(x), want)
    readonly = x.copy()
    readonly.flags.writeable = False  # a program's memory-mapped weights
    np.testing.assert_array_equal(round_fp16(readonly), want)
    np.testing.assert_array_equal(round_fp16(x[::-3]), want[::-3])  # negative strides
    # fp64 rounds to fp16 directly: through fp32 first, 1 + 2^-11 + 2^-40 would tie to 1.
    assert round_fp16(np.array([1 + 2.0**-11 + 2.0**-40]))[0] == np.float32(1 + 2.0**-10)


def test_small_and_large_arrays_round_and_widen_alike() -> None:
    """Below TORCH_FROM values numpy converts, from it torch: the same bits either way."""
    edges = [65504.0, 65519.99, 65520.0, -65520.0, 1e-7, -6e-8, 2.0**-25, 3 * 2.0**-25, 0.0]
    x = np.concatenate([rand(3 * TORCH_FROM, seed=71) * 1e3, edges * 40]).astype(np.float32)
    whole = round_fp16(x)  # torch
    pieces = np.concatenate([round_fp16(x[i : i + 100]) for i in range(0, x.size, 100)])
    np.testing.assert_array_equal(whole.view(np.uint32), pieces.view(np.uint32))
    half = to_fp16(x)
    widened = np.concatenate([widen_fp16(half[i : i + 100]) for i in range(0, x.size, 100)])
    np.testing.assert_array_equal(widen_fp16(half).view(np.uint32), widened.view(np.uint32))


def test_fp16_storage_overflows_between_ops_but_not_inside_one() -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.full((1, 4, 1, 3), 300.0, np.float32)  # x*x = 9e4 > 65504
    sum_of_squares = lambda a: mb.reduce_sum(x=mb.mul(x=a, y=a), axes=[1])  # noqa: E731
    assert np.isinf(run1(sum_of_squares, x, profile="fp16")).all()
    assert np.isfinite(run1(sum_of_squares, x, profile="fp32")).all()
    # layer_norm squares inside the op, in fp32: finite under fp16 storage.
    x[0, :, 0, 0] = [300.0, -300.0, 100.0, 0.0]
    out = run1(lambda a: mb.layer_norm(x=a, axes=[1], epsilon=1e-5), x, profile="fp16")
    assert np.isfinite(out).all()


def test_fp16_storage_matches_torch_half_elementwise() -> None:
    from coremltools.converters.mil import Builder as mb

    x, y = rand(64, seed=71) * 100, rand(64, seed=72) * 1e-3
    x[:2] = [60000.0, 1e-4]
    y[:2] = [10000.0, 1e-3]  # overflow to inf; 1e-7 is an fp16 subnormal
    out = run1(lambda a, b: mb.mul(x=mb.add(x=a, y=b), y=b), x, y, profile="fp16")
    xt, yt = torch.from_numpy(x).half(), torch.from_numpy(y).half()
    np.testing.assert_array_equal(out, ((xt + yt) * yt).float().numpy())
    assert np.isinf(out[0]) and 0 < out[1] < 2.0**-14  # the subnormal survives in fp16


def test_fp16_acc_flushes_subnormals() -> None:
    from coremltools.converters.mil import Builder as mb

    x, y = np.array([1e-4, 1.0], np.float32), np.array([1e-3, 1e-3], np.float32)
    out = run1(lambda a, b: mb.mul(x=a, y=b), x, y, profile="fp16-acc")
    assert out[0] == 0.0 and out[1] == round_fp16(np.float32(1e-3))


def test_fp16_matmul_accumulates_in_fp32_and_rounds_once() -> None:
    a = round_fp16(rand(4, 300, seed=73))
    b = round_fp16(rand(300, 5, seed=74))
    out = Arithmetic(FP16).store(Arithmetic(FP16).matmul(a, b))
    expected = (torch.from_numpy(a).double() @ torch.from_numpy(b).double()).half().float()
    # fp32 vs fp64 sums may straddle an fp16 rounding boundary: at most one fp16 ulp apart.
    ulp = np.spacing(np.abs(expected.numpy()).astype(np.float16)).astype(np.float32)
    assert (np.abs(out - expected.numpy()) <= ulp).all()


def test_fp16_acc_rounds_the_running_sum_after_every_block() -> None:
    a = round_fp16(rand(3, 100, seed=75))
    b = round_fp16(rand(100, 4, seed=76))
    out = Arithmetic(FP16_ACC).matmul(a, b)
    at, bt = torch.from_numpy(a).double(), torch.from_numpy(b).double()
    acc = torch.zeros(3, 4, dtype=torch.float64)
    for start in range(0, 100, FP16_ACC.acc_block):  # blocks of 32, 32, 32, 4
        acc = (acc + at[:, start : start + 32] @ bt[start : start + 32]).half().double()
    np.testing.assert_allclose(out, acc.float().numpy(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 100, 4), (960, 576, 64), (16384, 64, 1), (5, 64, 7)])
def test_fp16_acc_matmul_is_the_per_block_rounding_bit_for_bit(
    shape: tuple[int, int, int],
) -> None:
    """The buffered running sum (`Arithmetic._block_sums`) has the bits of its definition:
    ``round_fp16(acc + block product, flush)`` on new arrays per block, on values spanning
    fp16's subnormals and normals."""
    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    a = round_fp16(rand(m, k, seed=78) * rng.choice([1e-4, 0.05, 3.0], size=(m, k)))
    b = round_fp16(rand(k, n, seed=79) * rng.choice([1e-5, 1.0, 2e3], size=(k, n)))
    arith = Arithmetic(FP16_ACC)
    step = FP16_ACC.acc_block
    acc = round_fp16(a[:, :step] @ b[:step], flush=True)
    for start in range(step, k, step):
        block = slice(start, start + step)
        acc = round_fp16(acc + a[:, block] @ b[block], flush=True)
    out = arith.matmul(a, b)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.view(np.uint32), acc.view(np.uint32))


def test_has_fp16_subnormal_reads_fp16_bits_as_the_fp32_test_does() -> None:
    """Every fp16 value alone (fp16 bits path) against its exact fp32 widening (generic)."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    want = [has_fp16_subnormal(v) for v in every.astype(np.float32).reshape(-1, 1)]
    assert [has_fp16_subnormal(v) for v in every.reshape(-1, 1)] == want
    assert sum(want) == 2 * 1023  # both signs, mantissa 1..1023
    assert has_fp16_subnormal(np.array([1.0, 2.0**-20, 3.0], np.float16)[::2]) is False


def test_fp16_acc_sum_is_rounded_and_worse_than_fp32_accumulation() -> None:
    x = round_fp16(np.abs(rand(1, 4096, seed=77)) + 1.0)
    exact = x.astype(np.float64).sum()
    fp16 = float(Arithmetic(FP16).store(Arithmetic(FP16).sum(x, (1,), keepdims=False))[0])
    acc16 = float(Arithmetic(FP16_ACC).sum(x, (1,), keepdims=False)[0])
    assert abs(fp16 - exact) <= np.spacing(np.float16(exact)) / 2  # rounded once
    assert abs(acc16 - exact) > abs(fp16 - exact)  # 128 roundings of a growing sum
    assert float(Arithmetic(FP32).sum(x, (1,), keepdims=False)[0]) == np.float32(exact)


def test_an_fp32_sum_over_a_middle_axis_is_as_accurate_as_over_the_last() -> None:
    # A BC1L softmax denominator or norm sum reduces axis 1 of (1, S, 1, T): numpy adds the
    # S slices one after another there, a sequential fp32 sum (about 1e-6 off at S = 4096),
    # which the fp32 cache level charged to the program at Gemma 3's most sensitive position.
    x = np.abs(rand(1, 4096, 1, 8, seed=5)).astype(np.float32) + np.float32(0.5)
    exact = x.astype(np.float64).sum(axis=1, keepdims=True)
    got = Arithmetic(FP32).sum(x, (1,), keepdims=True)
    assert got.shape == (1, 1, 1, 8)
    along_last = Arithmetic(FP32).sum(np.ascontiguousarray(np.moveaxis(x, 1, -1)), (3,), False)
    assert np.array_equal(got.reshape(8), along_last.reshape(8))  # one accumulation order
    assert float(np.abs(got / exact - 1).max()) < 2e-7


def test_an_evaluator_prepared_like_the_fp32_one_holds_the_same_constants() -> None:
    """Constants derived from the fp32 evaluator's (``like=``) have the bits a fresh
    preparation gives, for fp16 and fp32 constants with subnormals and values fp16 cannot
    hold; fp16 constants without subnormals are shared, not copied."""
    from coremltools.converters.mil import Builder as mb
    from mil_ops import program

    from parity.mil import Evaluator

    w16 = (rand(8, 8, seed=73) * 0.1).astype(np.float16)
    w16[0, :3] = [np.float16(3e-6), np.float16(-6e-8), np.float16(0.0)]  # subnormals, zero
    clean16 = (rand(8, 8, seed=74) + 4.0).astype(np.float16)  # no subnormal
    w32 = rand(8, 8, seed=75) * 1e-3
    w32[0, :3] = [1e-7, 70000.0, 1.0 + 2.0**-12]  # an fp16 subnormal, overflow, a tie
    x = rand(8, 8, seed=76)

    def build(a: object) -> object:
        h = mb.matmul(x=mb.cast(x=a, dtype="fp16"), y=w16)
        h = mb.add(x=mb.matmul(x=h, y=clean16), y=mb.cast(x=mb.matmul(x=a, y=w32), dtype="fp16"))
        return mb.cast(x=h, dtype="fp32")

    prog = program(build, x)
    first = Evaluator(prog, FP32)
    for profile in (FP32, FP16, FP16_ACC):
        fresh, derived = Evaluator(prog, profile), Evaluator(prog, profile, like=first)
        assert fresh._constants.keys() == derived._constants.keys()
        for name, value in fresh._constants.items():
            got = derived._constants[name]
            assert np.asarray(got).dtype == np.asarray(value).dtype, name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=name)
            if isinstance(value, np.ndarray) and value.dtype == np.float32:
                assert np.array_equal(value.view(np.uint32), got.view(np.uint32)), name
        out = derived.run({"x": x}).outputs
        for key, value in fresh.run({"x": x}).outputs.items():
            assert np.array_equal(value, out[key], equal_nan=True), (profile.name, key)
        shared = [n for n, v in derived._constants.items() if v is first._constants.get(n)]
        assert len(shared) >= (1 if profile.flush_subnormals else 3), (profile.name, shared)
