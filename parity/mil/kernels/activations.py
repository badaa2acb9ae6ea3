"""Activation kernels: gelu (three modes), silu, sigmoid, relu family, softplus, elu, ...

Computed in fp32 (erf in fp64); the NE's activation look-up tables are not modelled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.mil.registry import Call, kernel

# Numerical Recipes' erfc (Chebyshev fit): fractional error below 1.2e-7 everywhere, i.e.
# at fp32 resolution; tested against math.erf. numpy has no erf and scipy is not a dependency.
_ERFC = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function in fp64 (relative error below 1.2e-7)."""
    z = np.abs(np.asarray(x, dtype=np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(t)
    for c in reversed(_ERFC[1:]):
        poly = (poly + c) * t
    with np.errstate(under="ignore"):
        ans = t * np.exp(-z * z + _ERFC[0] + poly)
    return np.where(np.asarray(x) >= 0, ans, 2.0 - ans)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function (absolute error below 1.2e-7), in the input's float type."""
    x = np.asarray(x)
    return (1.0 - erfc(x)).astype(x.dtype if x.dtype.kind == "f" else np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` without overflow for large |x|."""
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype)


_GELU_MODES = ("EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION")


def _check_gelu(op: Any) -> str | None:
    mode = "EXACT" if op.mode is None else op.mode.val
    return None if mode in _GELU_MODES else f"gelu mode {mode!r}"


@kernel("gelu", attributes=("mode",), check=_check_gelu)
def gelu(call: Call) -> np.ndarray:
    """EXACT ``x/2 (1 + erf(x/sqrt 2))``; TANH_APPROXIMATION; SIGMOID_APPROXIMATION."""
    x = call["x"]
    mode = call.text("mode", "EXACT")
    if mode == "EXACT":
        # x/2 * erfc(-x/sqrt 2): no cancellation for large negative x.
        value = 0.5 * x.astype(np.float64) * erfc(-x.astype(np.float64) / np.sqrt(2.0))
        return value.astype(x.dtype)
    if mode == "TANH_APPROXIMATION":
        inner = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)
        return (0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype)
    return (x * sigmoid(np.float32(1.702) * x)).astype(x.dtype)


@kernel("silu")
def silu(call: Call) -> np.ndarray:
    """``x * sigmoid(x)``."""
    x = call["x"]
    return x * sigmoid(x)


@kernel("sigmoid")
def sigmoid_kernel(call: Call) -> np.ndarray:
    """``1 / (1 + exp(-x))``."""
    return sigmoid(call["x"])


@kernel("relu")
def relu(call: Call) -> np.ndarray:
    """``max(x, 0)``."""
    x = call["x"]
    return np.maximum(x, np.zeros((), x.dtype))


@kernel("relu6")
def relu6(call: Call) -> np.ndarray:
    """``min(max(x, 0), 6)``."""
    x = call["x"]
    return np.minimum(np.maximum(x, np.zeros((), x.dtype)), np.asarray(6, x.dtype))


@kernel("softplus")
def softplus(call: Call) -> np.ndarray:
    """``log(1 + exp(x))`` without overflow."""
    x = call["x"]
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)


@kernel("softsign")
def softsign(call: Call) -> np.ndarray:
    """``x / (1 + |x|)``."""
    x = call["x"]
    return x / (1 + np.abs(x))


@kernel("elu")
def elu(call: Call) -> np.ndarray:
    """``x`` if positive else ``alpha (exp(x) - 1)``."""
    x = call["x"]
    alpha = np.asarray(call.number("alpha", 1.0), x.dtype)
    with np.errstate(over="ignore"):
        return np.where(x > 0, x, alpha * np.expm1(x)).astype(x.dtype)


@kernel("leaky_relu")
def leaky_relu(call: Call) -> np.ndarray:
    """``x`` if positive else ``alpha x``."""
    x = call["x"]
    return np.where(x >= 0, x, np.asarray(call.number("alpha", 0.01), x.dtype) * x)


@kernel("prelu")
def prelu(call: Call) -> np.ndarray:
    """``x`` if positive else ``alpha[c] x`` with one alpha per channel (axis 1)."""
    x = call["x"]
    alpha = np.asarray(call["alpha"], x.dtype).reshape((1, -1) + (1,) * (x.ndim - 2))
    return np.where(x >= 0, x, alpha * x)


@kernel("linear_activation")
def linear_activation(call: Call) -> np.ndarray:
    """``alpha x + beta``."""
    x = call["x"]
    return np.asarray(call.number("alpha"), x.dtype) * x + np.asarray(call.number("beta"), x.dtype)


@kernel("scaled_tanh")
def scaled_tanh(call: Call) -> np.ndarray:
    """``alpha tanh(beta x)``."""
    x = call["x"]
    alpha, beta = (np.asarray(call.number(n), x.dtype) for n in ("alpha", "beta"))
    return alpha * np.tanh(beta * x)


@kernel("sigmoid_hard")
def sigmoid_hard(call: Call) -> np.ndarray:
    """``min(max(alpha x + beta, 0), 1)``."""
    x = call["x"]
    alpha, beta = (np.asarray(call.number(n), x.dtype) for n in ("alpha", "beta"))
    return np.clip(alpha * x + beta, 0, 1).astype(x.dtype)


@kernel("softplus_parametric")
def softplus_parametric(call: Call) -> np.ndarray:
    """``alpha[c] log(1 + exp(beta[c] x))``, one alpha and beta per channel (axis 1)."""
    x = call["x"]
    shape = (1, -1) + (1,) * (x.ndim - 2)
    alpha = np.asarray(call["alpha"], x.dtype).reshape(shape)
    beta = np.asarray(call["beta"], x.dtype).reshape(shape)
    bx = beta * x
    return (alpha * (np.maximum(bx, 0) + np.log1p(np.exp(-np.abs(bx))))).astype(x.dtype)


@kernel("thresholded_relu")
def thresholded_relu(call: Call) -> np.ndarray:
    """``x`` if ``x >= alpha`` else 0."""
    x = call["x"]
    return np.where(x >= np.asarray(call.number("alpha", 1.0), x.dtype), x, 0).astype(x.dtype)


@kernel("clamped_relu")
def clamped_relu(call: Call) -> np.ndarray:
    """``min(x, beta)`` if ``x >= 0`` else ``min(alpha x, beta)``."""
    x = call["x"]
    alpha, beta = (np.asarray(call.number(n), x.dtype) for n in ("alpha", "beta"))
    return np.minimum(np.where(x >= 0, x, alpha * x), beta).astype(x.dtype)
