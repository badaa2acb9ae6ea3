"""Will a conversion fit on this machine? Peak memory and artifact size, estimated up front.

A conversion that runs out of memory is killed after minutes of work, with no message; one
that runs out of disk fails while saving. Both are estimated from the checkpoint's parameter
count (read from the weight files' headers) and checked before any work starts.

Memory model: a base (the interpreter with torch, transformers and coremltools loaded, the
tokenizer) plus a multiple of the fp32 weights (the loaded model, whose tensors the canonical
weights and the BC1L module's convs share; the fused q/k/v and gate/up matrices; the fp16
copy for the torch parity level; the converted program's fp16 constants) plus a multiple of
the fp32 embedding table (the host table, scaled when the model scales its embeddings; the
vocabulary-wide logits and softmaxes of every parity level). Peaks measured with
``/usr/bin/time -v`` (bench/README.md, issue 22), fp32 weights / table in GiB:

    MiniLM-L6            1.08 GiB   0.085 / 0.044
    SmolLM2-135M         1.86 GiB   0.501 / 0.105   (2.30 with a state cache)
    Gemma 3 270M         3.75 GiB   0.999 / 0.625   (4.76 with a state cache: CACHE_LOGITS_MULTIPLE)
    Qwen2.5-0.5B shape   4.71 GiB   1.840 / 0.507
    Llama-3.2-1B shape  10.54 GiB   4.604 / 0.979   (9.44 with a state cache)

1.25 GiB + 2.0 x weights + 1.4 x table lies above each (1.48, 2.40, 4.12, 5.64, 11.83 GiB),
so a 1B model's conversion is let through under a 12 GiB limit. The base is above MiniLM's
peak by what SmolLM2's state-cache recipe needs (its convert and cache-parity steps reached
2.26 and 2.30 GiB); a cached decoder's continuation logits have their own term below. The
table term is there for Gemma, whose table is 63 % of its weights.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from converter.errors import InputError

GIB = 1 << 30
# Above what a tiny model peaks at (MiniLM: 1.08 GiB, of it 0.13 GiB of fp32 weights and
# table) by what SmolLM2's state-cache recipe needs (see the module docstring).
BASE_BYTES = int(1.25 * GIB)
# Peak bytes per byte of fp32 weights and of the fp32 embedding table, above the base (see
# the module docstring).
FP32_MULTIPLE = 2.0
TABLE_MULTIPLE = 1.4
# More for a recipe with compressed variants, whose parity step holds the variant's models
# beside the fp16 ones. Measured peaks with variants (`/usr/bin/time -v`, bench/README.md),
# over the same process's fp16 artifact: SmolLM2's mixed-bit search 2.86 GiB (+0.96, set in
# the search), SmolLM2's four variants 2.89 (+0.76), Qwen2.5-0.5B shape int8 5.37 (+0.67),
# MiniLM's lut8 1.15 (+0). 2.0 more per fp32 byte lies above each (3.40, 3.40, 9.32, 1.65 GiB);
# it was 4.0 while variants added up to 2.61 GiB, before the variant cuts of 2026-12-02.
VARIANT_MULTIPLE = 2.0
# More for a cached decoder, whose cache levels (SPEC 4, "Cached decoders") hold logit rows
# of whole continuations: bytes per fp32 element of one continuation's logits ((decode
# steps + 1) x vocabulary). Gemma 3 270M KV (513 x 262,144 elements, 0.50 GiB) peaked at
# 4.76 GiB under the cache rule of 2026-12-05, 0.64 GiB above the estimate without this term
# (1.27 x); 1.5 x lies above it (4.87 GiB). Measured before the fp32 cache level stopped
# holding its extend rows (2026-12-06), so an upper figure.
CACHE_LOGITS_MULTIPLE = 1.5
MEMORY_LIMIT_ENV = "ANEC_MEMORY_LIMIT"
_UNLIMITED = 1 << 60  # cgroup files report "no limit" as a huge number
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class MemoryEstimate:
    """The expected peak resident memory of converting a checkpoint."""

    n_parameters: int
    variants: bool = False  # compressed variants after the fp16 artifact
    table_elements: int = 0  # the token embedding table's (vocab x hidden)
    cache_logits: int = 0  # a cached decoder's: one continuation's logits, (steps + 1) x vocab

    @property
    def fp32_bytes(self) -> int:
        """The weights as fp32 tensors, as transformers holds the reference model."""
        return 4 * self.n_parameters

    @property
    def multiple(self) -> float:
        """Peak bytes per byte of fp32 weights, above the base."""
        return FP32_MULTIPLE + (VARIANT_MULTIPLE if self.variants else 0.0)

    @property
    def peak_bytes(self) -> int:
        """The estimated peak."""
        table = TABLE_MULTIPLE * 4 * self.table_elements
        rows = CACHE_LOGITS_MULTIPLE * 4 * self.cache_logits
        return BASE_BYTES + int(self.multiple * self.fp32_bytes + table + rows)

    def describe(self) -> str:
        """One sentence that shows where the figure comes from."""
        return (
            f"{self.n_parameters / 1e6:.1f}M parameters ({gib(self.fp32_bytes)} as fp32, "
            f"embedding table {gib(4 * self.table_elements)}) need about "
            f"{gib(self.peak_bytes)} at the peak ({gib(BASE_BYTES)} + {self.multiple:g} x the "
            f"fp32 weights + {TABLE_MULTIPLE:g} x the table"
            + (", compressed variants included" if self.variants else "")
            + (
                f" + {CACHE_LOGITS_MULTIPLE:g} x a continuation's logits"
                if self.cache_logits
                else ""
            )
            + ")"
        )


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals."""
    return f"{n / GIB:.2f} GiB"


