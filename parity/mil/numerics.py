"""Floating-point arithmetic under a numeric profile: fp16 rounding and accumulation.

Every float the evaluator holds is an fp32 array. Under fp16 storage its values are exactly
representable in fp16 (``round_fp16``), so an op reads what the NE would have stored.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from parity.mil.profiles import Profile

if TYPE_CHECKING:
    import torch

FP16_MIN_NORMAL = 2.0**-14
# Arrays of at least this many values are converted by torch (faster there); smaller by numpy.
TORCH_FROM = 1024


def round_fp16(x: np.ndarray, flush: bool = False) -> np.ndarray:
    """Round to the nearest fp16 value (ties to even, overflow to inf), returned as fp32.

    With ``flush``, fp16 subnormal results become zero of the same sign.
    """
    half = to_fp16(x)
    if flush:
        bits = half.view(np.uint16)
        subnormal = (bits & 0x7C00) == 0  # exponent field 0: zero or subnormal
        bits[subnormal] &= 0x8000  # keep the sign, clear the magnitude
    return widen_fp16(half)


def to_fp16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to fp16 (ties to even, overflow to inf), as a new fp16 array.

    An fp32 array goes through torch's conversion: on this machine's CPU 16x faster than
    numpy's (4M values: 1.4 ms against 22.8 ms), and bit-identical to it for every fp32
    value but NaN payloads (checked over all 2^32 bit patterns). Below ``TORCH_FROM`` values
    numpy is the faster (576 values: 3.1 us against 5.6), as for any other dtype, which numpy
    rounds directly, never through fp32 first, which could round twice."""
    x = np.asarray(x)
    if x.size >= TORCH_FROM and _torch_readable(x, np.float32):
        return _as_torch(x).half().numpy()
    with np.errstate(over="ignore"):
        return x.astype(np.float16)


