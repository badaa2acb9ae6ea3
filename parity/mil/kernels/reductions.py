"""Reduction kernels: reduce_* over ``axes`` (all axes when absent) with ``keep_dims``.

Sums go through ``Arithmetic.sum`` so the profile decides how they accumulate; max, min and
the arg-reductions are exact in any precision.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parity.mil.kernels._axes import norm_axes, norm_axis
from parity.mil.registry import Call, kernel


def _axes(call: Call, x: np.ndarray) -> tuple[int, ...]:
    return norm_axes(call.integers("axes"), x.ndim)


@kernel(
    "reduce_sum",
    "reduce_mean",
    "reduce_sum_square",
    "reduce_l1_norm",
    "reduce_l2_norm",
    "reduce_log_sum",
    "reduce_log_sum_exp",
    attributes=("axes", "keep_dims"),
)
def reduce_sums(call: Call) -> np.ndarray:
    """Every reduction built on a sum."""
    x = call["x"]
    axes = _axes(call, x)
    keep = call.flag("keep_dims")
    kind = call.op.op_type
    with np.errstate(all="ignore"):
        if kind == "reduce_log_sum_exp":
            peak = np.max(x, axis=axes, keepdims=True)
            peak = np.where(np.isfinite(peak), peak, 0).astype(x.dtype)
            total = call.arith.sum(np.exp(x - peak), axes, keepdims=True)
            out = np.log(total) + peak
            return out if keep else np.squeeze(out, axis=axes)
        terms = {
            "reduce_sum": x,
            "reduce_mean": x,
            "reduce_log_sum": x,
            "reduce_sum_square": x * x,
            "reduce_l2_norm": x * x,
            "reduce_l1_norm": np.abs(x),
        }[kind]
        total = call.arith.sum(terms, axes, keepdims=keep)
        if kind == "reduce_mean":
            return total / np.asarray(math.prod(x.shape[a] for a in axes), total.dtype)
        if kind == "reduce_l2_norm":
            return np.sqrt(total)
        if kind == "reduce_log_sum":
            return np.log(total)
        return total


@kernel("reduce_max", "reduce_min", "reduce_prod", attributes=("axes", "keep_dims"))
def reduce_extrema(call: Call) -> np.ndarray:
    """Max, min (exact) and product (fp32; no profile models a product accumulator)."""
    x = call["x"]
    axes, keep = _axes(call, x), call.flag("keep_dims")
    with np.errstate(all="ignore"):
        if call.op.op_type == "reduce_max":
            return np.asarray(np.max(x, axis=axes, keepdims=keep))
        if call.op.op_type == "reduce_min":
            return np.asarray(np.min(x, axis=axes, keepdims=keep))
        return np.asarray(np.prod(x, axis=axes, keepdims=keep))


@kernel("reduce_argmax", "reduce_argmin", attributes=("axis", "keep_dims"))
def reduce_arg(call: Call) -> np.ndarray:
    """Index of the first maximum (minimum) along ``axis`` (default -1), as int32."""
    x = call["x"]
    axis = norm_axis(call.integer("axis", -1), x.ndim)
    fn = np.argmax if call.op.op_type == "reduce_argmax" else np.argmin
    out = fn(x, axis=axis, keepdims=call.flag("keep_dims"))
    return np.asarray(out, dtype=np.int32)


_INDEX_DTYPES = {"int32": np.int32, "uint16": np.uint16, "int16": np.int16}


def _check_topk(op: Any) -> str | None:
    dtype = op.output_indices_dtype.val if "output_indices_dtype" in op.inputs else "int32"
    return None if dtype in _INDEX_DTYPES else f"topk indices as {dtype!r}"


@kernel(
    "topk",
    attributes=("axis", "ascending", "sort", "return_indices", "output_indices_dtype"),
    check=_check_topk,
    exact=True,
)
def topk(call: Call) -> list[np.ndarray]:
    """The k largest (``ascending``: smallest) values along ``axis`` and their indices.

    Sorted by value with ties in index order (a stable sort: the first maximum first, as
    ``reduce_argmax`` picks it); ``sort=False`` is accepted and gives the same order, which
    is one of the orders an unsorted topk may return. Values are selected, never rounded.
    """
    x = np.asarray(call["x"])
    k = call.integer("k")
    axis = norm_axis(call.integer("axis", -1), x.ndim)
    if not 0 < k <= x.shape[axis]:
        raise ValueError(f"k = {k} outside 1..{x.shape[axis]} (axis {axis})")
    key = x if call.flag("ascending") else -x.astype(np.float64)
    order = np.argsort(key, axis=axis, kind="stable")
    index = np.take(order, np.arange(k), axis=axis)
    values = np.take_along_axis(x, index, axis=axis)
    dtype = _INDEX_DTYPES[call.text("output_indices_dtype", "int32")]
    if not call.flag("return_indices", True):
        return [values]
    return [values, index.astype(dtype)]
