"""Compute-plan placement reports and their op-by-op agreement with the static prediction.

A compute-plan op is matched to a row of the op table by its first output name (names
survive compilation); FLOPs and weight bytes come from the op table, the device from
MLComputePlan's *preferred* device (not from "supported": docs/placement-rules.md 1.3).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from converter.evidence.labels import Evidence
from converter.placement.computeplan import PlanOp
from converter.placement.dump import RecordedPlan
from converter.placement.ops import OpTable
from converter.placement.provenance import provenance_json
from converter.placement.report import FunctionReport, PlacementReport, Row, row_of, summarize

NO_USAGE = "unknown"  # Core ML returned no device usage for the op


def _fix_for(static_row: Row | None, device: str) -> str:
    if device == "NE":
        return ""
    if static_row is not None and static_row.device == device and static_row.fix:
        return f"static rule {static_row.rule} suggests: {static_row.fix}"
    return (
        "no static rule predicts this; read Core ML's reason in the unified log "
        "(log stream --predicate 'subsystem == \"com.apple.espresso\"') while compiling"
    )


def compute_plan_report(
    table: OpTable,
    package: str,
    recorded: RecordedPlan,
    compute_units: str,
    static: PlacementReport | None = None,
) -> PlacementReport:
    """The placement of every op of ``table`` as recorded in a compute plan."""
    if compute_units not in recorded.plans:
        from converter.errors import InputError

        raise InputError(
            f"the dump has no plan for compute units {compute_units}; it has "
            f"{sorted(recorded.plans)}"
        )
    plans = recorded.plans[compute_units]
    static_rows = {
        (f.name, r.index): r for f in (static.functions if static else []) for r in f.rows
    }
    functions: list[FunctionReport] = []
    notes: list[str] = []
    for f in table.functions:
        ops = plans.get(f.name)
        if ops is None:
            notes.append(f"function {f.name}: not in the recorded plan")
            continue
        by_output: dict[str, PlanOp] = {}
        for planned in ops:
            for out in planned.outputs:
                by_output.setdefault(out, planned)
        rows: list[Row] = []
        matched: set[int] = set()
        for op in f.ops:
            p = by_output.get(op.outputs[0].name) if op.outputs else None
            if p is None:
                device, reason, supported, weight = NO_USAGE, "not in the compute plan", [], None
            else:
                matched.add(p.index)
                # Constexprs are folded into their consumers: never a device of their own.
                device = p.preferred or NO_USAGE if op.dispatchable else "none"
                supported, weight = p.supported, p.cost_weight
                shown = ", ".join(supported) or "none"
                reason = (
                    f"MLComputePlan preferred {p.preferred or 'undetermined'} (supported: {shown})"
                )
            rows.append(
                Row(
                    **row_of(op),
                    device=device,
                    rule="compute-plan",
                    confidence=None,
                    reason=reason,
                    fix=_fix_for(static_rows.get((f.name, op.index)), device),
                    supported=supported,
                    cost_weight=weight,
                )
            )
        unmatched = [u for u in ops if u.index not in matched and u.op_type != "const"]
        if unmatched:
            kinds = Counter(u.op_type for u in unmatched)
            notes.append(
                f"function {f.name}: {len(unmatched)} planned op(s) not in the saved program: "
                + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
            )
        functions.append(FunctionReport(f.name, rows, summarize(f, rows)))
    return PlacementReport(
        evidence=Evidence.COMPUTE_PLAN,
        package=package,
        content_sha256=recorded.content_sha256,
        compute_units=compute_units,
        functions=functions,
        source={
            "recorded": recorded.recorded,
            "package": recorded.package,
            **provenance_json(recorded.recorded),
        },
        notes=notes,
    )


def agreement(static: PlacementReport, plan: PlacementReport) -> dict[str, Any]:
    """Op-by-op agreement of a static prediction with a compute plan (dispatchable ops only).

    Returns the share of ops whose device matched, the NE / not-NE agreement, a confusion
    count ``static device -> plan device`` and every disagreement with the static rule.
    """
    assert static.evidence is Evidence.STATIC and plan.evidence is Evidence.COMPUTE_PLAN
    plan_rows = {(f.name, r.index): r for f in plan.functions for r in f.rows}
    confusion: Counter[str] = Counter()
    by_rule: Counter[str] = Counter()
    disagreements: list[dict[str, Any]] = []
    compared = same = same_ne = 0
    for f in static.functions:
        for s in f.rows:
            p = plan_rows.get((f.name, s.index))
            if p is None or s.device == "none" or p.device in ("none", NO_USAGE):
                continue
            compared += 1
            confusion[f"{s.device}->{p.device}"] += 1
            same += s.device == p.device
            same_ne += (s.device == "NE") == (p.device == "NE")
            if s.device != p.device:
                by_rule[s.rule] += 1
                disagreements.append(
                    {
                        "function": f.name,
                        "index": s.index,
                        "op_type": s.op_type,
                        "name": s.name,
                        "static": s.device,
                        "static_rule": s.rule,
                        "compute_plan": p.device,
                    }
                )
    return {
        "static_evidence": static.evidence.value,
        "plan_evidence": plan.evidence.value,
        "chip": static.chip,
        "compute_units": plan.compute_units,
        "compared_ops": compared,
        "same_device": same,
        "agreement": same / compared if compared else None,
        "ne_agreement": same_ne / compared if compared else None,
        "confusion": dict(confusion),
        "disagreements_by_rule": dict(by_rule),
        "disagreements": disagreements,
        "note": "compare the dump's chip with the static chip; to calibrate, review the "
        "disagreements, fix the rules, and record the dump in rules.CALIBRATIONS",
    }
