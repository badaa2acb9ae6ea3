"""Which draft to ship: the drafts' measured acceptance and predicted loop speed, one report.

`comparison` joins each draft's acceptance sweep (``anec speculate``: measured on this host,
greedy and under sampling) with the loop model (`converter.drafts.loop_model`: the draft's step
costs
per chip from the cost model, the user's verify cost; predicted) and ranks the drafts per chip
and temperature by predicted pipelined speed-up. `write_reports` writes it as text, JSON and
HTML (a plot of acceptance against streamed bytes per token, the ranking tables).
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from converter.evidence.labels import Evidence

MEASURED = "measured on this host (MIL evaluator or the draft's torch module; not a device)"


def comparison(
    drafts: list[dict[str, Any]], verify_ms: float | None, target_ms: float | None
) -> dict[str, Any]:
    """The report: every draft's sweep, and with ``verify_ms`` the loop model's predictions
    per chip, temperature and K, and the ranking (``target_ms`` defaults to ``verify_ms``)."""
    from converter.drafts.loop_model import LoopCosts, best, draft_costs, predict

    report: dict[str, Any] = {
        "evidence": {"acceptance": MEASURED, "loop": Evidence.PREDICTED.value},
        "drafts": drafts,
    }
    if verify_ms is None:
        return report
    target = target_ms if target_ms is not None else verify_ms
    report["verify_ms"], report["target_ms"] = verify_ms, target
    ranking: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for doc in drafts:
        costs = draft_costs([Path(p) for p in doc["packages"]],
                            {f: Path(p) for f, p in doc["function_packages"].items()})  # fmt: skip
        doc["streamed_bytes_per_token"] = next(
            (c.streamed_bytes_per_token for c in costs.values()), None
        )
        doc["loop_model"] = {}
        for chip, cost in costs.items():
            loop = LoopCosts(
                cost.decode_ms, cost.extend_ms, doc["extend_tokens"], verify_ms, target
            )
            per_t: dict[str, Any] = {}
            for t, accepted_at in _accepted_by_temperature(doc).items():
                predictions = [predict(k, accepted, loop) for k, accepted in accepted_at]
                per_t[t] = [p.to_json() for p in predictions]
                top = best(predictions, pipelined=True)
                ranking.setdefault(chip, {}).setdefault(t, []).append(
                    {"draft": doc["draft"], "k": top.k,
                     "pipelined_speedup": top.pipelined_speedup,
                     "sequential_speedup": best(predictions, pipelined=False).sequential_speedup,
                     "mean_accepted_per_cycle": dict(accepted_at)[top.k]}
                )  # fmt: skip
            doc["loop_model"][chip] = {"decode_ms": cost.decode_ms, "extend_ms": cost.extend_ms,
                                       "by_temperature": per_t}  # fmt: skip
    for per_chip in ranking.values():
        for rows in per_chip.values():
            rows.sort(key=lambda r: -r["pipelined_speedup"])
    report["ranking"] = ranking
    return report


def _accepted_by_temperature(doc: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """(K, mean accepted per cycle) per temperature ("0" greedy, then the sampled ones)."""
    out: dict[str, list[tuple[int, float]]] = {"0": []}
    for row in doc["rows"]:
        out["0"].append((row["k"], row["mean_accepted_per_cycle"]))
        for t, r in row.get("sampling", {}).items():
            out.setdefault(t, []).append((row["k"], r["mean_accepted_per_cycle"]))
    return out


def row_text(row: dict[str, Any], backend: str) -> str:
    """One K's row of the sweep as text (and its MIL check, when one ran)."""
    rates = " ".join(f"{r:.2f}" for r in row["acceptance_per_position"])
    low, high = row["mean_accepted_95"]
    text = (
        f"K={row['k']}: T=0 acceptance per position [{rates}]  mean accepted "
        f"{row['mean_accepted_per_cycle']:.2f} [{low:.2f}, {high:.2f}]  tokens/target call "
        f"{row['tokens_per_target_call']:.2f}"
    )
    for t, r in row.get("sampling", {}).items():
        rates = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        low, high = r["mean_accepted_95"]
        text += (f"\n  T={t}: expected acceptance per position [{rates}]  mean accepted "
                 f"{r['mean_accepted_per_cycle']:.2f} [{low:.2f}, {high:.2f}]")  # fmt: skip
    if "mil_check" in row:
        c = row["mil_check"]
        text += (
            f"\n  MIL check on {c['texts']} text(s): mean accepted {backend} "
            f"{c['backend_mean_accepted']:.4f}, mil {c['mil_mean_accepted']:.4f} "
            f"(relative difference {c['relative_difference']:.2%}; cycles {c['backend_cycles']}"
            f" / {c['mil_cycles']}; 95 % interval of the difference "
            f"[{c['relative_difference_95'][0]:.2%}, {c['relative_difference_95'][1]:.2%}])"
        )
        if c["first_difference"] is not None:
            d = c["first_difference"]
            text += (f"\n  first parting cycle: text {d['text']}, continuation index "
                     f"{d['continuation_index']}: {backend} accepted {d['backend_accepted']}, "
                     f"mil {d['mil_accepted']}")  # fmt: skip
    return text


