"""torch's CPU fp16 1x1 convolution, the same bits at a fraction of the time.

The torch-fp16 level runs every BC1L module cast to fp16, and torch's CPU kernel for an fp16
1x1 convolution (a matrix product) of an input in the standard layout is slow where the CPU
has no fp16 arithmetic: 52 ms for SmolLM2's 576 -> 1536 projection over a 64-token window
against 2.2 ms in fp32; most of an encoder's torch-fp16 level. What that kernel computes,
found by comparing bits on this build (torch 2.13, x86-64 with AVX2): each output is
``sum_k w[o, k] * x[k, n]`` with the products in fp32 (exact: two fp16 significands fit in
fp32's), added in four fp32 lanes (lane ``k mod 4``, each in order of k), the lanes summed
as ``((l0 + l1) + l2) + l3``, the bias added in fp32 and the result rounded to fp16 once.

`fp16_conv1x1` computes exactly that with one vectorised multiply-add per four input
channels, where the input channels are a multiple of four (as every model width is).
Whether it reproduces the kernel is not assumed: `matches_torch` compares the two on probe
shapes (few and many channels, one position, a batch, a bias), and `fast_fp16_convs` uses it
only when they agree bit for bit; elsewhere (another torch, a CPU with fp16 arithmetic)
torch's own kernel runs. On an AVX512 CPU with avx512_fp16 (torch capability AVX512, measured
2026-12-02) torch's kernel sums in one fp32 lane in order of k and is fast (1.5 ms for that
projection, fp32 0.7 ms), so the probe fails and nothing is routed. An input laid out
channels-last (a norm's output often is) takes another torch kernel, faster, whose order the
lanes do not follow: it stays torch's. Either way the torch-fp16 level gives the same bits;
tests/test_fp16_conv.py checks real widths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LANES = 4
ROWS_PER_TILE = 1024  # output channels per pass: four lanes of them stay in the CPU's cache
# Below this many positions (a decode step's one) torch's kernel is the faster: it takes
# about 0.6 ms per position at SmolLM2's widths, the lanes' Python loop about 9 ms in all.
MIN_POSITIONS = 32


def fp16_conv1x1(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv2d(x, weight, bias)`` for fp16 ``x`` (B, C, H, W) with C a multiple of four and a
    1x1 ``weight`` (O, C, 1, 1), computed in fp32 lanes as torch's CPU kernel does (module
    docstring)."""
    b, c, h, w = x.shape
    if c % LANES:
        raise ValueError(f"{c} input channels: the lanes model only multiples of {LANES}")
    out_ch, steps = weight.shape[0], c // LANES
    cols = x.permute(1, 0, 2, 3).reshape(steps, LANES, 1, b * h * w).float()
    rows = weight.reshape(out_ch, steps, LANES).float().permute(1, 2, 0).unsqueeze(3)
    out = torch.empty(out_ch, b * h * w)
    for start in range(0, out_ch, ROWS_PER_TILE):
        tile = rows[:, :, start : start + ROWS_PER_TILE].contiguous()  # (S, 4, rows, 1)
        acc = torch.zeros(LANES, tile.shape[2], b * h * w)
        for step in range(steps):
            acc.addcmul_(tile[step], cols[step])
        total = ((acc[0] + acc[1]) + acc[2]) + acc[3]
        if bias is not None:
            total += bias[start : start + ROWS_PER_TILE].float()[:, None]
        out[start : start + ROWS_PER_TILE] = total
    return out.half().reshape(out_ch, b, h, w).permute(1, 0, 2, 3)


# conv2d's parameters after (input, weight, bias), with the values a plain 1x1 product has.
_PLAIN = (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))


def _plain_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """``(x, weight, bias)`` of a call ``conv2d(x, weight, bias, stride, padding, dilation,
    groups)`` (positional or by keyword) that is a plain fp16 1x1 product over enough
    positions: the only convolution BC1L modules make. None for any other call."""
    names = ("input", "weight", "bias") + tuple(name for name, _ in _PLAIN)
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    given = dict(zip(names, args, strict=False)) | kwargs
    x, weight, bias = given.get("input"), given.get("weight"), given.get("bias")
    for name, plain in _PLAIN:
        value = given.get(name, plain)
        if value not in (plain, (plain, plain), [plain, plain]):
            return None
    tensors = [t for t in (x, weight, bias) if t is not None]
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float16 for t in tensors):
        return None
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    plain_shapes = (
        x.dim() == 4
        and weight.dim() == 4
        and tuple(weight.shape[2:]) == (1, 1)
        # Channels past a multiple of four are summed in an order the lanes do not follow
        # (a last-bit difference in about 1 output in 10,000); every model width is one.
        and x.shape[1] % LANES == 0
        and x.device.type == "cpu"
        # Laid out channels-last (as a norm's output often is), the input takes another
        # kernel, faster and summing in another order: left to torch.
        and x.is_contiguous()
        and x.shape[0] * x.shape[2] * x.shape[3] >= MIN_POSITIONS
    )
    # A gradient would need autograd through the lanes: only inference calls are routed.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return (x, weight, bias) if plain_shapes and not needs_grad else None


class _Fp16Convs(TorchFunctionMode):
    """Routes plain fp16 1x1 convolutions to `fp16_conv1x1`; every other call runs as is."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        plain = _plain_call(args, kwargs) if func in (torch.conv2d, F.conv2d) else None
        return func(*args, **kwargs) if plain is None else fp16_conv1x1(*plain)


# Probe shapes (batch, in, out, positions): few and many channels, one position and many, a
# batch of two, a bias on every other one.
PROBES = ((1, 28, 24, 7), (2, 64, 40, 5), (1, 132, 16, 1), (3, 8, 9, 4), (1, 72, 33, 64))


def matches_torch() -> bool:
    """True when `fp16_conv1x1` gives torch's own fp16 kernel's bits on the probe shapes."""
    gen = torch.Generator().manual_seed(0)
    for i, (b, c, o, n) in enumerate(PROBES):
        x = torch.randn(b, c, 1, n, generator=gen).half()
        weight = torch.randn(o, c, 1, 1, generator=gen).half()
        bias = torch.randn(o, generator=gen).half() if i % 2 else None
        with torch.no_grad():
            if not torch.equal(fp16_conv1x1(x, weight, bias), F.conv2d(x, weight, bias)):
                return False
    return True


@contextmanager
def fast_fp16_convs() -> Iterator[bool]:
    """Inside the block, fp16 1x1 convolutions (no grad) run through `fp16_conv1x1` when it
    reproduces torch's kernel here (`matches_torch`); yields whether it does."""
    if not matches_torch():
        yield False
        return
    with _Fp16Convs():
        yield True
