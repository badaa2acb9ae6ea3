"""The one-screen summary printed after a conversion, as a table or as JSON."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from converter.pipeline.run import ConvertResult


def result_to_json(result: ConvertResult) -> dict[str, Any]:
    """A JSON summary of one conversion (the full figures are in parity.json)."""
    gates: dict[str, dict[str, Any]] = {}
    for g in result.parity.gates:
        # Later levels reuse gate names (argmax agreement at torch-fp16 and mil-fp16): the
        # first keeps the plain name, the others are qualified by their implementation.
        key = g.name if g.name not in gates else f"{g.name} [{g.implementation}]"
        gates[key] = {
            "value": g.value,
            "threshold": g.threshold,
            "passed": g.passed,
            "where": g.where,
        }
    return {
        "name": result.name,
        "passed": result.passed,
        "artifact": str(result.artifact_dir) if result.artifact_dir else None,
        "reports": str(result.report_dir),
        "first_diverging_layer": result.parity.first_diverging_layer,
        "gates": gates,
        "live_ops": result.live_ops,
        "live_ops_per_layer": round(result.live_ops_per_layer, 1),
        "notes": result.notes,
        "timings_s": {k: round(v, 2) for k, v in result.timings.items()},
        "variants": [v.to_json() for v in result.variants],
    }


def failed_gate(result: ConvertResult) -> str | None:
    """The kind of gate that failed: the one that blocked the artifact ("parity", "MIL-level",
    "plan"), else "variant" (a compressed variant's); None when every gate passed."""
    if not result.passed:
        return result.failed_gate or "a"
    if any(not v.passed for v in result.variants):
        return "variant"
    return None


def print_summary(result: ConvertResult, console: Console) -> None:
    """Gates, where the artifact and its reports are, and how long each step took."""
    # The main artifact's verdict; each variant's is printed below with it.
    status = (
        "[green]converted[/]" if result.passed else f"[red]{failed_gate(result)} gate failed[/]"
    )
    console.print(f"\n[bold]{result.name}[/]: {status}")
    table = Table(show_header=True, header_style="bold")
    for column in ("gate", "implementation", "value", "threshold", ""):
        table.add_column(column, no_wrap=column == "gate")
    for g in result.parity.gates:
        table.add_row(
            g.name,
            g.implementation,
            f"{g.value:.3g}",
            f"{g.comparison} {g.threshold:.3g}",
            "[green]pass[/]" if g.passed else "[red]FAIL[/]",
        )
    console.print(table)
    for g in result.parity.gates:
        if not g.passed and g.where:
            console.print(Text(f"{g.name} [{g.implementation}]: worst at {g.where}", style="red"))
    if result.parity.first_diverging_layer is not None:
        console.print(f"first diverging layer: {result.parity.first_diverging_layer}")
    # NaN where no fp16 level measured |h| (the torch-fp16 level runs on demand).
    measured = [row for row in result.parity.layers if math.isfinite(row.fp16_max_abs)]
    if measured:
        worst = max(measured, key=lambda row: row.fp16_max_abs)
        console.print(
            f"largest fp16 |h|: {worst.fp16_max_abs:.0f} at layer {worst.layer} "
            f"(overflow margin {worst.fp16_overflow_margin:.1f}x)"
        )
    elif result.parity.layers:
        console.print("largest fp16 |h|: not measured (no fp16 level recorded it in this run)")
    if result.artifact_dir:
        console.print(f"artifact: {result.artifact_dir}")
        console.print(
            f"  program: {result.live_ops} live ops ({result.live_ops_per_layer:.1f} per layer)"
        )
    console.print(
        f"reports:  {result.report_dir / 'parity.json'}, {result.report_dir / 'parity.txt'}"
    )
    for note in result.notes:
        console.print(Text(note, style="red" if not result.passed else ""))
    times = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    console.print(f"time:     {times}", style="dim")
    for v in result.variants:  # compressed variants: each its own artifact and verdict
        mark = "[green]published[/]" if v.passed else "[red]variant gate failed[/]"
        ratio = f"{v.size.compressed_ratio:.3f}x weights" if v.size else ""
        console.print(f"variant {v.name}: {mark} {ratio} -> {v.directory}")