def widen_fp16(half: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """An fp16 array as fp32 (exact), as a new array or into ``out`` (fp32, same shape);
    torch's conversion where it can read the arrays (4M values: 8 ms against numpy's 11)."""
    if out is None:
        if half.size >= TORCH_FROM and _torch_readable(half, np.float16):
            return _as_torch(half).float().numpy()
        return half.astype(np.float32)
    if _torch_readable(half, np.float16) and _torch_readable(out, np.float32):
        _as_torch(out).copy_(_as_torch(half))
    else:
        np.copyto(out, half)
    return out


def _torch_readable(x: np.ndarray, dtype: type[np.floating]) -> bool:
    """Whether torch can take ``x`` as it is: that dtype and no negative strides."""
    return x.dtype == dtype and all(s >= 0 for s in x.strides)


def _as_torch(x: np.ndarray) -> torch.Tensor:
    """``x`` as a tensor sharing its memory, only ever read here: torch warns that it does
    not support a read-only array (a program's memory-mapped weights), which a read is not."""
    # Imported here: the CLI imports the evaluator's modules, and importing torch there made
    # every command 2 s slower and imported tqdm before TQDM_DISABLE was set (runlog).
    import torch

    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def has_fp16_subnormal(x: np.ndarray) -> bool:
    """True if some value of ``x`` is non-zero and below fp16's smallest normal number."""
    if x.size == 0 or not np.issubdtype(x.dtype, np.floating):
        return False
    if x.dtype == np.float16:
        # Its bits: magnitude field in 1..0x3FF (exponent 0, mantissa not 0). Integer passes
        # instead of fp16 comparisons numpy makes per element: 8x faster on SmolLM2's
        # weights, the same answer for every fp16 value (tests/test_mil_profiles.py).
        magnitude = np.bitwise_and(x.view(np.uint16), np.uint16(0x7FFF))
        magnitude -= np.uint16(1)  # 0 wraps to 0xFFFF
        return bool((magnitude < 0x3FF).any())
    tiny = np.abs(x) < FP16_MIN_NORMAL
    return bool((tiny & (x != 0)).any())


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
        x = np.asarray(x)
        if x.dtype == np.float16 and not self.profile.flush_subnormals:
            return widen_fp16(x)  # fp16 values already: nothing to round
        x = x.astype(np.float32, copy=False)
        if self.profile.fp16_storage:
            x = round_fp16(x, self.profile.flush_subnormals)
        return x

    def _acc_round(self, x: np.ndarray) -> np.ndarray:
        return round_fp16(x, self.profile.flush_subnormals)

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b`` with numpy broadcasting over leading axes; a (..., M, K), b (..., K, N)."""
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        (m, k), n = a.shape[-2:], b.shape[-1]
        a3 = np.broadcast_to(a, batch + (m, k)).reshape(-1, m, k)
        b3 = np.broadcast_to(b, batch + (k, n)).reshape(-1, k, n)
        out = np.empty((a3.shape[0], m, n), dtype=np.result_type(a, b))
        # One 2-D product per batch element: numpy's stacked matmul does not reach BLAS
        # (measured 7x slower on SmolLM2's shapes).
        for i in range(a3.shape[0]):
            out[i] = self._matmul2d(a3[i], b3[i])
        return out.reshape(batch + (m, n))

    def _matmul2d(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if not self.profile.fp16_accumulation or a.shape[-1] == 0:
            return np.matmul(a, b)
        (m, k), step = a.shape, self.profile.acc_block
        blocks = -(-k // step)
        pad = blocks * step - k
        if pad:  # zero terms add nothing, exactly
            a = np.concatenate([a, np.zeros((m, pad), a.dtype)], axis=1)
            b = np.concatenate([b, np.zeros((pad, b.shape[1]), b.dtype)], axis=0)
        # A block of a's columns is a slice with unit column stride, which BLAS reads in place;
        # copying every block out first cost a whole weight copy per product (measured on
        # SmolLM2: 1.5 s of a 14 s fp16-acc run; same bits).
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        if a.dtype == b.dtype == np.float32:
            return self._block_sums(a, b, blocks, step)
        acc = self._acc_round(a[:, :step] @ b[:step])
        for j in range(1, blocks):
            # The exact sum of one block of terms, added to the fp16 running sum.
            block = slice(j * step, (j + 1) * step)
            acc = self._acc_round(acc + a[:, block] @ b[block])
        return acc

    def _block_sums(self, a: np.ndarray, b: np.ndarray, blocks: int, step: int) -> np.ndarray:
        """The fp16 running sum of ``a @ b``'s block products (fp32 operands, K a multiple of
        ``step``).

        Each step is ``_acc_round(acc + block product)``, computed in buffers made once per
        product instead of new arrays per block: the same BLAS call, fp32 addition, torch's
        fp16 rounding and widening (`to_fp16`, `widen_fp16`) and subnormal flush, so the same
        bits (tests/test_mil_numerics.py); the allocations and page faults were a third of
        the fp16-acc profile's convolutions on SmolLM2.
        """
        import torch  # as in `_as_torch`: not at the module's import

        shape = (a.shape[0], b.shape[1])
        acc, prod = np.empty(shape, np.float32), np.empty(shape, np.float32)
        half = np.empty(shape, np.float16)
        acc_t, prod_t = torch.from_numpy(acc), torch.from_numpy(prod)
        half_t = torch.from_numpy(half)
        bits, exponent, subnormal = half.view(np.uint16), np.empty(shape, np.uint16), None
        if self.profile.flush_subnormals:
            subnormal = np.empty(shape, np.bool_)
        for j in range(blocks):
            block = slice(j * step, (j + 1) * step)
            np.matmul(a[:, block], b[block], out=prod)  # the exact (fp32) sum of one block
            if j:
                np.add(acc, prod, out=prod)  # added to the fp16 running sum
            half_t.copy_(prod_t)  # rounded to fp16, as `to_fp16`
            if subnormal is not None:  # as `round_fp16(flush=True)`: keep only the sign
                np.equal(np.bitwise_and(bits, 0x7C00, out=exponent), 0, out=subnormal)
                np.bitwise_and(bits, 0x8000, out=bits, where=subnormal)
            acc_t.copy_(half_t)  # widened, as `widen_fp16`
        return acc

    def _accumulate(self, parts: np.ndarray, axis: int, count: int) -> np.ndarray:
        """The running sum over ``axis`` of block sums, rounded to fp16 after every block."""
        parts = np.moveaxis(parts, axis, 0)
        acc = self._acc_round(parts[0])
        for j in range(1, count):
            acc = self._acc_round(acc + parts[j])
        return acc

    def sum(self, x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
        """The sum over ``axes`` (non-negative), accumulated as the profile says.

        In fp32 the terms are summed along a contiguous last axis, where numpy sums pairwise:
        over any other axis it adds whole slices one after another, a sequential fp32 sum
        (a (1, 1024, 1, 4) softmax denominator: 10x the pairwise error), which made the fp32
        cache level's extend calls (T = 4) on Gemma 3 four times as far from fp64 as torch."""
        rest = [i for i in range(x.ndim) if i not in axes]
        n = int(np.prod([x.shape[i] for i in axes], dtype=np.int64))
        flat = np.transpose(x, rest + list(axes)).reshape(*[x.shape[i] for i in rest], n)
        if not self.profile.fp16_accumulation:
            total = np.sum(np.ascontiguousarray(flat), axis=-1, dtype=np.float32)
            if keepdims:
                total = total.reshape([1 if i in axes else x.shape[i] for i in range(x.ndim)])
            return np.asarray(total)
        step = self.profile.acc_block
        blocks = max(1, -(-n // step))
        pad = blocks * step - n
        if pad:
            flat = np.concatenate([flat, np.zeros((*flat.shape[:-1], pad), flat.dtype)], -1)
        parts = flat.reshape(*flat.shape[:-1], blocks, step).sum(-1, dtype=np.float32)
        acc = self._accumulate(parts, axis=-1, count=blocks)
        if keepdims:
            acc = acc.reshape([1 if i in axes else x.shape[i] for i in range(x.ndim)])
        return acc
