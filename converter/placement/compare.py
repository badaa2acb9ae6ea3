"""Two packages side by side (``plan-inspect --compare A B``), e.g. anec against its naive
baseline: live ops and transposes per layer, rank-5 tensors, ops predicted off the NE,
tensors whose last axis is shorter than one 64-byte row, NE shares and predicted floors.

Placement figures are ``static`` (uncalibrated); floors are ``predicted``. Counts of ops and
tensors are facts about the programs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from converter.evidence.labels import Evidence
from converter.placement.cost import MODEL_NOTE
from converter.placement.inspect import Inspected


@dataclass
class Metric:
    """One compared figure with the evidence it rests on ("program" for plain counts)."""

    name: str
    evidence: str
    a: float | int | str | None
    b: float | int | str | None


def program_facts(item: Inspected) -> dict[str, Any]:
    """Counts from the op table, over every function."""
    ops = [op for op in item.table.ops() if op.dispatchable]
    outputs = [t for op in ops for t in op.outputs]
    tiny = [t for t in outputs if t.short_last_axis]
    layers = max((f.summary.layers for f in item.static.functions), default=0)
    transposes = sum(op.op_type == "transpose" for op in ops)
    return {
        "layers": layers,
        "live_ops": len(ops),
        "live_ops_per_layer": len(ops) / layers if layers else None,
        "transposes": transposes,
        "transposes_per_layer": transposes / layers if layers else None,
        "rank5_tensors": sum(t.rank == 5 for t in outputs),
        "rank_over5_tensors": sum(t.rank > 5 for t in outputs),
        "tiny_last_axis_tensors": len(tiny),
        "tiny_last_axis_extra_bytes": sum((t.aligned_nbytes or 0) - (t.nbytes or 0) for t in tiny),
        "op_types": dict(Counter(op.op_type for op in ops).most_common()),
    }


def _static_facts(item: Inspected) -> dict[str, Any]:
    rows = [r for f in item.static.functions for r in f.rows]
    off = [r for r in rows if r.device not in ("NE", "none")]
    flops = sum(f.summary.flops for f in item.static.functions)
    flops_ne = sum(f.summary.flops_ne for f in item.static.functions)
    return {
        "off_ne_ops": len(off),
        "off_ne": ", ".join(f"{r.op_type} ({r.rule})" for r in off) or "none",
        "ne_flop_share": flops_ne / flops if flops else None,
        "ne_segments": sum(f.summary.ne_segments for f in item.static.functions),
    }


def compare(a: Inspected, b: Inspected) -> dict[str, Any]:
    """Every compared figure, with its evidence, for packages ``a`` and ``b``."""
    pa, pb = program_facts(a), program_facts(b)
    sa, sb = _static_facts(a), _static_facts(b)
    metrics = [
        Metric(k, "program", pa[k], pb[k])
        for k in (
            "layers",
            "live_ops",
            "live_ops_per_layer",
            "transposes",
            "transposes_per_layer",
            "rank5_tensors",
            "rank_over5_tensors",
            "tiny_last_axis_tensors",
            "tiny_last_axis_extra_bytes",
        )
    ]
    static_label = f"{Evidence.STATIC.value} ({a.static.calibration}, chip {a.static.chip})"
    metrics += [Metric(k, static_label, sa[k], sb[k]) for k in sa]
    floors_a = {(f["function"], f["chip"]): f for f in a.predicted["floors"]}
    floors_b = {(f["function"], f["chip"]): f for f in b.predicted["floors"]}
    for fa_key, fa in floors_a.items():
        fb = next((f for (fn, c), f in floors_b.items() if c == fa_key[1]), None)
        metrics.append(
            Metric(
                f"floor_ms {fa_key[1]}",
                Evidence.PREDICTED.value,
                round(fa["ms"], 3),
                round(fb["ms"], 3) if fb else None,
            )
        )
    return {
        "a": str(a.package),
        "b": str(b.package),
        "metrics": [m.__dict__ for m in metrics],
        "op_types": {"a": pa["op_types"], "b": pb["op_types"]},
        "predicted_note": MODEL_NOTE,
    }


def difference(m: dict[str, Any]) -> str:
    """``b - a`` (and the ratio) for numbers; empty otherwise."""
    a, b = m["a"], m["b"]
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return ""
    diff = b - a
    ratio = f", x{b / a:.2f}" if a else ""
    return f"{diff:+.4g}{ratio}"
