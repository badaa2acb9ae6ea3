"""Parity reports: JSON for machines, a text table for people."""

from __future__ import annotations

from typing import Any

from parity.gate import GateResult, json_number
from parity.result import ParityReport, rows_to_json
from parity.stream_report import stream_to_json, stream_to_text

SCHEMA_VERSION = 1


def report_to_json(report: ParityReport, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parity report as JSON-ready data (``parity.json``)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": report.passed,
        "first_diverging_layer": report.first_diverging_layer,
        "implementations": report.implementations,
        "gates": [g.to_json() for g in report.gates],
        "layers": [
            doc | {"fp16_overflow_margin": json_number(row.fp16_overflow_margin)}
            for doc, row in zip(rows_to_json(report.layers), report.layers, strict=True)
        ],
        "fixtures": rows_to_json(report.fixtures),
        **({"stream": stream_to_json(report.stream)} if report.stream else {}),
        **(extra or {}),
    }


def gate_line(g: GateResult) -> str:
    """One gate as parity.txt lists it: verdict, name, implementation, relation, notes."""
    mark = "PASS" if g.passed else "FAIL"
    where = f"(worst at {g.where})" if g.where else ""
    notes = " ".join(text for text in (g.detail, where) if text)
    return f"  {mark}  {g.name:<26} [{g.implementation}] {g.relation()}  {notes}"


def report_to_text(report: ParityReport) -> str:
    """A readable summary: gates, the first diverging layer, the per-layer table."""
    lines = ["Parity gates:"]
    lines += [gate_line(g) for g in report.gates]
    if report.first_diverging_layer is not None:
        lines.append(f"  first diverging layer: {report.first_diverging_layer}")
    lines.append("")
    lines.append("layer  fp32 rel err  fp16 rel err  fp16 max|h|  overflow margin")
    for row in report.layers:
        lines.append(
            f"{row.layer:>5}  {row.fp32_rel_error:>12.3g}  {row.fp16_rel_error:>12.3g}  "
            f"{row.fp16_max_abs:>11.1f}  {row.fp16_overflow_margin:>14.1f}x"
        )
    if report.stream is not None:
        lines += ["", stream_to_text(report.stream)]
    if not report.fixtures:
        return "\n".join(lines)  # an encoder report: its own fixture table follows
    lines.append("")
    lines.append("fixture                          slice        tokens  argmax  max|dp|  certified")
    for f in report.fixtures:
        lines.append(
            f"{f.name[:32]:<32} {f.slice:<12} {f.tokens:>6}  {f.fp16_argmax_agreement:>6.1%}  "
            f"{f.fp16_max_abs_dprob:>7.4f}  {f.certified_positions}/{f.tokens}"
        )
    return "\n".join(lines)
