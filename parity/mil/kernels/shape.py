"""Layout kernels: reshape, transpose, squeeze, expand_dims, concat, split, stack, tile, pad,
slice_by_index, slice_by_size, reverse, identity. They move values and never round them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parity.mil.kernels._axes import norm_axes, norm_axis
from parity.mil.registry import Call, kernel


def reshape_target(shape: list[int], in_shape: tuple[int, ...]) -> list[int]:
    """MIL's reshape shape: -1 is inferred; 0 copies the input dim aligned from the right."""
    out = list(shape)
    for i, value in enumerate(out):
        if value == 0:
            j = len(in_shape) - (len(out) - i)
            out[i] = in_shape[j] if j >= 0 else 1
    if out.count(-1) > 1:
        raise ValueError(f"reshape shape {shape}: more than one -1")
    if -1 in out:
        known = math.prod(v for v in out if v != -1)
        out[out.index(-1)] = math.prod(in_shape) // known if known else 0
    if math.prod(out) != math.prod(in_shape):
        raise ValueError(f"cannot reshape {in_shape} to {shape}")
    return out


@kernel("reshape", exact=True)
def reshape(call: Call) -> np.ndarray:
    """Same values in a new shape (row-major order)."""
    x = np.asarray(call["x"])
    shape = call.integers("shape")
    assert shape is not None
    return x.reshape(reshape_target(shape, x.shape))


@kernel("transpose", attributes=("perm",), exact=True)
def transpose(call: Call) -> np.ndarray:
    """Permute the axes; ``perm`` may hold negative axes."""
    x = np.asarray(call["x"])
    perm = call.integers("perm")
    assert perm is not None
    return np.transpose(x, [norm_axis(p, x.ndim) for p in perm])


@kernel("squeeze", attributes=("axes",), exact=True)
def squeeze(call: Call) -> np.ndarray:
    """Remove size-1 axes: the given ones, or all of them when ``axes`` is absent."""
    x = np.asarray(call["x"])
    axes = call.integers("axes")
    if axes is None:
        return np.squeeze(x)
    axes_n = norm_axes(axes, x.ndim)
    bad = [a for a in axes_n if x.shape[a] != 1]
    if bad:
        raise ValueError(f"squeeze of axes {bad} whose size is not 1 (shape {x.shape})")
    return np.squeeze(x, axis=axes_n)


@kernel("expand_dims", attributes=("axes",), exact=True)
def expand_dims(call: Call) -> np.ndarray:
    """Insert size-1 axes; an axis counts in the output's rank (negative from its end)."""
    x = np.asarray(call["x"])
    axes = call.integers("axes")
    assert axes is not None
    rank = x.ndim + len(axes)
    return np.expand_dims(x, norm_axes(axes, rank))


@kernel("concat", attributes=("axis", "interleave"), exact=True)
def concat(call: Call) -> np.ndarray:
    """Join ``values`` along ``axis``; ``interleave`` alternates their slices instead."""
    values = [np.asarray(v) for v in call["values"]]
    axis = norm_axis(call.integer("axis"), values[0].ndim)
    if not call.flag("interleave"):
        return np.concatenate(values, axis=axis)
    stacked = np.stack(values, axis=axis + 1)
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


