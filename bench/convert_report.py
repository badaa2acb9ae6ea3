"""The parent side of ``convert.py``: ratios between the cases of one run, the targets they are
compared with (printed, never asserted), and the tables."""

from __future__ import annotations

from typing import Any

# Targets, printed next to the figures (compared, never asserted).
TARGET_QWEN_CONVERT_S = 180.0
TARGET_QWEN_RSS_GIB = 8.0
TARGET_OPS_RATIO = 1.5
# The naive port must match transformers this closely (relative error) to count as a baseline.
NAIVE_CHECK_TOLERANCE = 1e-4


def top_ops(result: dict[str, Any], n: int = 5) -> str:
    """The ``n`` most frequent op types as ``type count``."""
    return ", ".join(f"{k} {v}" for k, v in list(result["op_types"].items())[:n])


def met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def comparisons(by_case: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios and target verdicts from the figures of this run (only cases that ran)."""
    out: dict[str, Any] = {}
    anec, naive = by_case.get("smollm2-bc1l"), by_case.get("smollm2-naive")
    if anec and naive:
        ops_ratio = anec["live_ops_per_layer"] / naive["live_ops_per_layer"]
        out["ops_per_layer_ratio"] = ops_ratio
        out["ops_per_layer_target_met"] = ops_ratio <= TARGET_OPS_RATIO
        out["convert_time_ratio"] = anec["convert_s"] / naive["convert_s"]
        out["naive_baseline_correct"] = naive["check_passed"]
    qwen = by_case.get("qwen2.5-0.5b-bc1l")
    if qwen:
        out["qwen_convert_target_met"] = qwen["convert_s"] < TARGET_QWEN_CONVERT_S
        out["qwen_rss_target_met"] = qwen["peak_rss_gib"] < TARGET_QWEN_RSS_GIB
    return out


def report(results: list[dict[str, Any]], comp: dict[str, Any]) -> None:
    """Print the figures table, the step breakdown, and the comparisons with targets."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150, highlight=False)
    ok = [r for r in results if "error" not in r]

    table = Table(title="Conversion benchmark (fp16 ML Program, macOS14, window 64)", box=box.ASCII)
    for column in ("case", "load s", "convert s", "peak RSS GiB", "live ops", "ops/layer"):
        table.add_column(column, justify="left" if column == "case" else "right")
    table.add_column("top op types")
    for r in results:
        if "error" in r:
            table.add_row(r["case"], "failed", "", "", "", "", r["error"].splitlines()[-1][:60])
            continue
        table.add_row(
            r["case"],
            f"{r['load_s']:.1f}",
            f"{r['convert_s']:.1f}",
            f"{r['peak_rss_gib']:.2f}",
            str(r["live_ops"]),
            f"{r['live_ops_per_layer']:.1f}",
            top_ops(r),
        )
    console.print(table)

    steps = Table(title="Steps (s) and checks (fp32 torch vs transformers)", box=box.ASCII)
    for column in ("case", "adapt", "build", "calibrate", "trace", "ct.convert"):
        steps.add_column(column, justify="left" if column == "case" else "right")
    for column in ("RSS after load GiB", "rel err full", "rel err left-pad 24"):
        steps.add_column(column, justify="right")
    for r in ok:
        s = r["steps_s"]
        steps.add_row(
            r["case"],
            *(f"{s[k]:.1f}" if k in s else "-" for k in ("adapt", "build", "calibrate")),
            f"{s['trace']:.1f}",
            f"{s['ct.convert']:.1f}",
            f"{r['peak_rss_after_load_gib']:.2f}",
            f"{r['check_rel_error']['pad0']:.1e}",
            f"{r['check_rel_error']['pad24']:.1e}",
        )
    console.print(steps)

    console.print(
        "load s: checkpoint load only. convert s: adapt (anec) + build + trace + "
        "ct.convert; calibration and checks are untimed extras."
    )
    console.print("ops/layer: live MIL ops (consts excluded) / number of layers, head included.")
    for r in ok:
        if r.get("prescale"):
            p = r["prescale"]
            console.print(
                f"{r['case']}: power-of-two prescales: {p['scaled_norms']}/{p['norms']} "
                f"norms scaled, max per-position L2 norm {p['max_input_l2']:.0f}, max prescale "
                f"{p['max_prescale']:g}"
            )
        for note in r["notes"]:
            console.print(f"{r['case']}: {note}")

    console.print("\nComparisons measured in this run:")
    if "ops_per_layer_ratio" in comp:
        naive = next(r for r in ok if r["case"] == "smollm2-naive")
        verdict = "correct"
        if not comp["naive_baseline_correct"]:
            verdict = "INCORRECT, ratios not meaningful"
        console.print(
            f"  naive baseline vs transformers: max rel err "
            f"{max(naive['check_rel_error'].values()):.1e} "
            f"(tolerance {NAIVE_CHECK_TOLERANCE:g}): {verdict}"
        )
        console.print(
            f"  anec ops/layer / naive ops/layer = {comp['ops_per_layer_ratio']:.2f}  "
            f"(target <= {TARGET_OPS_RATIO}x): {met(comp['ops_per_layer_target_met'])}"
        )
        console.print(
            f"  anec convert s / naive convert s = {comp['convert_time_ratio']:.2f}  (no target)"
        )
    else:
        console.print("  ratios need both smollm2-bc1l and smollm2-naive")
    qwen = next((r for r in ok if r["case"] == "qwen2.5-0.5b-bc1l"), None)
    if qwen:
        console.print(
            f"  qwen2.5-0.5b-bc1l convert {qwen['convert_s']:.1f} s "
            f"(target < {TARGET_QWEN_CONVERT_S:.0f} s): {met(comp['qwen_convert_target_met'])}"
        )
        console.print(
            f"  qwen2.5-0.5b-bc1l peak RSS {qwen['peak_rss_gib']:.2f} GiB "
            f"(target < {TARGET_QWEN_RSS_GIB:.0f} GiB): {met(comp['qwen_rss_target_met'])}"
        )
