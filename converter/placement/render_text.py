"""The terminal report: per-op table, summary, breakers, agreement, floors, measurements.

Every section's heading names its evidence label and what that label promises.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from converter.evidence.labels import MEANING, Evidence
from converter.placement.inspect import Inspected
from converter.placement.provenance import is_stand_in, provenance_text
from converter.placement.report import PlacementReport, Summary, package_totals

_DEVICE_STYLE = {"NE": "green", "CPU": "red", "GPU": "yellow", "none": "dim", "unknown": "magenta"}


def fmt_flops(n: int | None) -> str:
    """FLOPs with an SI prefix ("1.2 G"), "?" when unknown."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return str(n)


def fmt_bytes(n: int | None) -> str:
    """Bytes with a binary prefix."""
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def fmt_share(x: float | None) -> str:
    """A share as a percentage with enough digits to tell 99.95 % from 100 %."""
    if x is None:
        return "n/a"
    return "100 %" if x == 1.0 else f"{100 * x:.2f} %"


def label(evidence: Evidence, extra: str | None = None) -> str:
    """``evidence: static (uncalibrated) - meaning``."""
    tail = f" ({extra})" if extra else ""
    return f"evidence: {evidence.value}{tail} - {MEANING[evidence]}"


def _shape(shape: list[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def op_table_view(report: PlacementReport) -> Table:
    """Every op with its device and the rule (or plan) that decided it."""
    static = report.evidence is Evidence.STATIC
    table = Table(title=f"ops ({report.evidence.value})", header_style="bold", show_lines=False)
    columns = ["#", "op", "name", "output", "dtype", "FLOPs", "weights", "device", "rule"]
    columns += ["conf.", "other chips"] if static else ["supported", "cost"]
    for c in columns:
        table.add_column(c, overflow="fold", no_wrap=c in ("#", "device"))
    for f in report.functions:
        if len(report.functions) > 1:
            table.add_section()
            table.add_row(Text(f"function {f.name}", style="bold"))
        for r in f.rows:
            extra = (
                [r.confidence or "", ", ".join(f"{c}: {d}" for c, d in r.other_chips.items())]
                if static
                else [
                    ", ".join(r.supported or []),
                    "" if r.cost_weight is None else f"{r.cost_weight:.3g}",
                ]
            )
            rule = r.rule + (f" (+{r.also})" if r.also else "")
            cells = [str(r.index), r.op_type, r.name, _shape(r.shape), r.dtype]
            cells += [fmt_flops(r.flops), fmt_bytes(r.weight_bytes)]
            table.add_row(
                *(Text(c) for c in cells),
                Text(r.device, style=_DEVICE_STYLE.get(r.device, "")),
                Text(rule),
                *(Text(c) for c in extra),
            )
    return table


def summary_lines(s: Summary) -> list[str]:
    """The summary of one function as lines."""
    return [
        f"ops on the NE:          {s.ops_ne} / {s.ops} ({fmt_share(s.share('ops'))})",
        f"FLOPs on the NE:        {fmt_flops(s.flops_ne)} / {fmt_flops(s.flops)} "
        f"({fmt_share(s.share('flops'))})",
        f"weight bytes on the NE: {fmt_bytes(s.weight_bytes_ne)} / {fmt_bytes(s.weight_bytes)} "
        f"({fmt_share(s.share('weight_bytes'))})",
        f"NE segments:            {s.ne_segments}; device transitions: {s.transitions} "
        "(along program order)",
        f"layers all on the NE:   {s.layers_all_ne} / {s.layers}"
        + (f"; ops per layer: {s.ops_per_layer:.1f}" if s.ops_per_layer is not None else ""),
        f"bytes crossing devices: {fmt_bytes(s.boundary_bytes)}; inputs read by the NE: "
        f"{fmt_bytes(s.input_bytes)}; outputs: {fmt_bytes(s.output_bytes)} (64-byte rows on "
        "the NE)",
        *(
            [f"state per call:         {fmt_bytes(s.state_read_bytes)} read (in the inputs), "
             f"{fmt_bytes(s.state_write_bytes)} written"]
            if s.state_read_bytes or s.state_write_bytes
            else []
        ),
    ]  # fmt: skip


def print_provenance(recorded: dict[str, Any], console: Console) -> None:
    """Where the evidence was recorded, or STAND-IN (in bold red) for a test fixture."""
    style = "bold red" if is_stand_in(recorded) else None
    console.print(Text(provenance_text(recorded), style=style or ""))


def print_placement(report: PlacementReport, console: Console, show_ops: bool) -> None:
    """One placement report: header, per-op table, summary, breakers."""
    extra = report.calibration if report.evidence is Evidence.STATIC else None
    console.print(Text(label(report.evidence, extra), style="bold"))
    where = f"chip {report.chip}, " if report.chip else ""
    console.print(Text(f"{where}compute units {report.compute_units}"))
    if report.source:
        print_provenance(report.source.get("recorded") or {}, console)
    for note in report.notes:
        console.print(Text(f"note: {note}"))
    if show_ops:
        console.print(op_table_view(report))
    for f in report.functions:
        console.print(Text(f"summary of function {f.name} ({report.evidence.value})", style="bold"))
        for line in summary_lines(f.summary):
            console.print(Text("  " + line))
        if not f.summary.breakers:
            console.print(Text("  no op breaks NE residency", style="green"))
        for r in f.summary.breakers:
            console.print(
                Text(
                    f"  breaks NE residency: #{r.index} {r.op_type} {r.name} -> {r.device} "
                    f"[{r.rule}, {r.confidence or report.evidence.value}]: {r.reason}",
                    style="red" if r.device != "none" else "dim",
                )
            )
            if r.fix:
                console.print(Text(f"      change: {r.fix}"))
    if report.evidence is Evidence.STATIC and report.chips:
        console.print(Text("per chip (static):", style="bold"))
        for name, c in report.chips.items():
            console.print(
                Text(
                    f"  {name:8} NE ops {fmt_share(c['ne_ops_share'])}, NE FLOPs "
                    f"{fmt_share(c['ne_flops_share'])}, NE segments {c['ne_segments']}, "
                    f"off-NE ops {c['off_ne_ops']}"
                )
            )
    if len(report.functions) > 1:
        t = package_totals(report)
        console.print(Text(f"package: NE FLOP share {fmt_share(t['flops_ne_share'])}"))


def print_agreement(a: dict[str, Any], console: Console) -> None:
    """Static vs compute-plan, op by op."""
    console.print(
        Text(
            f"agreement of {a['static_evidence']} (chip {a['chip']}) with {a['plan_evidence']} "
            f"({a['compute_units']}): {a['same_device']} / {a['compared_ops']} ops "
            f"({fmt_share(a['agreement'])}); NE vs not-NE {fmt_share(a['ne_agreement'])}",
            style="bold",
        )
    )
    for key, n in sorted(a["confusion"].items()):
        console.print(Text(f"  {key}: {n}"))
    for d in a["disagreements"][:50]:
        console.print(
            Text(
                f"  #{d['index']} {d['op_type']} {d['name']}: static {d['static']} "
                f"[{d['static_rule']}] vs plan {d['compute_plan']}"
            )
        )


def print_predicted(section: dict[str, Any], console: Console) -> None:
    """The cost model's floors per chip, labelled as a model."""
    console.print(Text(label(Evidence.PREDICTED), style="bold"))
    table = Table(title="predicted floor per call (a model, not a measurement)")
    columns = ("function", "chip", "floor ms", "range ms", "bound", "NE compute", "NE weights")
    for c in (*columns, "NE decode"):
        table.add_column(c)
    chips = section["chips"]
    decode_rated = {n for n, c in chips.items() if isinstance(c["decode_gweights"], dict)}
    for f in section["floors"]:
        comp = f["components_ms"]
        table.add_row(
            f["function"],
            f["chip"],
            f"{f['ms']:.2f}",
            f"{f['low_ms']:.2f} - {f['high_ms']:.2f}",
            f["bound"],
            f"{comp['ne_compute']:.2f}",
            f"{comp['ne_weights']:.2f}",
            # "-": no decode rate was measured on the chip, so it sets no bound there
            f"{comp['ne_decode']:.2f}" if f["chip"] in decode_rated else "-",
        )
    console.print(table)
    console.print(Text(f"formula: {section['formula']}", style="dim"))
    rates = ", ".join(f"{n} {chips[n]['decode_gweights']['value']:g}" for n in sorted(decode_rated))
    console.print(
        Text(
            f"weight-decode rates, G weights/s (sources in the JSON): {rates or 'none'}; "
            "no weight-decode bound on the other chips",
            style="dim",
        )
    )
    if "streamed" in section:
        from converter.placement.stream_rules import streamed_lines

        for line in streamed_lines(section["streamed"]):
            console.print(Text(line))


def print_observed(doc: dict[str, Any], console: Console) -> None:
    """A bench-device measurement."""
    console.print(Text(label(Evidence.OBSERVED), style="bold"))
    print_provenance(doc["recorded"], console)
    for unit, s in doc["latency"].items():
        console.print(
            Text(
                f"  {unit:11} median {s['median_ms']:.2f} ms (p10 {s['p10_ms']:.2f}, p90 "
                f"{s['p90_ms']:.2f}, {s['runs']} runs)"
            )
        )
    for unit, p in doc["power"].items():
        if p.get("available"):
            console.print(Text(f"  {unit:11} ANE power mean {p['mean_mw']:.0f} mW"))
    if doc.get("speedup"):
        s = doc["speedup"]
        console.print(
            Text(
                f"  {s['of']}: median ratio {s['median_ratio']:.2f}x, supported by the spread "
                f"{s['supported_ratio']:.2f}x"
            )
        )


def print_inspected(item: Inspected, console: Console, show_ops: bool = True) -> None:
    """The whole report for one package."""
    console.print(Text(f"\n{item.package}", style="bold underline"))
    console.print(Text(f"content sha256 {item.content_sha256}"))
    print_placement(item.static, console, show_ops)
    if item.compute_plan is not None:
        console.print()
        print_placement(item.compute_plan, console, show_ops)
    if item.agreement is not None:
        print_agreement(item.agreement, console)
    console.print()
    print_predicted(item.predicted, console)
    if item.observed is not None:
        print_observed(item.observed.to_json(), console)
