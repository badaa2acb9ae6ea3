"""The device-margin level: does the program's argmax survive the errors others report for
the NE? (issue 23, item 3)

The ``device-margin`` MIL profile (`parity.mil.profiles`) runs the emitted program once per
seed of `parity.mil.deviations.SEEDS`, each time adding the reported per-op deviations with
that seed's signs. Per fixture position the worst seed is kept - a flipped argmax before a
kept one, then the larger |dp| - and its |dp| is compared with the gated ``fp16`` profile's at
the same position. Every figure rests on *reported* deviations (their sources are in the
table); nothing here is a measurement of a chip.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parity.gate_registry import GateResult, first_few, gate, json_number
from parity.metrics import PositionRow
from parity.mil.deviations import Deviation

IMPLEMENTATION = "mil-device-margin"
PositionKey = tuple[str, int]  # (fixture, position)


@dataclass(frozen=True)
class MarginRow:
    """One real position under the worst seed, beside the fp16 profile at that position."""

    fixture: str
    position: int
    margin: float  # the reference's top1 - top2
    argmax_kept: bool  # under every seed
    worst_seed: int
    abs_dprob: float  # the worst seed's |dp|
    fp16_abs_dprob: float  # the fp16 profile's |dp| here (NaN when fp16 did not run)
    # The fp16-acc profile's |dp| here: the same assumptions without the deviations (NaN when
    # fp16-acc did not run first).
    acc_abs_dprob: float = math.nan

    @property
    def dprob_growth(self) -> float:
        """How much the worst seed's |dp| exceeds the fp16 profile's (NaN without fp16)."""
        return self.abs_dprob - self.fp16_abs_dprob

    @property
    def deviation_growth(self) -> float:
        """The deviations' own share: the worst seed's |dp| over fp16-acc's (NaN without)."""
        return self.abs_dprob - self.acc_abs_dprob

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, NaN and inf spelt as strings."""
        return {
            "fixture": self.fixture,
            "position": self.position,
            "margin": json_number(self.margin),
            "argmax_kept": self.argmax_kept,
            "worst_seed": self.worst_seed,
            "abs_dprob": json_number(self.abs_dprob),
            "fp16_abs_dprob": json_number(self.fp16_abs_dprob),
            "dprob_growth": json_number(self.dprob_growth),
            "fp16_acc_abs_dprob": json_number(self.acc_abs_dprob),
            "deviation_growth": json_number(self.deviation_growth),
        }


def _badness(row: PositionRow) -> tuple[bool, float]:
    """Order of worse: a flipped argmax, then a larger |dp| (NaN counts as worst)."""
    dprob = math.inf if math.isnan(row.abs_dprob) else row.abs_dprob
    return (not row.argmax_kept, dprob)


def worst_over_seeds(
    per_seed: dict[int, list[PositionRow]],
) -> dict[PositionKey, tuple[int, PositionRow]]:
    """Per (fixture, position): the worst seed and its row. Every seed's run covers the same
    positions; ties keep the first seed in ``per_seed``'s order."""
    worst: dict[PositionKey, tuple[int, PositionRow]] = {}
    for seed, rows in per_seed.items():
        for row in rows:
            key = (row.fixture, row.position)
            if key not in worst or _badness(row) > _badness(worst[key][1]):
                worst[key] = (seed, row)
    return worst


def margin_rows(
    per_seed: dict[int, list[PositionRow]],
    fp16: Iterable[PositionRow] = (),
    acc: Iterable[PositionRow] = (),
) -> list[MarginRow]:
    """`MarginRow` per position, in the first seed's order; ``fp16`` and ``acc``: the fp16
    and fp16-acc profiles' rows (a growth is NaN at a position they lack)."""
    worst = worst_over_seeds(per_seed)
    base = {(r.fixture, r.position): r.abs_dprob for r in fp16}
    base_acc = {(r.fixture, r.position): r.abs_dprob for r in acc}
    order = next(iter(per_seed.values()), [])
    rows = []
    for key in [(r.fixture, r.position) for r in order]:
        seed, row = worst[key]
        rows.append(
            MarginRow(row.fixture, row.position, row.margin, row.argmax_kept, seed,
                      row.abs_dprob, base.get(key, math.nan), base_acc.get(key, math.nan))
        )  # fmt: skip
    return rows


