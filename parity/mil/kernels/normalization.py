"""Normalization kernels: softmax, layer_norm, batch_norm, instance_norm, l2_norm.

The sums inside (softmax's denominator, the mean and variance) go through
``Arithmetic.sum``; everything else is fp32 inside the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parity.mil.kernels._axes import norm_axes, norm_axis
from parity.mil.registry import Call, kernel


@kernel("softmax", attributes=("axis",))
def softmax(call: Call) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (default -1)."""
    x = call["x"]
    axis = norm_axis(call.integer("axis", -1), x.ndim)
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / call.arith.sum(e, (axis,), keepdims=True)


def _normalize(call: Call, x: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over ``axes`` with the population variance."""
    count = np.float32(np.prod([x.shape[a] for a in axes]))
    mean = call.arith.sum(x, axes, keepdims=True) / count
    centered = x - mean
    var = call.arith.sum(centered * centered, axes, keepdims=True) / count
    return centered / np.sqrt(var + np.float32(eps))


def _affine(call: Call, out: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``out * gamma + beta``, each optional, reshaped to ``shape`` to broadcast against
    ``out``: the scale first, then the shift, as every norm op here defines them."""
    gamma, beta = call.get("gamma"), call.get("beta")
    if gamma is not None:
        out = out * gamma.reshape(shape)
    if beta is not None:
        out = out + beta.reshape(shape)
    return out


@kernel("layer_norm", attributes=("axes",))
def layer_norm(call: Call) -> np.ndarray:
    """``gamma * (x - mean) / sqrt(var + epsilon) + beta`` over ``axes`` (all when absent)."""
    x = call["x"]
    axes = norm_axes(call.integers("axes"), x.ndim)
    out = _normalize(call, x, axes, call.number("epsilon", 1e-5))
    shape = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    return _affine(call, out, shape)


@kernel("instance_norm")
def instance_norm(call: Call) -> np.ndarray:
    """Per sample and channel over the spatial axes, then per-channel gamma and beta."""
    x = call["x"]
    out = _normalize(call, x, tuple(range(2, x.ndim)), call.number("epsilon", 1e-5))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return _affine(call, out, shape)


@kernel("batch_norm")
def batch_norm(call: Call) -> np.ndarray:
    """``(x - mean[c]) / sqrt(variance[c] + epsilon) * gamma[c] + beta[c]`` on axis 1."""
    x = call["x"]
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = call["mean"].reshape(shape)
    var = call["variance"].reshape(shape)
    out = (x - mean) / np.sqrt(var + np.float32(call.number("epsilon", 1e-5)))
    return _affine(call, out, shape)


@kernel("l2_norm")
def l2_norm(call: Call) -> np.ndarray:
    """``x / sqrt(sum(x^2) + epsilon)`` over the last three axes (the rest are batch)."""
    x = call["x"]
    if x.ndim < 3:
        raise ValueError(f"l2_norm needs rank >= 3, got {x.ndim}")
    axes = (x.ndim - 3, x.ndim - 2, x.ndim - 1)
    total = call.arith.sum(x * x, axes, keepdims=True)
    return x / np.sqrt(total + np.float32(call.number("epsilon", 1e-6)))
