"""Minimal inline SVG charts for the HTML parity report (no plotting dependency).

Log axes only: the figures plotted (relative errors, logit errors, margins) span decades.
Non-finite and non-positive values are clamped to the axis floor and drawn hollow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

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
