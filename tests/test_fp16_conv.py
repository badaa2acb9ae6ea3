"""parity.fp16_conv: the torch-fp16 level's 1x1 convolutions give torch's own bits, faster.

The lanes reproduce one kernel of one torch build (the pinned 2.13 on an x86-64 CPU that
torch runs at capability AVX2); where they do not (an AVX512 CPU, whose kernel sums in another
order and is fast anyway), `fast_fp16_convs` leaves every call to torch: the tests that need
the lanes to match run only where the probe says they do, and the contract a user relies on -
the same bits with or without the fast path - is checked everywhere.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from parity import fp16_conv
from parity.fp16_conv import MIN_POSITIONS, fast_fp16_convs, fp16_conv1x1, matches_torch

REPRODUCED = matches_torch()
reproduced = pytest.mark.skipif(
    not REPRODUCED,
    reason=f"the lanes model torch 2.13's AVX2 kernel; this CPU runs torch at "
    f"{torch.backends.cpu.get_cpu_capability()}, where the fast path stays off",
)

# (batch, in, out, positions): the real widths of SmolLM2 (576: q/k/v 960, MLP 1536, a 16,384-
# row head chunk), Qwen2.5-0.5B (896 -> 4864), Gemma 3 270M (640 -> 2048), MiniLM's folded
# batch (384 -> 1536, 4 x 32), and a small odd shape.
SHAPES = [
    (1, 576, 960, 64),
    (1, 1536, 576, 64),
    (1, 576, 16384, 64),
    (1, 896, 4864, 64),
    (1, 640, 2048, 64),
    (4, 384, 1536, 32),
    (2, 132, 70, 40),
]


def _inputs(b: int, c: int, o: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, 1, n, generator=gen).half()
    weight = (torch.randn(o, c, 1, 1, generator=gen) / c**0.5).half()
    bias = torch.randn(o, generator=gen).half()
    return x, weight, bias


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or torch.__version__[:4] != "2.13"
    or torch.backends.cpu.get_cpu_capability() != "AVX2",
    reason="the lanes were found on torch 2.13's x86-64 AVX2 kernel",
)  # fmt: skip
def test_the_probe_finds_the_lanes_reproduce_torch_s_avx2_kernel() -> None:
    assert matches_torch()


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{c}to{o}x{b * n}" for b, c, o, n in SHAPES])
def test_real_widths_give_torch_bits_with_and_without_bias(shape: tuple[int, ...]) -> None:
    x, weight, bias = _inputs(*shape, seed=sum(shape))
    with torch.no_grad():
        plain, biased = F.conv2d(x, weight), F.conv2d(x, weight, bias)
        with fast_fp16_convs():
            assert torch.equal(F.conv2d(x, weight), plain)
            assert torch.equal(F.conv2d(x, weight, bias), biased)
        if REPRODUCED:  # the lanes themselves, where the fast path uses them
            assert torch.equal(fp16_conv1x1(x, weight, None), plain)
            assert torch.equal(fp16_conv1x1(x, weight, bias), biased)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = fp16_conv.fp16_conv1x1

    def counted(*args: Any) -> torch.Tensor:
        calls.append(tuple(args[0].shape))
        return real(*args)

    monkeypatch.setattr(fp16_conv, "fp16_conv1x1", counted)
    return calls


@reproduced
def test_a_modules_plain_fp16_convs_run_through_the_lanes_with_the_same_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy(monkeypatch)
    conv = torch.nn.Conv2d(96, 200, 1).half().eval()  # calls conv2d with all seven arguments
    x = torch.randn(1, 96, 1, 64).half()
    with torch.no_grad():
        expected = conv(x)
        with fast_fp16_convs() as routed:
            calls.clear()  # the probe's own calls
            got = conv(x)
    assert routed and calls == [(1, 96, 1, 64)]
    assert torch.equal(got, expected)


CALLS: dict[str, Callable[[], torch.Tensor]] = {
    # Channels-last input: torch takes another kernel, summing in another order.
    "channels-last": lambda: F.conv2d(
        torch.randn(1, 64, 1, 96).half().transpose(1, 3).contiguous().transpose(1, 3),
        torch.randn(32, 64, 1, 1).half(),
    ),
    "channels not a multiple of four": lambda: F.conv2d(
        torch.randn(1, 66, 1, 96).half(), torch.randn(32, 66, 1, 1).half()
    ),
    "fp32": lambda: F.conv2d(torch.randn(1, 64, 1, 96), torch.randn(32, 64, 1, 1)),
    "3x3 kernel": lambda: F.conv2d(torch.randn(1, 8, 6, 96).half(), torch.randn(4, 8, 3, 3).half()),
    "stride 2": lambda: F.conv2d(
        torch.randn(1, 64, 1, 96).half(), torch.randn(32, 64, 1, 1).half(), None, 2
    ),
    "grouped": lambda: F.conv2d(
        torch.randn(1, 64, 1, 96).half(), torch.randn(32, 32, 1, 1).half(), groups=2
    ),
    "one position": lambda: F.conv2d(
        torch.randn(1, 64, 1, MIN_POSITIONS - 1).half(), torch.randn(32, 64, 1, 1).half()
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_other_convolutions_are_left_to_torch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    calls = _spy(monkeypatch)
    with torch.no_grad(), fast_fp16_convs():
        calls.clear()  # the probe's own calls
        CALLS[name]()
    assert calls == []


def test_a_call_that_needs_a_gradient_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    conv = torch.nn.Conv2d(64, 32, 1).half()
    with fast_fp16_convs():
        calls.clear()  # the probe's own calls
        conv(torch.randn(1, 64, 1, 96).half()).float().sum().backward()
    assert calls == [] and conv.weight.grad is not None


def test_where_the_lanes_do_not_reproduce_torch_every_call_is_torchs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy(monkeypatch)
    monkeypatch.setattr(fp16_conv, "matches_torch", lambda: False)
    x, weight, bias = _inputs(1, 64, 32, 96, seed=1)
    with torch.no_grad(), fast_fp16_convs() as routed:
        got = F.conv2d(x, weight, bias)
    assert not routed and calls == []
    assert torch.equal(got, F.conv2d(x, weight, bias))


def test_the_probe_catches_a_different_summation_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same lanes summed as (l0 + l1) + (l2 + l3) differ from torch in the last bit
    somewhere on the probes: the probe is a real check, not a formality."""

    def paired(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, c, h, w = x.shape
        cols = x.permute(1, 0, 2, 3).reshape(c // 4, 4, 1, -1).float()
        rows = weight.reshape(-1, c // 4, 4).float().permute(1, 2, 0).unsqueeze(3)
        acc = torch.zeros(4, rows.shape[2], cols.shape[-1])
        for step in range(c // 4):
            acc.addcmul_(rows[step], cols[step])
        total = (acc[0] + acc[1]) + (acc[2] + acc[3])
        if bias is not None:
            total += bias.float()[:, None]
        return total.half().reshape(-1, b, h, w).permute(1, 0, 2, 3)

    monkeypatch.setattr(fp16_conv, "fp16_conv1x1", paired)
    assert not fp16_conv.matches_torch()
