"""The parity report files of an artifact: ``parity.json``, ``parity.txt``, ``parity.html``.

One document covers every level, each number labelled with the implementation that produced
it: the rewrite (torch fp32 and fp16 against the original), the conversion (the emitted
program in the MIL evaluator), the Core ML runtime (macOS only, otherwise marked not run).
"""

from __future__ import annotations

from typing import Any

from parity.conversion import ConversionReport
from parity.conversion_report import conversion_to_json
from parity.report import report_to_json
from parity.result import ParityReport

TORCH_LEVELS = [
    {"level": "rewrite", "implementation": name, "against": "reference", "status": "run",
     "gated": True}
    for name in ("torch-fp32", "torch-fp16")
]  # fmt: skip


def merge(report: ParityReport, conversion: ConversionReport) -> None:
    """Add the conversion level's gates and implementations to the torch report."""
    report.gates.extend(conversion.gates)
    report.implementations.update(conversion.implementations)


def parity_document(
    report: ParityReport,
    conversion: ConversionReport | None,
    extra: dict[str, Any],
    levels: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON document. ``levels`` lists the levels run instead of the conversion level (a
    cached decoder's cache level); without either, the conversion level says why it did not
    run (a torch gate failed, or it has not run yet)."""
    doc = report_to_json(report, extra)
    table: list[dict[str, Any]] = [dict(level) for level in TORCH_LEVELS]
    if conversion is not None:
        conv = conversion_to_json(conversion)
        table += conv.pop("levels")
        doc |= conv
    elif levels:
        table += levels
    else:
        status = (
            "not run yet: the torch levels passed, the program is converted next"
            if report.passed
            else "not run: a torch-level gate failed, nothing was converted"
        )
        table.append(
            {"level": "conversion", "implementation": "mil", "against": "-", "status": status,
             "gated": True}
        )  # fmt: skip
    doc["levels"] = table
    return doc