@dataclass
class DeviceMargin:
    """What the device-margin profile found, with the deviations and seeds behind it."""

    seeds: tuple[int, ...]
    deviations: tuple[Deviation, ...]
    rows: list[MarginRow]
    perturbed_ops: list[str] = field(default_factory=list)  # ops with an element moved
    op_counts: dict[str, int] = field(default_factory=dict)  # program ops per deviated type

    @property
    def flipped(self) -> list[MarginRow]:
        """Positions whose argmax flips under some seed."""
        return [r for r in self.rows if not r.argmax_kept]

    @property
    def agreement(self) -> float:
        """Share of positions whose argmax is kept under every seed (NaN for none)."""
        return 1 - len(self.flipped) / len(self.rows) if self.rows else math.nan

    @property
    def max_growth(self) -> MarginRow | None:
        """The position whose |dp| grew most over the fp16 profile's (None without rows)."""
        growing = [r for r in self.rows if not math.isnan(r.dprob_growth)]
        return max(growing, key=lambda r: r.dprob_growth, default=None)

    @property
    def max_deviation_growth(self) -> MarginRow | None:
        """The position whose |dp| grew most over fp16-acc's (None without fp16-acc rows)."""
        growing = [r for r in self.rows if not math.isnan(r.deviation_growth)]
        return max(growing, key=lambda r: r.deviation_growth, default=None)

    def summary(self) -> str:
        """One line: positions flipped, the largest |dp| growths, ops perturbed."""
        top, own = self.max_growth, self.max_deviation_growth
        growth = f"{top.dprob_growth:.3g} at {top.fixture}@{top.position}" if top else "n/a"
        if own is not None:
            growth += (
                f" (over fp16-acc, the deviations' own share: {own.deviation_growth:.3g} at "
                f"{own.fixture}@{own.position})"
            )
        counts = ", ".join(f"{n} {t}" for t, n in self.op_counts.items()) or "none"
        return (
            f"{len(self.flipped)}/{len(self.rows)} positions flipped (worst of seeds "
            f"{', '.join(map(str, self.seeds))}); max |dp| growth over fp16 {growth}; ops "
            f"perturbed {len(self.perturbed_ops)} of {counts} in the program"
        )

    def to_json(self) -> dict[str, Any]:
        """The ``device_margin`` section of a run in parity.json."""
        top, own = self.max_growth, self.max_deviation_growth
        return {
            "seeds": list(self.seeds),
            "perturbation": "each listed op's output element whose input is in the row's "
            "range gets +-bound, the sign drawn from (seed, crc32(op name)); worst seed per "
            "position",
            "deviations": [_deviation_json(d) for d in self.deviations],
            "op_counts": self.op_counts,
            "perturbed_ops": len(self.perturbed_ops),
            "positions_flipped": len(self.flipped),
            "argmax_agreement": json_number(self.agreement),
            "max_dprob_growth": json_number(top.dprob_growth) if top else None,
            "max_deviation_growth": json_number(own.deviation_growth) if own else None,
            "summary": self.summary(),
            "positions": [r.to_json() for r in self.rows],
        }


def _deviation_json(d: Deviation) -> dict[str, Any]:
    return {
        "op_type": d.op_type,
        "range": d.name,
        "bound": d.bound,
        "source": d.source,
        "evidence": d.evidence,
        "reading": d.reading,
    }


def program_op_counts(function: Any, deviations: Sequence[Deviation]) -> dict[str, int]:
    """How many ops of each deviated type ``function`` (a MIL function) holds."""
    types = dict.fromkeys(d.op_type for d in deviations)
    ops = function.operations
    return {t: sum(op.op_type == t for op in ops) for t in types}


def margin_gate(found: DeviceMargin, threshold: float) -> GateResult:
    """``device_margin_argmax_agreement`` on what the profile found."""
    flipped = [f"{r.fixture}@{r.position}" for r in found.flipped]
    return gate(IMPLEMENTATION, "device_margin_argmax_agreement").check(
        found.agreement,
        threshold,
        where=first_few(flipped),
        detail=f"{len(found.rows) - len(flipped)}/{len(found.rows)} real positions keep the "
        "argmax under every seed; " + found.summary().split("; ", 1)[1],
    )