def ranking_text(report: dict[str, Any]) -> str:
    """The ranking tables as plain text, one per chip and temperature."""
    lines = [
        f"predicted loop speed-up (the loop model, {Evidence.PREDICTED.value}; verify "
        f"{report['verify_ms']} ms, target {report['target_ms']} ms per token; acceptance "
        f"{MEASURED})"
    ]
    for chip, per_t in report["ranking"].items():
        for t, rows in per_t.items():
            lines.append(f"{chip}, T={t}:")
            for i, r in enumerate(rows, 1):
                lines.append(
                    f"  {i}. {r['draft']}: K={r['k']} pipelined {r['pipelined_speedup']:.2f}x, "
                    f"best sequential {r['sequential_speedup']:.2f}x (mean accepted "
                    f"{r['mean_accepted_per_cycle']:.2f})"
                )
    return "\n".join(lines)


def report_text(report: dict[str, Any]) -> str:
    """The whole report as text: each draft's sweep, then the ranking."""
    parts = []
    for doc in report["drafts"]:
        parts.append(f"== {doc['draft']} ({doc['label']}; target {doc['target']}; "
                     f"{doc['positions']} positions; backend {doc['draft_backend']})")  # fmt: skip
        parts += [row_text(row, doc["draft_backend"]) for row in doc["rows"]]
    if report.get("ranking"):
        parts.append(ranking_text(report))
    return "\n".join(parts) + "\n"


WIDTH, HEIGHT, PAD = 640, 320, 56
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")


