"""Plan gates: NE residency thresholds a recipe (or a CI job) can require.

``anec convert`` checks them on the static prediction for every chip of the recipe's
platform before publishing; ``anec plan-inspect --gate-...`` checks them on a recorded
compute plan when one is given, else on the static prediction. A result names the evidence
it was checked on (its implementation) and the chip (its ``where``). The gates themselves
are registered in `parity.gate_registry` (level ``plan``).
"""

from __future__ import annotations

from converter.placement.report import PlacementReport, package_totals
from parity.gate_registry import GateResult, gate


def check_plan_gates(
    report: PlacementReport,
    min_ne_flop_share: float | None = None,
    max_ne_segments: int | None = None,
) -> list[GateResult]:
    """The gates asked for, checked on one placement report (all functions together)."""
    totals = package_totals(report)
    label = report.evidence.value
    if report.calibration:
        label += f", {report.calibration}"
    chip = f"{report.chip}" if report.chip else ""
    gates = []
    if min_ne_flop_share is not None:
        share = totals["flops_ne_share"] if totals["flops_ne_share"] is not None else 0.0
        gates.append(
            gate("plan", "plan_min_ne_flop_share").check(
                share, min_ne_flop_share, implementation=label, where=chip
            )
        )
    if max_ne_segments is not None:
        # Per function: each function of a package is its own call.
        worst = max(report.functions, key=lambda f: f.summary.ne_segments, default=None)
        segments = worst.summary.ne_segments if worst is not None else 0
        where = chip
        if worst is not None and len(report.functions) > 1:
            where = f"{chip}, function {worst.name}" if chip else f"function {worst.name}"
        gates.append(
            gate("plan", "plan_max_ne_segments").check(
                segments, max_ne_segments, implementation=label, where=where
            )
        )
    return gates
