"""One MIL profile's run over every fixture (`ProfileRun`), and the device-margin profile's
runs - one per seed - combined into one (`device_margin_run`).

Apart from `parity.conversion`, which runs them, so the seed handling stays in one module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity.device_margin import (
    IMPLEMENTATION,
    DeviceMargin,
    margin_rows,
    program_op_counts,
    worst_over_seeds,
)
from parity.head_outputs import ChoiceCheck
from parity.metrics import PositionRow, Summary, summarize
from parity.mil import Evaluation, Evaluator, get_profile
from parity.mil.deviations import SEEDS
from parity.mil_fp32 import Fp32Check


@dataclass
class ProfileRun:
    """One implementation over every fixture: per-layer errors, logit rows, timing."""

    implementation: str
    baseline: str
    description: str
    layer_rel_error: list[float]  # worst over fixtures, real positions
    logits_rel_error: float  # worst over fixtures, real positions the program returns
    finite: bool  # every layer output and logit, padded positions included
    positions: list[PositionRow] = field(default_factory=list)  # against the reference only
    non_finite_values: list[str] = field(default_factory=list)  # any op's output, first seen
    seconds: float = 0.0  # time spent evaluating the program (all batches)
    choice: ChoiceCheck | None = None  # an argmax / top-k program: choice vs its own logits
    device_margin: DeviceMargin | None = None  # the device-margin profile's worst seeds
    fp32: Fp32Check | None = None  # the fp32 profile's check against the module in fp64

    def see(self, result: Evaluation, logits: np.ndarray, markers: list[str]) -> None:
        """Record the ops ``result`` saw non-finite, and whether its ``logits`` (its outputs
        joined) and layer markers (padded positions included) are finite."""
        seen = self.non_finite_values
        seen += [name for name in result.non_finite if name not in seen]
        self.finite &= bool(np.isfinite(logits).all())
        self.finite &= all(bool(np.isfinite(result.captured[m]).all()) for m in markers)

    def summary(self) -> Summary:
        """Aggregates over all compared positions."""
        return summarize(self.positions)


def device_margin_run(
    evaluator: Evaluator,
    measure: Callable[[int], ProfileRun],
    fp16: list[PositionRow],
    acc: list[PositionRow],
    seeds: tuple[int, ...] = SEEDS,
) -> ProfileRun:
    """The device-margin profile: ``measure`` (a run of ``evaluator`` over every batch) once
    per seed, combined into one run - every position's row from its worst seed, each layer's
    worst error, finite only if every seed was - with the `DeviceMargin` findings against the
    fp16 and fp16-acc profiles' rows ``fp16`` and ``acc`` (empty when they did not run)."""
    per_seed: dict[int, ProfileRun] = {}
    touched: set[str] = set()
    for seed in seeds:
        evaluator.reseed(seed)
        per_seed[seed] = measure(seed)
        touched |= evaluator.perturbation.ops if evaluator.perturbation else set()
    positions = {seed: run.positions for seed, run in per_seed.items()}
    worst = worst_over_seeds(positions)
    runs = list(per_seed.values())
    first = runs[0]
    seen: list[str] = []
    for run in runs:
        seen += [name for name in run.non_finite_values if name not in seen]
    deviations = evaluator.profile.deviations
    return ProfileRun(
        IMPLEMENTATION,
        first.baseline,
        f"{first.description}; seeds {', '.join(map(str, seeds))}, the worst per position",
        [max(errors) for errors in zip(*(r.layer_rel_error for r in runs), strict=True)],
        max(r.logits_rel_error for r in runs),
        all(r.finite for r in runs),
        positions=[worst[(row.fixture, row.position)][1] for row in first.positions],
        non_finite_values=seen,
        seconds=sum(r.seconds for r in runs),
        device_margin=DeviceMargin(
            seeds,
            deviations,
            margin_rows(positions, fp16, acc),
            sorted(touched),
            program_op_counts(evaluator.function, deviations),
        ),  # fmt: skip
    )


def evaluator_passes(profiles: tuple[str, ...] | list[str]) -> int:
    """How many times the MIL level runs the program over every batch for ``profiles`` (a
    profile with deviations runs once per seed): its progress steps per batch."""
    return sum(len(SEEDS) if get_profile(p).deviations else 1 for p in profiles)
