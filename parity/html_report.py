"""The HTML parity report (``parity.html``): self-contained, inline SVG, built from the same
document as ``parity.json`` so a report can be rendered again from the JSON alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from parity.report import RANGE_SERIES

# The gates whose thresholds the per-layer chart draws (parity.gate_registry's names).
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
        fp16 = [float(r["fp16_rel_error"]) for r in layers]
        if not all(math.isnan(v) for v in fp16):  # NaN: the level ran on demand only
            series["torch-fp16 vs reference"] = fp16
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
    parts += _device_margin_sections(doc.get("conversion", {}).get("runs", []))
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
    if "against_original" in levels[0]:
        return _variant_levels_section(levels)
    rows = [
        [_fmt(lv["level"]), _fmt(lv["implementation"]), _fmt(lv.get("against", "-"))]
        + [_fmt(lv["status"])]
        for lv in levels
    ]
    return ["<h2>Levels</h2>", _table(["level", "implementation", "compared with", "status"], rows)]


def _variant_levels_section(levels: list[dict[str, Any]]) -> list[str]:
    """A compressed variant's levels (`parity.variant`): each run's figures against the
    original checkpoint and against the fp16 artifact."""

    def figures(measured: dict[str, Any]) -> str:
        return "<br>".join(f"{escape(k)} {_fmt(v)}" for k, v in measured.items()
                           if isinstance(v, int | float) and not isinstance(v, bool))  # fmt: skip

    rows = [
        [_fmt(lv["implementation"]), _fmt(lv.get("description", "-")),
         figures(lv["against_original"]), figures(lv.get("against_fp16_artifact", {}))]
        for lv in levels
    ]  # fmt: skip
    header = ["implementation", "what ran", "against the original", "against the fp16 artifact"]
    return ["<h2>Levels</h2>", _table(header, rows)]


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


# Positions the device-margin table shows besides the flipped ones: the largest |dp| growth.
_MARGIN_ROWS = 10


def _growth(position: dict[str, Any]) -> float:
    """A position's |dp| growth over fp16 from parity.json (NaN, spelt "nan", sorts last)."""
    value = float(position["dprob_growth"])
    return value if math.isfinite(value) else -math.inf


def _device_margin_sections(runs: list[dict[str, Any]]) -> list[str]:
    """The device-margin profile: its summary, the reported deviations with their sources,
    and its flipped positions and largest |dp| growths."""
    parts: list[str] = []
    for run in runs:
        found = run.get("device_margin")
        if not found:
            continue
        parts += [
            "<h2>Device margin (reported NE deviations)</h2>",
            f"<p class='note'>{escape(found['summary'])}. {escape(found['perturbation'])}. "
            "Every deviation is a figure reported by its source, not measured here.</p>",
        ]
        rows = [[_fmt(d["range"]), _fmt(d["bound"]), _fmt(d["evidence"]), _fmt(d["source"]),
                 _fmt(d["reading"])] for d in found["deviations"]]  # fmt: skip
        parts.append(_table(["op, range", "bound", "evidence", "source", "reading"], rows))
        positions = found["positions"]
        shown = [p for p in positions if not p["argmax_kept"]]
        kept = sorted((p for p in positions if p["argmax_kept"]), key=_growth, reverse=True)
        shown += kept[:_MARGIN_ROWS]
        header = ["position", "argmax kept", "worst seed", "margin", "|dp|", "fp16 |dp|",
                  "|dp| growth", "fp16-acc |dp|", "over fp16-acc"]  # fmt: skip
        parts.append(_table(header, [
            [_fmt(f"{p['fixture']}@{p['position']}"), _fmt(p["argmax_kept"]),
             _fmt(p["worst_seed"]), _fmt(p["margin"]), _fmt(p["abs_dprob"]),
             _fmt(p["fp16_abs_dprob"]), _fmt(p["dprob_growth"]),
             _fmt(p["fp16_acc_abs_dprob"]), _fmt(p["deviation_growth"])]
            for p in shown
        ]))  # fmt: skip
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


# ---- inline SVG charts (no plotting dependency) ------------------------------------------------
# Log axes only: the figures plotted (relative errors, logit errors, margins) span decades.
# Non-finite and non-positive values are clamped to the axis floor and drawn hollow.

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 16, 40
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")


def _range(values: Sequence[float], floor: float) -> tuple[float, float]:
    good = [v for v in values if math.isfinite(v) and v > 0]
    if not good:
        return floor, floor * 10
    low = max(min(good), floor)
    high = max(max(good), low * 10)
    return 10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high))


