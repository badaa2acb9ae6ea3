"""Floating-point arithmetic under a numeric profile: fp16 rounding and accumulation.

Every float the evaluator holds is an fp32 array. Under fp16 storage its values are exactly
representable in fp16 (``round_fp16``), so an op reads what the NE would have stored.
"""

from __future__ import annotations

import numpy as np

from parity.mil.profiles import Profile

FP16_MIN_NORMAL = 2.0**-14


def round_fp16(x: np.ndarray) -> np.ndarray:
    """Round to the nearest fp16 value (ties to even, overflow to inf), returned as fp32."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """Replace values below fp16's smallest normal number (2^-14) by zero, keeping the sign."""
    tiny = np.abs(x) < FP16_MIN_NORMAL
    if not tiny.any():
        return x
    return np.where(tiny, np.copysign(np.float32(0.0), x), x).astype(np.float32, copy=False)


class Arithmetic:
    """The arithmetic of one profile: how floats are stored and how sums accumulate."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def store(self, x: np.ndarray) -> np.ndarray:
        """A float result as the profile stores it between ops (fp32 array)."""
        x = np.asarray(x, dtype=np.float32)
        if self.profile.fp16_storage:
            x = round_fp16(x)
            if self.profile.flush_subnormals:
                x = flush_subnormals(x)
        return x

    def _acc_round(self, x: np.ndarray) -> np.ndarray:
        x = round_fp16(x)
        return flush_subnormals(x) if self.profile.flush_subnormals else x

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b`` with numpy broadcasting over leading axes; a (..., M, K), b (..., K, N)."""
        if not self.profile.fp16_accumulation:
            return np.matmul(a, b)
        k = a.shape[-1]
        step = self.profile.acc_block
        acc: np.ndarray | None = None
        for start in range(0, k, step):
            part = np.matmul(a[..., start : start + step], b[..., start : start + step, :])
            acc = self._acc_round(part if acc is None else acc + part)
        if acc is None:  # K == 0: an empty sum
            return np.matmul(a, b)
        return acc

    def sum(self, x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
        """The sum over ``axes`` (non-negative), accumulated as the profile says."""
        if not self.profile.fp16_accumulation:
            return np.asarray(np.sum(x, axis=axes, keepdims=keepdims, dtype=np.float32))
        rest = [i for i in range(x.ndim) if i not in axes]
        moved = np.transpose(x, rest + list(axes))
        n = int(np.prod([x.shape[i] for i in axes], dtype=np.int64))
        flat = moved.reshape(*[x.shape[i] for i in rest], n)
        step = self.profile.acc_block
        acc = np.zeros(flat.shape[:-1], dtype=np.float32)
        for start in range(0, n, step):
            acc = self._acc_round(acc + flat[..., start : start + step].sum(-1, dtype=np.float32))
        if keepdims:
            shape = [1 if i in axes else x.shape[i] for i in range(x.ndim)]
            acc = acc.reshape(shape)
        return acc
