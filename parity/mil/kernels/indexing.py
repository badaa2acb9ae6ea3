"""Gather kernels: gather (with batch_dims), gather_along_axis, gather_nd.

Indices may be negative (counted from the end, as MIL allows); an index out of range is an
error, never a silent wrap or clamp.
"""

from __future__ import annotations

import numpy as np

from parity.mil.kernels._axes import norm_axis
from parity.mil.registry import Call, kernel


def _checked(indices: np.ndarray, size: int) -> np.ndarray:
    indices = np.asarray(indices).astype(np.int64)
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise IndexError(f"index out of range [{-size}, {size}): {indices.min()}..{indices.max()}")
    return np.where(indices < 0, indices + size, indices)


@kernel("gather", attributes=("axis", "batch_dims"), exact=True)
def gather(call: Call) -> np.ndarray:
    """``x`` indexed by ``indices`` along ``axis``; the first ``batch_dims`` axes are shared."""
    x = np.asarray(call["x"])
    axis = norm_axis(call.integer("axis", 0), x.ndim)
    batch = call.integer("batch_dims", 0)
    indices = _checked(call["indices"], x.shape[axis])
    if batch == 0:
        return np.take(x, indices, axis=axis)
    rows = [np.take(x[b], indices[b], axis=axis - batch) for b in np.ndindex(*x.shape[:batch])]
    out_shape = x.shape[:batch] + rows[0].shape
    return np.stack(rows).reshape(out_shape)


@kernel("gather_along_axis", attributes=("axis",), exact=True)
def gather_along_axis(call: Call) -> np.ndarray:
    """``out[..., i, ...] = x[..., indices[..., i, ...], ...]`` along ``axis``."""
    x = np.asarray(call["x"])
    axis = norm_axis(call.integer("axis", 0), x.ndim)
    indices = _checked(call["indices"], x.shape[axis])
    return np.take_along_axis(x, indices, axis=axis)


@kernel("gather_nd", attributes=("batch_dims",), exact=True)
def gather_nd(call: Call) -> np.ndarray:
    """Slices of ``x`` addressed by the last axis of ``indices`` (after ``batch_dims``)."""
    x = np.asarray(call["x"])
    batch = call.integer("batch_dims", 0)
    indices = np.asarray(call["indices"]).astype(np.int64)

    def one(xb: np.ndarray, ib: np.ndarray) -> np.ndarray:
        depth = ib.shape[-1]
        cols = [_checked(ib[..., d], xb.shape[d]) for d in range(depth)]
        return xb[tuple(cols)]

    if batch == 0:
        return one(x, indices)
    rows = [one(x[b], indices[b]) for b in np.ndindex(*x.shape[:batch])]
    return np.stack(rows).reshape(x.shape[:batch] + rows[0].shape)