def acceptance_plot(report: dict[str, Any]) -> str:
    """SVG: each draft's first-position acceptance (per temperature) against its streamed
    bytes per decoded token; empty when no draft has a streamed-bytes figure."""
    points = []  # (bytes, acceptance, temperature, draft)
    for doc in report["drafts"]:
        streamed = doc.get("streamed_bytes_per_token")
        if not streamed:
            continue
        first = doc["rows"][0]
        points.append((streamed, first["acceptance_per_position"][0], "0", doc["draft"]))
        for t, r in first.get("sampling", {}).items():
            points.append((streamed, r["acceptance_per_position"][0], t, doc["draft"]))
    if not points:
        return ""
    temps = list(dict.fromkeys(p[2] for p in points))
    x_max = max(p[0] for p in points) * 1.1

    def x(v: float) -> float:
        return PAD + v / x_max * (WIDTH - 2 * PAD)

    def y(v: float) -> float:
        return HEIGHT - PAD - v * (HEIGHT - 2 * PAD)

    parts = [f'<rect x="{PAD}" y="{PAD}" width="{WIDTH - 2 * PAD}" height="{HEIGHT - 2 * PAD}" '
             'fill="none" stroke="#999"/>']  # fmt: skip
    for v in (0.0, 0.5, 1.0):
        parts.append(f'<text x="{PAD - 6}" y="{y(v) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{v:.1f}</text>')  # fmt: skip
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 16}" text-anchor="middle" font-size="12">'
                 f"streamed MB per decoded token (max {x_max / 1.1 / 1e6:.1f})</text>")  # fmt: skip
    parts.append(
        f'<text x="14" y="{HEIGHT / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {HEIGHT / 2})">acceptance, first draft</text>'
    )
    for b, a, t, name in points:
        colour = COLOURS[temps.index(t) % len(COLOURS)]
        parts.append(f'<circle cx="{x(b):.1f}" cy="{y(a):.1f}" r="5" fill="{colour}">'
                     f"<title>{escape(Path(name).name)}: T={t}, {a:.3f}, "
                     f"{b / 1e6:.1f} MB</title></circle>")  # fmt: skip
    for i, t in enumerate(temps):
        parts.append(f'<text x="{WIDTH - PAD + 4}" y="{PAD + 14 * (i + 1)}" font-size="11" '
                     f'fill="{COLOURS[i % len(COLOURS)]}">T={escape(t)}</text>')  # fmt: skip
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            'role="img"><title>acceptance against streamed bytes</title>'
            + "".join(parts) + "</svg>")  # fmt: skip


def report_html(report: dict[str, Any]) -> str:
    """The report as one HTML page: the plot, each draft's table, the ranking."""
    body = ["<h1>anec speculate: which draft to ship</h1>",
            f"<p>acceptance: {escape(MEASURED)}; loop: {Evidence.PREDICTED.value} (the cost "
            "model's draft step costs and the given verify cost; not a measurement)</p>",
            acceptance_plot(report)]  # fmt: skip
    for doc in report["drafts"]:
        body.append(f"<h2>{escape(doc['draft'])}</h2><p>{escape(doc['label'])}; target "
                    f"{escape(doc['target'])}; {doc['positions']} positions</p>")  # fmt: skip
        head = ("<tr><th>K</th><th>T</th><th>acceptance per position</th>"
                "<th>mean accepted</th><th>95 %</th></tr>")  # fmt: skip
        rows = []
        for row in doc["rows"]:
            cells = [("0", row)] + list(row.get("sampling", {}).items())
            for t, r in cells:
                rates = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
                low, high = r["mean_accepted_95"]
                rows.append(f"<tr><td>{row['k']}</td><td>{t}</td><td>{rates}</td>"
                            f"<td>{r['mean_accepted_per_cycle']:.3f}</td>"
                            f"<td>[{low:.3f}, {high:.3f}]</td></tr>")  # fmt: skip
        body.append(f"<table>{head}{''.join(rows)}</table>")
    for chip, per_t in report.get("ranking", {}).items():
        for t, ranked in per_t.items():
            body.append(f"<h3>{escape(chip)}, T={t} (predicted)</h3><table><tr><th>draft</th>"
                        "<th>K</th><th>pipelined</th><th>sequential</th></tr>")  # fmt: skip
            body += [f"<tr><td>{escape(r['draft'])}</td><td>{r['k']}</td>"
                     f"<td>{r['pipelined_speedup']:.2f}x</td>"
                     f"<td>{r['sequential_speedup']:.2f}x</td></tr>" for r in ranked]  # fmt: skip
            body.append("</table>")
    style = "body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>anec speculate</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")  # fmt: skip


def write_reports(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """speculate.txt, speculate.json and speculate.html in ``out_dir``, each written atomically."""
    from converter.pipeline.fsops import write_json_atomic, write_text_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        write_text_atomic(out_dir / "speculate.txt", report_text(report)),
        write_json_atomic(out_dir / "speculate.json", report),
        write_text_atomic(out_dir / "speculate.html", report_html(report)),
    ]
