"""The conversion and runtime levels' reports: JSON for ``parity.json``, text for
``parity.txt`` and the terminal. What `parity.conversion` measured, rendered; its gates are
rendered with the torch levels' (``parity.report``)."""

from __future__ import annotations

from typing import Any

from parity import runtime
from parity.conversion import MODULE_BASELINE, ConversionReport, ProfileRun
from parity.gate import json_number
from parity.metrics import slices
from parity.result import clean_json, rows_to_json


def conversion_to_json(report: ConversionReport) -> dict[str, Any]:
    """The conversion and runtime levels as JSON-ready data (inf spelt as a string)."""

    def run_doc(run: ProfileRun) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "implementation": run.implementation,
            "baseline": run.baseline,
            "description": run.description,
            "status": "run",
            "finite": run.finite,
            "layer_rel_error": [json_number(v) for v in run.layer_rel_error],
            "logits_rel_error": json_number(run.logits_rel_error),
        }
        if run.positions:
            doc["slices"] = {
                name: clean_json(vars(s))
                for name, s in slices(run.positions, report.length).items()
            }
            doc["positions"] = [
                row_doc | {"certified": row.certified}
                for row_doc, row in zip(rows_to_json(run.positions), run.positions, strict=True)
            ]
        return doc

    runtime_doc: dict[str, Any] = {
        "level": "runtime",
        "implementation": runtime.IMPLEMENTATION,
        "status": report.runtime.status,
    }
    if report.runtime.run is not None:
        runtime_doc |= run_doc(report.runtime.run) | {"status": report.runtime.status}
    levels = [
        {
            "level": "conversion",
            "implementation": run.implementation,
            "against": run.baseline,
            "status": "run",
            "gated": run.implementation in {g.implementation for g in report.gates},
        }
        for run in report.runs
    ]
    levels.append(
        {
            "level": "runtime",
            "implementation": runtime.IMPLEMENTATION,
            "against": "reference",
            "status": report.runtime.status,
            "gated": False,
        }
    )
    return {
        "levels": levels,
        "conversion": {
            "markers": report.markers,
            "runs": [{"level": "conversion"} | run_doc(run) for run in report.runs],
        },
        "runtime": runtime_doc,
    }


def conversion_to_text(report: ConversionReport) -> str:
    """A readable summary of the conversion and runtime levels."""
    lines = ["Conversion level (the emitted program, MIL evaluator):"]
    for run in report.runs:
        summary = run.summary()
        line = (
            f"  {run.implementation:<13} worst layer {max(run.layer_rel_error, default=0):.3g}"
            f"  logits {run.logits_rel_error:.3g}  finite {'yes' if run.finite else 'NO'}"
        )
        if summary.positions:
            line += (
                f"  argmax {summary.argmax_agreement:.1%}  max|dp| {summary.max_abs_dprob:.3g}"
                f"  max KL {summary.max_kl:.3g}  certified {summary.certified_share:.1%}"
            )
        against = "BC1L module (fp64)" if run.baseline == MODULE_BASELINE else run.baseline
        lines.append(line + f"  (against {against})")
        for name, s in slices(run.positions, report.length).items() if run.positions else []:
            if name != "all" and s.positions:
                lines.append(
                    f"      slice {name:<16} {s.positions:>4} positions  argmax "
                    f"{s.argmax_agreement:.1%}  max|dp| {s.max_abs_dprob:.3g}  certified "
                    f"{s.certified_share:.1%}"
                )
        if summary.uncertified:
            shown = ", ".join(summary.uncertified[:10])
            more = len(summary.uncertified) - 10
            lines.append(f"      uncertified: {shown}" + (f" and {more} more" if more > 0 else ""))
    lines.append(f"Runtime level (Core ML): {report.runtime.status}")
    names = [run.implementation for run in report.runs if run.layer_rel_error]
    if names:
        lines.append("")
        lines.append("layer  " + "  ".join(f"{n:>13}" for n in names))
        for i in range(len(report.runs[0].layer_rel_error)):
            cells = [
                f"{run.layer_rel_error[i]:>13.3g}" for run in report.runs if run.layer_rel_error
            ]
            lines.append(f"{i:>5}  " + "  ".join(cells))
    return "\n".join(lines)