class _LogAxes:
    def __init__(self, x_range: tuple[float, float] | None, y_range: tuple[float, float]):
        self.x_range, self.y_range = x_range, y_range

    def y(self, value: float) -> tuple[float, bool]:
        """The pixel row of ``value``, and whether it was clamped to the axis (inf, NaN, 0)."""
        low, high = self.y_range
        if not math.isfinite(value):
            v, clamped = high, True  # inf and NaN at the top, hollow
        else:
            v, clamped = min(max(value, low), high), not low <= value <= high
        frac = (math.log10(v) - math.log10(low)) / (math.log10(high) - math.log10(low))
        return TOP + (1 - frac) * (HEIGHT - TOP - BOTTOM), clamped

    def x(self, value: float) -> float:
        assert self.x_range is not None
        low, high = self.x_range
        v = min(max(value, low), high)
        frac = (math.log10(v) - math.log10(low)) / (math.log10(high) - math.log10(low))
        return LEFT + frac * (WIDTH - LEFT - RIGHT)

    def frame(self, x_label: str, y_label: str, x_ticks: list[tuple[float, str]]) -> list[str]:
        parts = [
            f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" '
            f'height="{HEIGHT - TOP - BOTTOM}" fill="none" stroke="#999"/>'
        ]
        low, high = self.y_range
        for exp in range(round(math.log10(low)), round(math.log10(high)) + 1):
            y, _ = self.y(10.0**exp)
            parts.append(
                f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                f'stroke="#eee"/><text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" '
                f'font-size="11">1e{exp}</text>'
            )
        for x, label in x_ticks:
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" '
                f'font-size="11">{escape(label)}</text>'
            )
        parts.append(
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle" '
            f'font-size="12">{escape(x_label)}</text>'
            f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
            f'font-size="12" transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">'
            f"{escape(y_label)}</text>"
        )
        return parts


def _legend(names: Sequence[str]) -> list[str]:
    parts = []
    for i, name in enumerate(names):
        y = TOP + 14 + 18 * i
        parts.append(
            f'<rect x="{WIDTH - RIGHT + 10}" y="{y - 9}" width="10" height="10" '
            f'fill="{COLOURS[i % len(COLOURS)]}"/><text x="{WIDTH - RIGHT + 26}" y="{y}" '
            f'font-size="11">{escape(name)}</text>'
        )
    return parts


def _svg(parts: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>'
        + "".join(parts)
        + "</svg>"
    )


def layer_chart(
    series: dict[str, list[float]],
    thresholds: dict[str, float],
    title: str,
    floor: float = 1e-9,
    y_label: str = "relative error",
) -> str:
    """Per-layer values (one line per series) on a log y axis, thresholds as dashed lines."""
    values = [v for s in series.values() for v in s] + list(thresholds.values())
    axes = _LogAxes(None, _range(values, floor))
    n = max((len(s) for s in series.values()), default=1)
    span = WIDTH - LEFT - RIGHT

    def x(i: int) -> float:
        return LEFT + (i + 0.5) * span / n

    ticks = [(x(i), str(i)) for i in range(n) if n <= 16 or i % max(1, n // 10) == 0]
    parts = axes.frame("layer", y_label, ticks)
    for i, (name, value) in enumerate(thresholds.items()):
        y, _ = axes.y(value)
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#555" '
            f'stroke-dasharray="5,4"/><text x="{WIDTH - RIGHT - 4}" y="{y - 4 - 10 * i:.1f}" '
            f'text-anchor="end" font-size="10">{escape(name)} {value:g}</text>'
        )
    for i, ys in enumerate(series.values()):
        colour = COLOURS[i % len(COLOURS)]
        points = [(x(j), *axes.y(v)) for j, v in enumerate(ys)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}"/>')
        for px, py, clamped in points:
            fill = "white" if clamped else colour
            parts.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{fill}" stroke="{colour}"/>'
            )
    return _svg(parts + _legend(list(series)), title)


def margin_chart(series: dict[str, list[tuple[float, float]]], title: str) -> str:
    """Logit error (y) against reference margin (x), log-log, with the line y = x / 2:
    points below it are certified (margin > 2 delta)."""
    xs = [m for pts in series.values() for m, _ in pts]
    ys = [e for pts in series.values() for _, e in pts]
    x_range = _range(xs, 1e-3)
    y_range = _range(ys + [x_range[0] / 2, x_range[1] / 2], 1e-6)
    axes = _LogAxes(x_range, y_range)
    low, high = x_range
    ticks = [
        (axes.x(10.0**e), f"1e{e}")
        for e in range(round(math.log10(low)), round(math.log10(high)) + 1)
    ]
    parts = axes.frame("reference margin top1 - top2 (logits)", "max |logit error|", ticks)
    (x0, x1) = (low, high)
    y0, _ = axes.y(x0 / 2)
    y1, _ = axes.y(x1 / 2)
    parts.append(
        f'<line x1="{axes.x(x0):.1f}" y1="{y0:.1f}" x2="{axes.x(x1):.1f}" y2="{y1:.1f}" '
        f'stroke="#555" stroke-dasharray="5,4"/><text x="{axes.x(x1) - 4:.1f}" '
        f'y="{y1 + 14:.1f}" text-anchor="end" font-size="10">error = margin / 2</text>'
    )
    for i, pts in enumerate(series.values()):
        colour = COLOURS[i % len(COLOURS)]
        for margin, error in pts:
            py, clamped = axes.y(error)
            fill = "white" if clamped else colour
            parts.append(
                f'<circle cx="{axes.x(margin):.1f}" cy="{py:.1f}" r="2.5" fill="{fill}" '
                f'fill-opacity="0.7" stroke="{colour}"/>'
            )
    return _svg(parts + _legend(list(series)), title)
