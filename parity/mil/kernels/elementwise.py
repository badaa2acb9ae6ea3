"""Elementwise kernels: binary arithmetic and comparisons, unary math, select and cast.

Binary ops broadcast like numpy (MIL uses the same rules). Float inputs arrive as fp32 and
are computed in fp32; the evaluator stores the result as the profile says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from parity.mil.kernels.activations import erf
from parity.mil.registry import Call, kernel

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "real_div": np.true_divide,
    "floor_div": np.floor_divide,
    "mod": np.mod,  # x - floor(x / y) * y, the sign of y, as MIL defines it
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


# A mul operand of at most this many values is checked for being a 0 / 1 mask.
MASK_CHECKED_UP_TO = 65536


@kernel(*_BINARY)
def binary(call: Call) -> np.ndarray:
    """``f(x, y)`` with broadcasting."""
    x, y = np.asarray(call["x"]), np.asarray(call["y"])
    if call.op.op_type == "mul":
        # x * 1 is x and x * 0 is a zero: a product with a 0 / 1 mask (a cache's slot blend)
        # holds stored values only, so rounding it again is skipped (`Call.exact`).
        call.exact = _is_mask(x) or _is_mask(y)
    with np.errstate(all="ignore"):  # inf and NaN are results to report, not exceptions
        return np.asarray(_BINARY[call.op.op_type](x, y))


def _is_mask(a: np.ndarray) -> bool:
    """Whether ``a`` is a small float array of zeros and ones only."""
    if a.dtype.kind != "f" or a.size == 0 or a.size > MASK_CHECKED_UP_TO:
        return False
    if a.flat[0] not in (0.0, 1.0):  # most operands show it at once
        return False
    return bool(np.all((a == 0) | (a == 1)))


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "abs": np.abs,
    "acos": np.arccos,
    "asin": np.arcsin,
    "atan": np.arctan,
    "atanh": np.arctanh,
    "ceil": np.ceil,
    "cos": np.cos,
    "cosh": np.cosh,
    "erf": erf,
    "exp": np.exp,
    "exp2": np.exp2,
    "floor": np.floor,
    "round": np.round,  # ties to even: MIL's round(0.5) is 0
    "sign": np.sign,
    "sin": np.sin,
    "sinh": np.sinh,
    "sqrt": np.sqrt,
    "square": np.square,
    "tan": np.tan,
    "tanh": np.tanh,
    "logical_not": np.logical_not,
}


@kernel(*_UNARY)
def unary(call: Call) -> np.ndarray:
    """``f(x)`` elementwise."""
    with np.errstate(all="ignore"):
        return np.asarray(_UNARY[call.op.op_type](np.asarray(call["x"])))


@kernel("inverse", "log", "rsqrt", attributes=("epsilon",))
def with_epsilon(call: Call) -> np.ndarray:
    """``1/(x+eps)``, ``log(x+eps)``, ``1/sqrt(x+eps)``: MIL adds the epsilon inside."""
    x = call["x"]
    eps = np.asarray(call["epsilon"], dtype=x.dtype)
    with np.errstate(all="ignore"):
        shifted = x + eps
        if call.op.op_type == "inverse":
            return np.asarray(1.0 / shifted, dtype=x.dtype)
        if call.op.op_type == "log":
            return np.asarray(np.log(shifted), dtype=x.dtype)
        return np.asarray(1.0 / np.sqrt(shifted), dtype=x.dtype)


@kernel("clip")
def clip(call: Call) -> np.ndarray:
    """``min(max(x, alpha), beta)``."""
    x = call["x"]
    return np.minimum(np.maximum(x, np.asarray(call["alpha"], x.dtype)), call["beta"])


@kernel("threshold")
def threshold(call: Call) -> np.ndarray:
    """``max(x, alpha)``."""
    x = call["x"]
    return np.maximum(x, np.asarray(call["alpha"], x.dtype))


@kernel("select", exact=True)
def select(call: Call) -> np.ndarray:
    """``a`` where ``cond`` is true, else ``b``, with broadcasting."""
    return np.where(np.asarray(call["cond"]).astype(bool), call["a"], call["b"])


_CAST_TARGETS = {
    "bool",
    "fp16",
    "fp32",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
}


def _check_cast(op: Any) -> str | None:
    dtype = op.dtype.val
    return None if dtype in _CAST_TARGETS else f"cast to {dtype!r}"


@kernel("cast", attributes=("dtype", "dtype:x"), check=_check_cast)
def cast(call: Call) -> np.ndarray:
    """Change the element type; float to int truncates toward zero (numpy ``astype``).

    A cast to fp16 rounds only under fp16 storage: in the ``fp32`` profile every value is
    fp32, and the evaluator's storage rule does the rounding otherwise.
    """
    x = np.asarray(call["x"])
    target = call.text("dtype")
    if target in ("fp16", "fp32"):
        return x.astype(np.float32)
    if target == "bool":
        return x.astype(bool)
    with np.errstate(all="ignore"):
        return x.astype(np.dtype(target.replace("fp", "float")))
