"""The HTML report: one self-contained file (inline CSS and SVG, no scripts, no network).

Per package: the evidence labels, a bar chart of FLOP share by device for each placement
report, a strip of the program's ops coloured by device (the NE segments), the summary,
the ops that break NE residency, the predicted floors, any measurement, and the per-op
table in a collapsible section.
"""

from __future__ import annotations

from html import escape
from typing import Any

from converter.evidence.labels import MEANING, Evidence
from converter.placement.inspect import Inspected
from converter.placement.provenance import is_stand_in, provenance_text
from converter.placement.render_text import fmt_bytes, fmt_flops, fmt_share, summary_lines
from converter.placement.report import PlacementReport

COLOURS = {"NE": "#2e9d5b", "CPU": "#d1453b", "GPU": "#e0a526", "unknown": "#9b59b6"}
_CSS = """
body{font-family:-apple-system,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:17px;margin-top:28px}h3{font-size:15px}
.badge{display:inline-block;padding:2px 8px;border-radius:10px;font-size:12px;color:#fff;
background:#555;margin-right:6px}.static{background:#2c6fbb}.compute-plan{background:#6a3d9a}
.predicted{background:#b15928}.observed{background:#33a02c}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.mono{font-family:Menlo,Consolas,monospace}.meaning{color:#555;font-size:13px}
pre{background:#f7f7f7;padding:8px;font-size:12px;white-space:pre-wrap}
.standin{color:#b00;border:2px solid #b00;padding:4px 8px}.provenance{color:#333}
"""


def _badge(evidence: Evidence, extra: str | None = None) -> str:
    text = evidence.value + (f" · {extra}" if extra else "")
    return (
        f'<span class="badge {evidence.value}">{escape(text)}</span>'
        f'<span class="meaning">{escape(MEANING[evidence])}</span>'
    )


def flop_share_chart(reports: list[PlacementReport], width: int = 640) -> str:
    """Horizontal stacked bars: share of FLOPs per device, one bar per placement report."""
    bar_h, gap, left = 22, 12, 190
    height = len(reports) * (bar_h + gap) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
        f'height="{height}" role="img" aria-label="FLOP share by device">'
    ]
    for i, report in enumerate(reports):
        y = 10 + i * (bar_h + gap)
        totals: dict[str, int] = {}
        for f in report.functions:
            for r in f.rows:
                if r.device != "none":
                    totals[r.device] = totals.get(r.device, 0) + (r.flops or 0)
        whole = sum(totals.values()) or 1
        title = f"{report.evidence.value}" + (f" ({report.chip})" if report.chip else "")
        parts.append(
            f'<text x="0" y="{y + 15}" font-size="12">{escape(title)}</text>'
            f'<rect x="{left}" y="{y}" width="{width}" height="{bar_h}" fill="#eee"/>'
        )
        x = float(left)
        for device in ("NE", "GPU", "CPU", "unknown"):
            share = totals.get(device, 0) / whole
            if share <= 0:
                continue
            w = share * width
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{max(w, 1.0):.2f}" height="{bar_h}" '
                f'fill="{COLOURS[device]}"><title>{device}: {fmt_share(share)} of FLOPs'
                f"</title></rect>"
            )
            if w > 60:
                parts.append(
                    f'<text x="{x + 4:.2f}" y="{y + 15}" font-size="12" fill="#fff">'
                    f"{device} {fmt_share(share)}</text>"
                )
            x += w
    legend_y = height - 8
    for j, (device, colour) in enumerate(COLOURS.items()):
        lx = left + j * 90
        parts.append(
            f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="{legend_y}" font-size="11">{device}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def segment_strip(report: PlacementReport, width: int = 900) -> str:
    """One strip per function: every dispatchable op in program order, coloured by device."""
    parts = []
    for f in report.functions:
        segs = f.summary.segments
        n = sum(s.ops for s in segs) or 1
        h = 26
        svg = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 2}" height="{h + 20}" '
            f'role="img" aria-label="device along the program">'
        ]
        x = 1.0
        for s in segs:
            w = s.ops / n * width
            # A lone off-NE op must stay visible on a strip of thousands of ops.
            shown = max(w, 1.0 if s.device == "NE" else 3.0)
            svg.append(
                f'<rect x="{x:.2f}" y="1" width="{shown:.2f}" height="{h}" '
                f'fill="{COLOURS.get(s.device, "#999")}"><title>{s.device}: ops #{s.first}-'
                f"#{s.last} ({s.ops} ops, {fmt_flops(s.flops)}FLOP)</title></rect>"
            )
            x += w
        svg.append(
            f'<text x="1" y="{h + 16}" font-size="11">op #0</text>'
            f'<text x="{width - 60}" y="{h + 16}" font-size="11">op #{n - 1}</text></svg>'
        )
        parts.append(
            f"<h3>function {escape(f.name)}: {f.summary.ne_segments} NE segment(s), "
            f"{f.summary.transitions} transition(s) ({escape(report.evidence.value)})</h3>"
            + "".join(svg)
        )
    return "".join(parts)


