"""Give memory back to the operating system between the heavy steps of a conversion.

At Qwen2.5-0.5B size each copy of the model is GBs, and the steps that hold one (an MIL
evaluator's decoded constants, a torch copy with a variant's weights) free it before the next
one starts. Freeing is not enough on glibc: arrays smaller than its mmap threshold (which grows
to 32 MiB as large blocks are freed, so most weight-sized arrays) come from the heap, and
freed heap pages stay resident. Measured with ``bench/compress.py methods`` at full depth: 2 GiB
of free heap still counted in the process's RSS after the fp16 artifact's MIL parity step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable


def _libc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim  # glibc only
        return trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_memory() -> None:
    """Collect unreachable objects, then return free heap pages to the system (glibc's
    ``malloc_trim``; elsewhere only the collection)."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
