"""Static placement reports (evidence ``static``) from an op table, per chip."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from converter.evidence.labels import Evidence
from converter.placement.chips import CHIPS, STRICTEST, Chip, chip
from converter.placement.ops import Function, OpTable
from converter.placement.predict import Placement, predict_function
from converter.placement.report import FunctionReport, PlacementReport, Row, row_of, summarize
from converter.placement.rules import ComputeUnits, calibration_status


def _rows(function: Function, placements: list[Placement]) -> list[Row]:
    return [
        Row(
            **row_of(op),
            device=p.device,
            rule=p.rule.id,
            confidence=p.confidence,
            reason=p.reason,
            fix=p.fix,
            flags=p.flags,
            also=p.also.id if p.also is not None and p.also.id != p.rule.id else None,
        )
        for op, p in zip(function.ops, placements, strict=True)
    ]


def static_report(
    table: OpTable,
    package: str,
    content_sha256: str,
    chip_name: str = STRICTEST,
    compute_units: ComputeUnits = "CPU_AND_NE",
    other_chips: Iterable[Chip] | None = None,
) -> PlacementReport:
    """Predict every op of every function on ``chip_name``, and note where other chips differ.

    The report's rows are for ``chip_name``; each row's ``other_chips`` names the chips that
    would place the op elsewhere, and ``chips`` holds every chip's summary.
    """
    main_chip = chip(chip_name)
    others = list(other_chips) if other_chips is not None else list(CHIPS.values())
    chips = [main_chip, *[c for c in others if c.name != main_chip.name]]
    predicted = _predict(table, chips, compute_units)
    return _report(table, package, content_sha256, chips, compute_units, predicted)


def static_reports(
    table: OpTable,
    package: str,
    content_sha256: str,
    chips: Sequence[Chip],
    compute_units: ComputeUnits = "CPU_AND_NE",
) -> list[PlacementReport]:
    """`static_report` for each of ``chips`` in turn, the others as its ``other_chips``:
    every chip predicted once, not once per report (on SmolLM2 a second of `anec convert`)."""
    predicted = _predict(table, chips, compute_units)
    return [
        _report(
            table,
            package,
            content_sha256,
            [main, *[c for c in chips if c.name != main.name]],
            compute_units,
            predicted,
        )
        for main in chips
    ]


Predicted = dict[str, list[list[Placement]]]  # chip name -> per function, per op


def _predict(table: OpTable, chips: Sequence[Chip], compute_units: ComputeUnits) -> Predicted:
    return {c.name: [predict_function(f, c, compute_units) for f in table.functions] for c in chips}


def _report(
    table: OpTable,
    package: str,
    content_sha256: str,
    chips: list[Chip],
    compute_units: ComputeUnits,
    predicted: Predicted,
) -> PlacementReport:
    """The report whose rows are ``chips[0]``'s; ``predicted`` is only read (each report
    makes its own rows, whose ``other_chips`` it fills)."""
    main_chip = chips[0]
    rows = {
        c.name: [_rows(f, p) for f, p in zip(table.functions, predicted[c.name], strict=True)]
        for c in chips
    }
    functions: list[FunctionReport] = []
    for i, f in enumerate(table.functions):
        main_rows = rows[main_chip.name][i]
        for c in chips[1:]:
            for row, other in zip(main_rows, rows[c.name][i], strict=True):
                if other.device != row.device:
                    row.other_chips[c.name] = other.device
        functions.append(FunctionReport(f.name, main_rows, summarize(f, main_rows)))
    per_chip: dict[str, dict[str, object]] = {}
    for c in chips:
        summaries = [summarize(f, r) for f, r in zip(table.functions, rows[c.name], strict=True)]
        flops = sum(s.flops for s in summaries)
        ops = sum(s.ops for s in summaries)
        per_chip[c.name] = {
            "ne_ops_share": sum(s.ops_ne for s in summaries) / ops if ops else None,
            "ne_flops_share": sum(s.flops_ne for s in summaries) / flops if flops else None,
            "ne_segments": max((s.ne_segments for s in summaries), default=0),  # per function
            "transitions": sum(s.transitions for s in summaries),
            "off_ne_ops": sum(s.ops - s.ops_ne for s in summaries),
        }
    notes = []
    if compute_units == "ALL":
        notes.append(
            "compute units ALL: Core ML may place NE-capable regions on the GPU (R-CU); NE "
            "predictions are capped at medium confidence"
        )
    return PlacementReport(
        evidence=Evidence.STATIC,
        package=package,
        content_sha256=content_sha256,
        compute_units=compute_units,
        functions=functions,
        chip=main_chip.name,
        calibration=calibration_status(),
        chips=per_chip,
        notes=notes,
    )