def _placement(report: PlacementReport) -> str:
    extra = report.calibration if report.evidence is Evidence.STATIC else None
    out = [
        f"<h2>Placement ({escape(report.evidence.value)})</h2><p>{_badge(report.evidence, extra)}"
        f"</p><p>{'chip ' + escape(report.chip) + ', ' if report.chip else ''}compute units "
        f"{escape(report.compute_units)}</p>"
    ]
    if report.source:
        out.append(_provenance(report.source.get("recorded") or {}))
    for note in report.notes:
        out.append(f"<p>note: {escape(note)}</p>")
    out.append(segment_strip(report))
    for f in report.functions:
        out.append(f"<pre>{escape(chr(10).join(summary_lines(f.summary)))}</pre>")
        if f.summary.breakers:
            rows = "".join(
                f"<tr><td>#{r.index}</td><td>{escape(r.op_type)}</td><td class=mono>"
                f"{escape(r.name)}</td><td>{escape(r.device)}</td><td>{escape(r.rule)}</td>"
                f"<td>{escape(r.reason)}</td><td>{escape(r.fix)}</td></tr>"
                for r in f.summary.breakers
            )
            out.append(
                "<h3>Ops that break NE residency</h3><table><tr><th>#</th><th>op</th>"
                "<th>name</th><th>device</th><th>rule</th><th>reason</th><th>what to change"
                f"</th></tr>{rows}</table>"
            )
        else:
            out.append("<p>No op breaks NE residency.</p>")
    if report.chips:
        rows = "".join(
            f"<tr><td>{escape(name)}</td><td>{fmt_share(c['ne_ops_share'])}</td>"
            f"<td>{fmt_share(c['ne_flops_share'])}</td><td>{c['ne_segments']}</td>"
            f"<td>{c['off_ne_ops']}</td></tr>"
            for name, c in report.chips.items()
        )
        out.append(
            "<h3>Per chip (static)</h3><table><tr><th>chip</th><th>NE ops</th><th>NE FLOPs</th>"
            f"<th>NE segments</th><th>off-NE ops</th></tr>{rows}</table>"
        )
    return "".join(out)


def _op_rows(report: PlacementReport) -> str:
    body = []
    for f in report.functions:
        for r in f.rows:
            colour = COLOURS.get(r.device, "#999")
            other = ", ".join(f"{c}: {d}" for c, d in r.other_chips.items())
            body.append(
                f"<tr><td>{escape(f.name)}</td><td>{r.index}</td><td>{escape(r.op_type)}</td>"
                f"<td class=mono>{escape(r.name)}</td><td>{escape(str(tuple(r.shape)))}</td>"
                f"<td>{escape(r.dtype)}</td><td>{fmt_flops(r.flops)}</td>"
                f"<td>{fmt_bytes(r.weight_bytes)}</td>"
                f'<td style="color:{colour}">{escape(r.device)}</td><td>{escape(r.rule)}</td>'
                f"<td>{escape(r.confidence or '')}</td><td>{escape(other)}</td></tr>"
            )
    return (
        f"<details><summary>All {sum(len(f.rows) for f in report.functions)} ops "
        f"({escape(report.evidence.value)})</summary><table><tr><th>function</th><th>#</th>"
        "<th>op</th><th>name</th><th>output</th><th>dtype</th><th>FLOPs</th><th>weights</th>"
        "<th>device</th><th>rule</th><th>conf.</th><th>other chips</th></tr>"
        + "".join(body)
        + "</table></details>"
    )


