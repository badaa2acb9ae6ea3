"""The HTML parity report (``parity.html``): self-contained, inline SVG, built from the same
document as ``parity.json`` so a report can be rendered again from the JSON alone."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from parity.report import RANGE_SERIES
from parity.svg import layer_chart, margin_chart

# The gates whose thresholds the per-layer chart draws (parity.gate's names).
PER_LAYER_GATES = ("fp32_layer_rel_error", "mil_fp32_layer_rel_error")

_STYLE = """
body { font-family: -apple-system, Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 20px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.pass { color: #18752a; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.note { color: #555; font-size: 13px; max-width: 60em; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) or (isinstance(value, str) and value in ("inf", "nan")):
        v = float(value)
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(value, list):
        return ", ".join(escape(str(v)) for v in value) if value else "-"
    return escape(str(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _verdict(passed: bool) -> str:
    return '<span class="pass">PASS</span>' if passed else '<span class="fail">FAIL</span>'


def _layer_series(doc: dict[str, Any]) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {}
    layers = doc.get("layers", [])
    if layers:
        series["torch-fp32 vs reference"] = [float(r["fp32_rel_error"]) for r in layers]
        series["torch-fp16 vs reference"] = [float(r["fp16_rel_error"]) for r in layers]
    for run in doc.get("conversion", {}).get("runs", []):
        if run.get("layer_rel_error"):
            label = f"{run['implementation']} vs " + (
                "BC1L module (fp64)" if run["baseline"] != "reference" else "reference"
            )
            series[label] = [float(v) for v in run["layer_rel_error"]]
    return series


def _stream_section(stream: dict[str, Any]) -> list[str]:
    series = {
        label: [float(row[key]) for row in stream["layers"]] for key, label in RANGE_SERIES.items()
    }
    branches = ", ".join(f"{b['scale']:g} at {b['where']}" for b in stream["branch_scales"])
    return [
        "<h2>Residual stream range</h2>",
        f"<p class='note'>{escape(stream['measured_on'])}. Stream scale "
        f"s = {stream['scale']:g}; branch scales: {escape(branches or 'none')}; scaled weights "
        f"pushed into fp16 subnormals: {stream['weights_to_fp16_subnormal']}, to zero: "
        f"{stream['weights_to_fp16_zero']}.</p>",
        layer_chart(
            series,
            {"fp16 max": float(stream["fp16_max"]), "scaling limit": float(stream["limit"])},
            "largest |value| per layer",
            floor=1e-3,
            y_label="max |value|",
        ),
    ]


def report_to_html(doc: dict[str, Any], title: str = "anec parity report") -> str:
    """The whole report as one HTML page."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>Verdict: {_verdict(bool(doc.get('passed')))}"
        + (f" &middot; recipe <code>{escape(str(doc['recipe']))}</code>" if "recipe" in doc else "")
        + "</p>",
    ]
    parts += _levels_section(doc.get("levels", []))
    parts += _gates_section(doc.get("gates", []))
    series = _layer_series(doc)
    parts += _layer_chart_section(series, doc.get("gates", []))
    if "stream" in doc:
        parts += _stream_section(doc["stream"])
    runs = [
        run
        for run in [*doc.get("conversion", {}).get("runs", []), doc.get("runtime", {})]
        if run.get("positions")
    ]
    parts += _runs_sections(runs)
    parts += _layer_table_section(series)
    implementations = doc.get("implementations", {})
    if implementations:
        parts.append("<h2>Implementations</h2>")
        rows = [[_fmt(k), _fmt(v)] for k, v in implementations.items()]
        parts.append(_table(["name", "what it is"], rows))
    parts.append("</body></html>")
    return "\n".join(parts)


def _levels_section(levels: list[dict[str, Any]]) -> list[str]:
    if not levels:
        return []
    rows = [
        [_fmt(lv["level"]), _fmt(lv["implementation"]), _fmt(lv.get("against", "-"))]
        + [_fmt(lv["status"])]
        for lv in levels
    ]
    return ["<h2>Levels</h2>", _table(["level", "implementation", "compared with", "status"], rows)]


def _gates_section(gates: list[dict[str, Any]]) -> list[str]:
    rows = [
        [
            _verdict(g["passed"]),
            f"<span title='{escape(g.get('meaning', ''), quote=True)}'>{_fmt(g['name'])}</span>",
            _fmt(g["implementation"]),
            _fmt(g["value"]),
            escape(g["comparison"]),
            _fmt(g["threshold"]),
            _fmt(g.get("where", "")),
            _fmt(g.get("detail", "")),
        ]
        for g in gates
    ]
    header = ["", "gate", "implementation", "value", "", "threshold", "worst at", "detail"]
    return ["<h2>Gates</h2>", _table(header, rows)]


def _layer_chart_section(series: dict[str, list[float]], gates: list[dict[str, Any]]) -> list[str]:
    if not series:
        return []
    thresholds = {
        g["implementation"] + " gate": float(g["threshold"])
        for g in gates
        if g["name"] in PER_LAYER_GATES
    }
    return [
        "<h2>Per-layer relative error</h2>",
        "<p class='note'>||h' - h|| / ||h|| at real positions, worst over fixtures. "
        "Hollow points are clamped to the axis (0, inf or NaN).</p>",
        layer_chart(series, thresholds, "per-layer relative error"),
    ]


# The slice table's figures: header -> `parity.metrics.Summary` field.
_SLICE_COLUMNS = {
    "argmax agreement": "argmax_agreement",
    "max |dp|": "max_abs_dprob",
    "max KL": "max_kl",
    "mean KL": "mean_kl",
    "top-k overlap": "mean_topk_overlap",
    "max logit error": "max_logit_error",
    "certified": "certified_share",
}


def _runs_sections(runs: list[dict[str, Any]]) -> list[str]:
    """The margin chart and the slice table of the runs compared per position."""
    if not runs:
        return []
    parts = [
        "<h2>Logit error against margin</h2>",
        "<p class='note'>Each point is one real position: the largest logit error delta "
        "against the reference margin top1 - top2. Below the dashed line (margin > 2 delta) "
        "the argmax is proven kept.</p>",
    ]
    points = {
        run["implementation"]: [
            (float(p["margin"]), float(p["logit_error"])) for p in run["positions"]
        ]
        for run in runs
    }
    parts.append(margin_chart(points, "logit error against margin"))
    parts.append("<h2>Slices</h2>")
    header = ["implementation", "slice", "positions", *_SLICE_COLUMNS, "uncertified positions"]
    rows = []
    for run in runs:
        for name, s in run.get("slices", {}).items():
            cells = [_fmt(s[k]) if s["positions"] else "-" for k in _SLICE_COLUMNS.values()]
            rows.append(
                [_fmt(run["implementation"]), _fmt(name), _fmt(s["positions"])]
                + cells
                + [_fmt(s["uncertified"])]
            )
    parts.append(_table(header, rows))
    return parts


def _layer_table_section(series: dict[str, list[float]]) -> list[str]:
    if not series:
        return []
    names = list(series)
    n = max(len(v) for v in series.values())
    rows = [
        [str(i)] + [_fmt(series[k][i]) if i < len(series[k]) else "-" for k in names]
        for i in range(n)
    ]
    return ["<h2>Per-layer table</h2>", _table(["layer", *names], rows)]
