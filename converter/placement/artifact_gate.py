"""The plan step of ``anec convert``: a static placement report in every artifact, and the
recipe's plan gates checked on it before publishing.

The report covers every chip of the recipe's platform (macOS: the M chips; iOS: the A
chips); a gate must hold on each of them. ``plan.json`` and ``plan.txt`` go into the staged
artifact, so they are published with it or kept in ``OUT/<name>.failed/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.evidence.labels import MEANING, Evidence
from converter.placement.chips import chips_for
from converter.placement.ops import OpTable, op_table
from converter.placement.render_text import summary_lines
from converter.placement.residency import check_plan_gates
from converter.placement.static import static_reports
from parity.gate_registry import Gated, GateResult

PLAN_JSON = "plan.json"
PLAN_TXT = "plan.txt"


@dataclass
class ArtifactPlan(Gated):
    """The plan step's outcome."""

    gates: list[GateResult]
    lines: list[str]  # plan.txt

    def failures(self) -> list[str]:
        """One line per failed gate."""
        return [g.text() for g in self.gates if not g.passed]


def plan_artifact(
    program: Any,
    package: Path,
    content_sha256: str,
    platform: str,
    min_ne_flop_share: float | None,
    max_ne_segments: int | None,
    stage_dir: Path,
) -> ArtifactPlan:
    """Predict placement of ``program`` (the package's MIL program, or its `OpTable` made
    beforehand), check the plan gates on every chip of ``platform`` and write plan.json /
    plan.txt into ``stage_dir``."""
    from converter.pipeline.publish import write_json_atomic, write_text_atomic

    table = program if isinstance(program, OpTable) else op_table(program)
    chips = chips_for(platform)
    reports = static_reports(table, package.name, content_sha256, chips)
    gates = [g for r in reports for g in check_plan_gates(r, min_ne_flop_share, max_ne_segments)]
    first = reports[0]
    doc = first.to_json()
    for f in doc["functions"]:
        f.pop("rows")  # every op's row: `anec plan-inspect` prints them; breakers stay
    doc["meaning"] = MEANING[Evidence.STATIC]
    doc["gates"] = [g.to_json() for g in gates]
    write_json_atomic(stage_dir / PLAN_JSON, doc)

    lines = [
        f"evidence: {first.evidence.value} ({first.calibration}) - {MEANING[Evidence.STATIC]}",
        f"package {package.name}, content sha256 {content_sha256}",
        f"rows for chip {first.chip}, compute units {first.compute_units}; run `anec plan-inspect` "
        "for every op",
    ]
    for f in first.functions:
        lines.append(f"function {f.name}:")
        lines += ["  " + line for line in summary_lines(f.summary)]
        for r in f.summary.breakers:
            lines.append(
                f"  breaks NE residency: #{r.index} {r.op_type} {r.name} -> {r.device} "
                f"[{r.rule}, {r.confidence}]: {r.reason}; change: {r.fix}"
            )
    for name, c in first.chips.items():
        lines.append(
            f"{name}: NE FLOP share {c['ne_flops_share']}, NE segments {c['ne_segments']}, "
            f"off-NE ops {c['off_ne_ops']}"
        )
    lines += [g.text() for g in gates] or ["no plan gates in the recipe"]
    write_text_atomic(stage_dir / PLAN_TXT, "\n".join(lines) + "\n")
    return ArtifactPlan(gates, lines)