@kernel("split", attributes=("axis",), exact=True)
def split(call: Call) -> list[np.ndarray]:
    """Cut ``x`` along ``axis`` into ``split_sizes`` or ``num_splits`` equal parts."""
    x = np.asarray(call["x"])
    axis = norm_axis(call.integer("axis"), x.ndim)
    sizes = call.integers("split_sizes")
    if sizes is None:
        parts = call.integer("num_splits")
        if x.shape[axis] % parts:
            raise ValueError(f"axis of size {x.shape[axis]} does not split into {parts} parts")
        sizes = [x.shape[axis] // parts] * parts
    if sum(sizes) != x.shape[axis]:
        raise ValueError(f"split sizes {sizes} do not add up to {x.shape[axis]}")
    return list(np.split(x, np.cumsum(sizes)[:-1], axis=axis))


@kernel("stack", attributes=("axis",), exact=True)
def stack(call: Call) -> np.ndarray:
    """Stack ``values`` on a new axis."""
    values = [np.asarray(v) for v in call["values"]]
    return np.stack(values, axis=norm_axis(call.integer("axis"), values[0].ndim + 1))


@kernel("tile", exact=True)
def tile(call: Call) -> np.ndarray:
    """Repeat ``x`` ``reps[i]`` times along axis i."""
    x = np.asarray(call["x"])
    reps = call.integers("reps")
    assert reps is not None
    if len(reps) != x.ndim:
        raise ValueError(f"tile reps {reps} for rank {x.ndim}")
    return np.tile(x, reps)


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def _check_pad(op: Any) -> str | None:
    mode = "constant" if op.mode is None else op.mode.val
    return None if mode in _PAD_MODES else f"pad mode {mode!r}"


@kernel("pad", attributes=("mode",), check=_check_pad, exact=True)
def pad(call: Call) -> np.ndarray:
    """Pad the last N axes by ``pad`` = [begin_1, end_1, ..., begin_N, end_N]."""
    x = np.asarray(call["x"])
    amounts = call.integers("pad")
    assert amounts is not None
    n = len(amounts) // 2
    widths = [(0, 0)] * (x.ndim - n) + [(amounts[2 * i], amounts[2 * i + 1]) for i in range(n)]
    mode = call.text("mode", "constant")
    if mode == "constant":
        value = np.asarray(call.number("constant_val", 0.0), x.dtype)
        return np.pad(x, widths, mode="constant", constant_values=value)
    return np.pad(x, widths, mode=_PAD_MODES[mode])  # type: ignore[call-overload]


@kernel(
    "slice_by_index",
    attributes=("stride", "begin_mask", "end_mask", "squeeze_mask"),
    exact=True,
)
def slice_by_index(call: Call) -> np.ndarray:
    """numpy slicing ``x[begin:end:stride]`` per axis; masks ignore begin/end or index."""
    x = np.asarray(call["x"])
    return np.asarray(x[slice_index(call, x.ndim)])


def slice_index(call: Call, rank: int) -> tuple[Any, ...]:
    """The numpy index of a ``slice_by_index`` (or ``slice_update``) call on a rank-``rank``
    value: ``begin:end:stride`` per axis, masks ignoring begin / end or squeezing the axis."""
    begin, end = call.integers("begin"), call.integers("end")
    assert begin is not None and end is not None
    stride = call.integers("stride") or [1] * rank
    begin_mask = call.flags("begin_mask", rank)
    end_mask = call.flags("end_mask", rank)
    squeeze_mask = call.flags("squeeze_mask", rank)
    index: list[Any] = []
    for i in range(rank):
        if squeeze_mask[i]:
            index.append(begin[i])
            continue
        start = None if begin_mask[i] else begin[i]
        stop = None if end_mask[i] else end[i]
        index.append(slice(start, stop, stride[i]))
    return tuple(index)


@kernel("slice_by_size", exact=True)
def slice_by_size(call: Call) -> np.ndarray:
    """``x[begin : begin + size]`` per axis; size -1 runs to the end."""
    x = np.asarray(call["x"])
    begin, size = call.integers("begin"), call.integers("size")
    assert begin is not None and size is not None
    index = []
    for i, (b, s) in enumerate(zip(begin, size, strict=True)):
        b = b + x.shape[i] if b < 0 else b
        index.append(slice(b, None if s == -1 else b + s))
    return np.asarray(x[tuple(index)])


@kernel("reverse", attributes=("axes",), exact=True)
def reverse(call: Call) -> np.ndarray:
    """Reverse the order along ``axes`` (all when absent)."""
    x = np.asarray(call["x"])
    return np.flip(x, axis=norm_axes(call.integers("axes"), x.ndim))


@kernel("identity", exact=True)
def identity(call: Call) -> np.ndarray:
    """``x`` unchanged."""
    return np.asarray(call["x"])
