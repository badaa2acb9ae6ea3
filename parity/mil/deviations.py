"""Per-op deviations others report for the Neural Engine, and how the evaluator applies them.

The table (`DEVIATIONS`) is the only place a figure lives. Each row is one op type, the range
of its input where the figure applies, an absolute error, its source and an evidence label:
every figure is *reported by* someone else (none was measured here, and none is presented as
a measurement of a chip anec has run on). An op with no sourced figure has no row and is
never perturbed.

The perturbation model (profile ``device-margin``): for every output element of an op with a
row whose input ``x`` lies in the row's range, the evaluator adds ``s * bound`` with
``s`` in {-1, +1} drawn from a generator seeded by (seed, crc32 of the op's name) - the same
signs for the same seed, op and element whatever the batch or the order of runs - before the
profile stores the result (fp16 rounding, subnormals flushed). The gate takes the worst over
`SEEDS` per fixture position (`parity.device_margin`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Seeds the device-margin profile runs with, fixed before anything is measured.
SEEDS: tuple[int, ...] = (0, 1, 2)

_FORGE = (
    "Anemll/anemll-forge ANE_DELTANET_NUMERICS.md, 'Root causes' 1 (read at commit 117ded62; "
    "M6, macOS 27, native silu on the NE against the CPU, layer 9 of a Qwen3.8-27B build, "
    "1.3M values)"
)


@dataclass(frozen=True)
class Deviation:
    """One reported absolute error of an op's output, applied where |x| is in [low, high)."""

    op_type: str  # the MIL op type
    bound: float  # added to each element as +-bound
    low: float  # |x| >= low ...
    high: float  # ... and |x| < high (inf: no upper end)
    source: str
    evidence: str  # always "reported by <source>", never "measured"
    reading: str  # how anec reads the source's figure and range
    input: str = "x"  # the op input the range is read on

    @property
    def name(self) -> str:
        """A short label: op type and range, e.g. ``silu |x|<0.5``."""
        if self.low == 0:
            return f"{self.op_type} |x|<{self.high:g}"
        if math.isinf(self.high):
            return f"{self.op_type} |x|>={self.low:g}"
        return f"{self.op_type} {self.low:g}<=|x|<{self.high:g}"

    def mask(self, x: np.ndarray) -> np.ndarray:
        """Where the row applies: ``low <= |x| < high``."""
        magnitude = np.abs(x)
        return (magnitude >= self.low) & (magnitude < self.high)


DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        "silu", 1.1e-3, 0.0, 0.5, _FORGE, "reported by Anemll forge",
        "the source's bin |x| < 0.5 ('near 0'); its mean |error| 0.0011 taken as every "
        "element's deviation (the source gives no maximum)",
    ),
    Deviation(
        "silu", 3.0e-4, 2.0, math.inf, _FORGE, "reported by Anemll forge",
        "the source's bin |x| > 2 (read as |x| >= 2); the upper end of its error "
        "0.0002-0.0003. Between 0.5 and 2 the source gives no figure: no deviation there",
    ),
)  # fmt: skip


@dataclass
class Perturbation:
    """The deviations of one evaluator run under one seed, and what they touched."""

    deviations: tuple[Deviation, ...]
    seed: int = 0
    ops: set[str] = field(default_factory=set)  # names of ops with an element perturbed
    elements: int = 0  # perturbed elements, over every run

    def __post_init__(self) -> None:
        self._by_type: dict[str, list[Deviation]] = {}
        for row in self.deviations:
            self._by_type.setdefault(row.op_type, []).append(row)

    def applies_to(self, op_type: str) -> bool:
        """Whether some row names ``op_type``."""
        return op_type in self._by_type

    def apply(self, op: Any, inputs: dict[str, Any], value: np.ndarray) -> np.ndarray:
        """``value`` (the op's fp32 result, before storing) plus ``s * bound`` where a row's
        range holds the op's input; unchanged for an op without a row."""
        rows = self._by_type.get(op.op_type)
        if not rows:
            return value
        out = np.array(value, dtype=np.float32)  # a copy: kernels may return an input
        signs: np.ndarray | None = None
        for row in rows:
            where = np.broadcast_to(row.mask(np.asarray(inputs[row.input])), out.shape)
            count = int(where.sum())
            if not count:
                continue
            if signs is None:
                signs = self.signs(op.name, out.shape)
            out += np.where(where, signs * np.float32(row.bound), np.float32(0))
            self.ops.add(op.name)
            self.elements += count
        return out

    def signs(self, op_name: str, shape: tuple[int, ...]) -> np.ndarray:
        """+-1 per element (fp32), from (seed, crc32 of ``op_name``): the same for the same
        seed, op and shape."""
        key = np.random.SeedSequence([self.seed, zlib.crc32(op_name.encode("utf-8"))])
        bits = np.random.default_rng(key).integers(0, 2, size=shape, dtype=np.int8)
        return (2 * bits - 1).astype(np.float32)