def _floor_row(f: dict[str, Any], decode_rated: bool) -> str:
    """One floor; the weight-decode term only where the chip has a measured rate."""
    decode = f"{f['components_ms']['ne_decode']:.2f}" if decode_rated else "- (no rate)"
    return (
        f"<tr><td>{escape(f['function'])}</td><td>{escape(f['chip'])}</td><td>{f['ms']:.2f}</td>"
        f"<td>{f['low_ms']:.2f} – {f['high_ms']:.2f}</td><td>{escape(f['bound'])}</td>"
        f"<td>{decode}</td></tr>"
    )


def _predicted(section: dict[str, Any]) -> str:
    rated = {n for n, c in section["chips"].items() if isinstance(c["decode_gweights"], dict)}
    rows = "".join(_floor_row(f, f["chip"] in rated) for f in section["floors"])
    return (
        f"<h2>Predicted floor per call</h2><p>{_badge(Evidence.PREDICTED)}</p>"
        f"<p><b>{escape(section['note'])}</b></p><table><tr><th>function</th><th>chip</th>"
        f"<th>floor ms</th><th>range ms</th><th>bound</th><th>NE weight-decode ms</th></tr>"
        f"{rows}</table><p class=meaning>{escape(section['formula'])}</p>"
    )


def _provenance(recorded: dict[str, Any]) -> str:
    """Where the evidence was recorded, or a STAND-IN warning for a test fixture."""
    text = escape(provenance_text(recorded))
    if is_stand_in(recorded):
        return f'<p class="standin"><strong>{text}</strong></p>'
    return f'<p class="provenance">{text}</p>'


def _observed(doc: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{escape(u)}</td><td>{s['median_ms']:.2f}</td><td>{s['p10_ms']:.2f} – "
        f"{s['p90_ms']:.2f}</td><td>{s['runs']}</td></tr>"
        for u, s in doc["latency"].items()
    )
    return (
        f"<h2>Measured</h2><p>{_badge(Evidence.OBSERVED)}</p>{_provenance(doc['recorded'])}"
        "<table><tr><th>compute units</th>"
        f"<th>median ms</th><th>p10 – p90 ms</th><th>runs</th></tr>{rows}</table>"
    )


def render_html(items: list[Inspected], comparison: dict[str, Any] | None = None) -> str:
    """The whole report as one HTML document."""
    body = ["<h1>anec plan-inspect</h1>"]
    for item in items:
        reports = [item.static] + ([item.compute_plan] if item.compute_plan else [])
        body.append(
            f"<h2 class=mono>{escape(str(item.package))}</h2><p class=mono>content sha256 "
            f"{escape(item.content_sha256)}</p><h3>FLOP share by device</h3>"
            + flop_share_chart(reports)
        )
        for report in reports:
            body.append(_placement(report))
        if item.agreement:
            a = item.agreement
            body.append(
                f"<h2>Agreement</h2><p>{escape(a['static_evidence'])} vs "
                f"{escape(a['plan_evidence'])}: {a['same_device']} / {a['compared_ops']} ops "
                f"({fmt_share(a['agreement'])})</p>"
            )
        body.append(_predicted(item.predicted))
        if item.observed:
            body.append(_observed(item.observed.to_json()))
        for report in reports:
            body.append(_op_rows(report))
    if comparison:
        body.append(comparison_html(comparison))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>anec plan-inspect</title><style>{_CSS}</style></head><body>"
        + "".join(body)
        + "</body></html>\n"
    )


def comparison_html(comparison: dict[str, Any]) -> str:
    """The side-by-side table of ``compare.compare``."""
    from converter.placement.compare import difference

    rows = "".join(
        f"<tr><td>{escape(m['name'])}</td><td>{escape(m['evidence'])}</td>"
        f"<td>{escape(_fmt(m['a']))}</td><td>{escape(_fmt(m['b']))}</td>"
        f"<td>{escape(difference(m))}</td></tr>"
        for m in comparison["metrics"]
    )
    return (
        f"<h2>Side by side</h2><p class=mono>A = {escape(comparison['a'])}<br>B = "
        f"{escape(comparison['b'])}</p><table><tr><th>figure</th><th>evidence</th><th>A</th>"
        f"<th>B</th><th>B − A</th></tr>{rows}</table>"
        f"<p class=meaning>{escape(comparison['predicted_note'])}</p>"
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
