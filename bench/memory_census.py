"""Where a conversion's memory is: a census at every step boundary of ``anec convert``.

    python bench/memory_census.py RECIPE --out DIR [--force] [--deep]

Runs ``anec convert RECIPE`` in this process and prints, when each pipeline step starts and
ends: the process's RSS; the bytes of every live torch CPU storage (each counted once) and of
every numpy array reachable from a Python object (by owning base), with the arrays and
storages above 200 MB named by shape; and glibc's heap figures (``mallinfo2``: heap in use,
free but still mapped, and mmapped blocks), which show freed memory that still counts in the
RSS. ``--deep`` adds the same census around the variant parity step's torch and MIL levels.
A debugging aid for the peak-memory figures of ``compress.py methods`` (bench/README.md); the
census itself walks every Python object, so it adds seconds per step and some memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GIB = 2**30
BIG = 200e6


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _heap() -> str:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return "heap: n/a (not glibc)"
    return (
        f"heap in use {m.uordblks / GIB:.2f} free-but-mapped {m.fordblks / GIB:.2f} "
        f"mmapped {m.hblkhd / GIB:.2f} GiB"
    )


def resident_gib() -> float:
    """This process's resident memory now (VmRSS), in GiB; NaN where /proc has none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def census(tag: str) -> None:
    """Print the census line for ``tag``."""
    import numpy as np
    import torch

    gc.collect()
    seen: set[int] = set()
    torch_bytes = numpy_bytes = 0
    big: list[str] = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                torch_bytes += storage.nbytes()
                if storage.nbytes() > BIG:
                    big.append(f"torch {tuple(obj.shape)} {obj.dtype}")
            continue
        # numpy arrays are not tracked by the collector: reach them through their holders
        for ref in gc.get_referents(obj):
            if not isinstance(ref, np.ndarray):
                continue
            while isinstance(ref.base, np.ndarray):
                ref = ref.base
            if ref.flags.owndata and ref.ctypes.data not in seen:
                seen.add(ref.ctypes.data)
                numpy_bytes += ref.nbytes
                if ref.nbytes > BIG:
                    big.append(f"numpy {ref.shape} {ref.dtype}")
    print(
        f"[census] {tag}: rss {resident_gib():.2f} GiB, torch {torch_bytes / GIB:.2f}, numpy "
        f"{numpy_bytes / GIB:.2f}; {_heap()}" + (f"; > 200 MB: {', '.join(big)}" if big else ""),
        file=sys.stderr,
        flush=True,
    )


def _around(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        census(f"before {name}")
        try:
            return function(*args, **kwargs)
        finally:
            census(f"after {name}")

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--deep", action="store_true", help="also inside the parity step")
    args = parser.parse_args()

    import converter.pipeline.progress as progress
    from converter.commands import main as anec

    step = progress.Steps.step

    @contextlib.contextmanager
    def counted(self: Any, name: str, total: int | None = None) -> Iterator[Any]:
        census(f"start {name}")
        with step(self, name, total) as advance:
            yield advance
        census(f"end {name}")

    progress.Steps.step = counted  # type: ignore[method-assign]
    if args.deep:
        import parity.compression_gates as decoder

        for name in ("torch_logits", "mil_logits", "mil_fp32_check"):
            setattr(decoder, name, _around(getattr(decoder, name), name))
    argv = ["convert", str(args.recipe), "--out", str(args.out)]
    anec([*argv, "--force"] if args.force else argv)  # click exits with anec's exit code


if __name__ == "__main__":
    main()
