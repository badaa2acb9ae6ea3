"""Contraction kernels: conv, matmul, linear, einsum.

All of them reduce to ``Arithmetic.matmul`` on (..., M, K) @ (..., K, N), so the profile
decides in one place how the K-long sums accumulate (fp32, or an fp16 running sum).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from parity.mil.registry import Call, kernel

PAD_TYPES = ("valid", "same", "same_lower", "custom")


def _check_conv(op: Any) -> str | None:
    pad_type = "valid" if op.pad_type is None else op.pad_type.val
    if pad_type not in PAD_TYPES:
        return f"conv pad_type {pad_type!r}"
    return None


def conv_padding(
    pad_type: str,
    pad: list[int] | None,
    sizes: tuple[int, ...],
    kernel_sizes: tuple[int, ...],
    strides: list[int],
    dilations: list[int],
) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis, as MIL's ``pad_type`` defines it."""
    n = len(sizes)
    if pad_type == "valid":
        return [(0, 0)] * n
    if pad_type == "custom":
        values = pad if pad is not None else [0] * (2 * n)
        return [(values[2 * i], values[2 * i + 1]) for i in range(n)]
    result = []
    for size, k, s, d in zip(sizes, kernel_sizes, strides, dilations, strict=True):
        out = math.ceil(size / s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        # "same" puts the odd pixel at the end, "same_lower" at the beginning.
        result.append((small, large) if pad_type == "same" else (large, small))
    return result


@kernel(
    "conv",
    attributes=("groups", "pad_type", "pad", "strides", "dilations"),
    check=_check_conv,
    borrows=("weight",),
)
def conv(call: Call) -> np.ndarray:
    """N-d convolution (cross-correlation) with groups, strides, dilations and padding."""
    x, weight = call["x"], call["weight"]
    spatial = x.ndim - 2
    kernel_sizes = tuple(weight.shape[2:])
    strides = call.integers("strides") or [1] * spatial
    dilations = call.integers("dilations") or [1] * spatial
    groups = call.integer("groups", 1)
    pads = conv_padding(
        call.text("pad_type", "valid"),
        call.integers("pad"),
        tuple(x.shape[2:]),
        kernel_sizes,
        strides,
        dilations,
    )
    if any(p != (0, 0) for p in pads):
        x = np.pad(x, [(0, 0), (0, 0), *pads])
    n, c_in = x.shape[:2]
    c_out = weight.shape[0]
    out_sizes = [
        (x.shape[2 + i] - d * (k - 1) - 1) // s + 1
        for i, (k, s, d) in enumerate(zip(kernel_sizes, strides, dilations, strict=True))
    ]
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel_sizes)):
        index = tuple(
            slice(o * d, o * d + s * (size - 1) + 1, s)
            for o, d, s, size in zip(offset, dilations, strides, out_sizes, strict=True)
        )
        taps.append(x[(slice(None), slice(None), *index)])
    taps_count = len(taps)
    positions = math.prod(out_sizes)
    # (n, C_in, T, P) -> (n, G, C_in/G * T, P), matching the weight's (O, C_in/G, *K) order.
    patches = np.stack(taps, axis=2).reshape(n, groups, (c_in // groups) * taps_count, positions)
    w = weight.reshape(groups, c_out // groups, (c_in // groups) * taps_count)
    out = call.arith.matmul(w[None], patches).reshape(n, c_out, *out_sizes)
    bias = call.get("bias")
    if bias is not None:
        out = out + bias.reshape((1, c_out) + (1,) * spatial)
    return out


def _matmul_promoting(call: Call, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x @ y`` with numpy's rank-1 rules (a vector gains an axis that is removed again)."""
    squeeze = []
    if x.ndim == 1:
        x = x[None, :]
        squeeze.append(-2)
    if y.ndim == 1:
        y = y[:, None]
        squeeze.append(-1)
    out = call.arith.matmul(x, y)
    return np.squeeze(out, axis=tuple(squeeze)) if squeeze else out


@kernel("matmul", attributes=("transpose_x", "transpose_y"))
def matmul(call: Call) -> np.ndarray:
    """``x @ y`` with numpy broadcasting, after optional transposes of the last two axes."""
    x, y = call["x"], call["y"]
    if call.flag("transpose_x") and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if call.flag("transpose_y") and y.ndim >= 2:
        y = np.swapaxes(y, -1, -2)
    return _matmul_promoting(call, x, y)


@kernel("linear", borrows=("weight",))
def linear(call: Call) -> np.ndarray:
    """``x @ weight.T + bias``; weight (D_out, D_in)."""
    x, weight = call["x"], call["weight"]
    out = _matmul_promoting(call, x, weight.T)
    bias = call.get("bias")
    return out if bias is None else out + bias


def parse_equation(equation: str) -> tuple[list[str], str]:
    """Operand and output subscripts of an einsum equation (explicit form only)."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        raise ValueError(f"einsum {equation!r}: only explicit equations without '...'")
    inputs, output = equation.split("->")
    return inputs.split(","), output


def _check_einsum(op: Any) -> str | None:
    try:
        operands, output = parse_equation(str(op.equation.val))
    except ValueError as e:
        return str(e)
    if len(operands) != 2:
        return f"einsum with {len(operands)} operands"
    for subscripts in [*operands, output]:
        if len(set(subscripts)) != len(subscripts):
            return f"einsum {op.equation.val!r}: a subscript repeated within one operand"
    if set(output) - set("".join(operands)):
        return f"einsum {op.equation.val!r}: output subscript missing from the inputs"
    return None


@kernel("einsum", attributes=("equation",), check=_check_einsum)
def einsum(call: Call) -> np.ndarray:
    """Two-operand einsum as a batched matmul: batch, free and contracted subscripts."""
    (sa, sb), so = parse_equation(call.text("equation"))
    a, b = call["values"]
    # Subscripts that appear in one operand only and not in the output are summed first.
    for sub in set(sa) - set(sb) - set(so):
        a = call.arith.sum(a, (sa.index(sub),), keepdims=False)
        sa = sa.replace(sub, "")
    for sub in set(sb) - set(sa) - set(so):
        b = call.arith.sum(b, (sb.index(sub),), keepdims=False)
        sb = sb.replace(sub, "")
    batch = [s for s in so if s in sa and s in sb]
    contracted = [s for s in sa if s in sb and s not in so]
    free_a = [s for s in sa if s not in sb]
    free_b = [s for s in sb if s not in sa]
    size = {**dict(zip(sa, a.shape, strict=True)), **dict(zip(sb, b.shape, strict=True))}
    for s in batch + contracted:
        if a.shape[sa.index(s)] != b.shape[sb.index(s)] and 1 not in (
            a.shape[sa.index(s)],
            b.shape[sb.index(s)],
        ):
            raise ValueError(f"einsum subscript {s!r}: sizes {a.shape} and {b.shape} differ")
        size[s] = max(a.shape[sa.index(s)], b.shape[sb.index(s)])
    at = np.transpose(a, [sa.index(s) for s in batch + free_a + contracted])
    bt = np.transpose(b, [sb.index(s) for s in batch + contracted + free_b])
    at = np.broadcast_to(at, [size[s] for s in batch] + list(at.shape[len(batch) :]))
    bt = np.broadcast_to(bt, [size[s] for s in batch] + list(bt.shape[len(batch) :]))
    nb = math.prod(size[s] for s in batch)
    m = math.prod(size[s] for s in free_a)
    k = math.prod(size[s] for s in contracted)
    n = math.prod(size[s] for s in free_b)
    out = call.arith.matmul(at.reshape(nb, m, k), bt.reshape(nb, k, n))
    order = batch + free_a + free_b
    out = out.reshape([size[s] for s in order])
    return np.transpose(out, [order.index(s) for s in so])
