"""The placement-rule types: a rule, the context it reads, the program facts, calibrations.

The rules themselves (the table) are in ``converter.placement.rules``; the tests they run on one op
in ``converter.placement.conditions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from converter.placement.chips import Chip
from converter.placement.ops import Op

Device = Literal["NE", "CPU", "GPU", "none"]
Stage = Literal["program", "global", "op", "neighbour", "default"]
Confidence = Literal["high", "medium", "low"]
ComputeUnits = Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"]
COMPUTE_UNITS: tuple[ComputeUnits, ...] = ("ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY")
CONFIDENCE_ORDER: dict[Confidence, int] = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class ProgramFacts:
    """What program-level rules look at, computed once per function."""

    compute_layers: int  # conv / linear / matmul / einsum ops
    weight_bytes_stored: int
    symbolic_inputs: tuple[str, ...]


@dataclass(frozen=True)
class Context:
    """Everything a rule may read besides the op: chip, compute units, program facts."""

    chip: Chip
    compute_units: ComputeUnits
    program: ProgramFacts


Test = Callable[[Op, Context], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One placement rule. ``test`` returns the reason it applies to an op, or None."""

    id: str
    stage: Stage
    condition: str
    device: Device
    confidence: Confidence
    sources: str
    fix: str
    test: Test
    chips: frozenset[str] | None = None  # None: every chip

    def applies_on(self, chip: Chip) -> bool:
        """True when the rule holds on this chip."""
        return self.chips is None or chip.name in self.chips


@dataclass(frozen=True)
class Calibration:
    """A real MLComputePlan dump of an anec artifact that this table was compared with."""

    package_content_sha256: str
    chip: str
    macos: str
    compute_units: ComputeUnits
    agreement: float  # share of dispatchable ops whose device matched
    note: str
