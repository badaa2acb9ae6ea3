"""Plan gates: NE residency thresholds a recipe (or a CI job) can require.

``anec convert`` checks them on the static prediction for every chip of the recipe's
platform before publishing; ``anec plan-inspect --gate-...`` checks them on a recorded
compute plan when one is given, else on the static prediction. A gate names the evidence it
was checked on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from converter.plan.report import PlacementReport, package_totals


@dataclass(frozen=True)
class PlanGate:
    """One checked plan gate."""

    name: str
    evidence: str
    chip: str | None
    value: float
    comparison: str  # ">=" or "<="
    threshold: float
    passed: bool

    def text(self) -> str:
        """One line: name, where, value, threshold, verdict."""
        where = f" on {self.chip}" if self.chip else ""
        verdict = "pass" if self.passed else "FAIL"
        return (
            f"{self.name} ({self.evidence}{where}): {self.value:.6g} {self.comparison} "
            f"{self.threshold:.6g}: {verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def check_plan_gates(
    report: PlacementReport,
    min_ne_flop_share: float | None = None,
    max_ne_segments: int | None = None,
) -> list[PlanGate]:
    """The gates asked for, checked on one placement report (all functions together)."""
    totals = package_totals(report)
    label = report.evidence.value
    if report.calibration:
        label += f", {report.calibration}"
    gates = []
    if min_ne_flop_share is not None:
        share = totals["flops_ne_share"] if totals["flops_ne_share"] is not None else 0.0
        gates.append(
            PlanGate(
                "NE FLOP share",
                label,
                report.chip,
                share,
                ">=",
                min_ne_flop_share,
                share >= min_ne_flop_share,
            )
        )
    if max_ne_segments is not None:
        # Per function: each function of a package is its own call.
        segments = max((f.summary.ne_segments for f in report.functions), default=0)
        gates.append(
            PlanGate(
                "NE segments per function",
                label,
                report.chip,
                segments,
                "<=",
                max_ne_segments,
                segments <= max_ne_segments,
            )
        )
    return gates