def estimate_peak_memory(
    n_parameters: int, variants: bool = False, table_elements: int = 0, cache_logits: int = 0
) -> MemoryEstimate:
    """The estimated peak resident memory of ``anec convert`` for a checkpoint of this size
    (and this many embedding-table elements), with or without compressed variants after the
    fp16 artifact; ``cache_logits``: a cached decoder's (decode steps + 1) x vocabulary."""
    return MemoryEstimate(n_parameters, variants, table_elements, cache_logits)


def parse_size(text: str) -> int:
    """Parse a size such as ``8GiB``, ``6G``, ``512MiB`` or ``1073741824`` (bytes)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise InputError(
            f"{MEMORY_LIMIT_ENV}={text!r}: expected a size such as 8GiB or 512MiB, or 'off'"
        )
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    return int(value) if value.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """Room left under a container's memory limit (cgroup v2, then v1), if there is a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit = _read_int(limit_file)
        if limit is not None and limit < _UNLIMITED:
            return max(0, limit - (_read_int(usage_file) or 0))
    return None


def own_peak_bytes() -> int:
    """This process's peak resident memory so far (already counted as used by the system)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS bytes, Linux KiB


def memory_budget() -> tuple[int, str] | None:
    """How much this conversion may use at its peak, and where the figure comes from.

    ``ANEC_MEMORY_LIMIT`` overrides the detection (a size, or ``off`` for no check). Otherwise
    the smaller of the system's available memory and the room under a cgroup limit, plus what
    this process already holds. None when nothing is known (no check).
    """
    override = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if override.lower() in ("off", "none"):
        return None
    if override:
        return parse_size(override), f"{MEMORY_LIMIT_ENV}={override}"
    found = [
        (value, name)
        for value, name in (
            (_meminfo_available(), "available memory (MemAvailable)"),
            (_cgroup_room(), "room under the cgroup memory limit"),
        )
        if value is not None
    ]
    if not found:
        return None
    room, source = min(found)
    return room + own_peak_bytes(), source


def children_with_room(each: int, count: int) -> int:
    """How many of ``count`` child processes, each adding ``each`` bytes, the memory budget
    has room for beside this process's peak so far (all of them when there is no budget)."""
    budget = memory_budget()
    if budget is None:
        return count
    return min(count, max(0, budget[0] - own_peak_bytes()) // each)


def check_memory(estimate: MemoryEstimate, what: str) -> None:
    """Raise InputError when the estimated peak exceeds the memory budget."""
    budget = memory_budget()
    if budget is None or estimate.peak_bytes <= budget[0]:
        return
    limit, source = budget
    raise InputError(
        f"{what}: not enough memory: {estimate.describe()}, but only {gib(limit)} can be used "
        f"({source}). Use a machine with more memory, or set {MEMORY_LIMIT_ENV}=off to try "
        "anyway"
    )


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(needs: Mapping[Path, int], what: str, purpose: str = "the artifact") -> None:
    """Raise InputError when a filesystem has less free space than the folders on it need
    together (``needs``: folder -> bytes; ``purpose`` says what needs them)."""
    by_device: dict[int, tuple[Path, int, int]] = {}  # device -> (first folder, need, free)
    for folder, needed in needs.items():
        try:
            existing = _existing_parent(folder)
            device, free = os.stat(existing).st_dev, shutil.disk_usage(existing).free
        except OSError:
            continue  # the write itself will report the problem, naming the path
        first, total, _ = by_device.get(device, (folder, 0, free))
        by_device[device] = (first, total + needed, free)
    for folder, needed, free in by_device.values():
        if free < needed:
            raise InputError(
                f"{what}: not enough disk space in {folder}: {purpose} needs about "
                f"{gib(needed)}, {gib(free)} is free"
            )
