"""`anec convert` end to end, an older revision against the working tree, back to back.

Each side runs ``anec convert RECIPE --json`` in a fresh interpreter with ``PYTHONPATH``
pointing at its own source tree: the working tree, and ``REV`` exported with ``git archive``
into a temporary directory (nothing is checked out, no worktree is touched). For each side it
prints the step times the pipeline records (``timings_s``), the process wall time, the child's
peak RSS (``os.wait4``: that child's own ``ru_maxrss``, not a maximum over earlier children),
its CPU time, the machine's load average before and after, and every gate's value, so the
comparison shows the same gates passing on both sides.

Usage: ``python bench/convert.py --pipeline [--baseline REV] [--candidate REV] [--recipe PATH]
[--json PATH]`` (``--candidate`` defaults to the working tree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "smollm2-135m-draft.yaml"


def export_revision(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (any git revision) extracted under ``into``; returns its root."""
    root = into / "tree"
    root.mkdir(parents=True)
    archive = into / "tree.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", rev], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    archive.unlink()
    return root


def run_side(label: str, tree: Path, recipe: Path, out: Path) -> dict[str, Any]:
    """``anec convert RECIPE --json`` with ``tree`` first on the path; figures of that run."""
    env = dict(os.environ, PYTHONPATH=str(tree), TQDM_DISABLE="1")
    meter = out.with_name(out.name + "-steps.json")
    cmd = [sys.executable, str(REPO / "bench" / "step_meter.py"), str(meter), "convert"]
    cmd += [str(recipe), "--out", str(out), "--force", "--json"]
    print(f"running {label} ({tree}) ...", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        stdout.seek(0)
        stderr.seek(0)
        text, errors = stdout.read().decode(), stderr.read().decode()
    result: dict[str, Any] = {
        "label": label,
        "tree": str(tree),
        "exit_code": proc.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # Linux: KiB
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    if meter.is_file():
        metered = json.loads(meter.read_text())
        result["steps"] = metered["steps"]
        result["n_parameters"] = metered["n_parameters"]
    result["content_sha256"] = package_hashes(out)
    summaries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not summaries:
        result["error"] = "\n".join(errors.strip().splitlines()[-15:])
        return result
    summary = summaries[0]
    result["passed"] = summary["passed"]
    result["timings_s"] = summary["timings_s"]
    result["gates"] = summary["gates"]
    print(f"  exit {proc.returncode} in {wall:.0f} s", file=sys.stderr, flush=True)
    return result


def package_hashes(out: Path) -> dict[str, str]:
    """Each published artifact's package content hash (manifest ``package.content_sha256``),
    by artifact directory name: equal bytes on both sides give equal hashes."""
    hashes = {}
    for manifest in sorted(out.glob("*/manifest.json")):
        package = json.loads(manifest.read_text()).get("package") or {}
        hashes[manifest.parent.name] = str(package.get("content_sha256"))
    return hashes


def step_table(sides: list[dict[str, Any]]) -> None:
    """Each step's CPU time and the peak RSS when it ended, per side, beside the checkpoint's
    fp32 size (4 bytes a parameter): the step whose peak rises is the one that set it."""
    ok = [s for s in sides if s.get("steps")]
    if not ok:
        return
    names = list(dict.fromkeys(r["step"] for s in ok for r in s["steps"]))
    print(
        f"\n{'step: CPU s / peak RSS GiB at its end':<36}"
        + "".join(f"{s['label']:>24}" for s in ok)
    )
    for name in names:
        cells = ""
        for s in ok:
            row = next((r for r in s["steps"] if r["step"] == name), None)
            text = "-" if row is None else f"{row['cpu_s']:.1f} / {row['peak_rss_gib']:.2f}"
            cells += f"{text:>24}"
        print(f"{name[:35]:<36}{cells}")
    for s in ok:
        n = s.get("n_parameters")
        if n:
            fp32 = 4 * n / 2**30
            print(
                f"{s['label']}: {n / 1e6:.1f}M parameters, fp32 {fp32:.2f} GiB; peak "
                f"{s['peak_rss_gib']:.2f} GiB = {s['peak_rss_gib'] / fp32:.2f} x fp32 "
                f"(bound 3 x fp32 + 1 GiB = {3 * fp32 + 1:.2f} GiB)"
            )
    hashes = [s.get("content_sha256") for s in ok]
    print(f"package content_sha256: {hashes[0]}")
    same = all(h == hashes[0] for h in hashes)
    print(f"same package bytes on every side: {'yes' if same else 'NO'}")


def report(sides: list[dict[str, Any]]) -> None:
    """Step times, totals, peak memory and gates of each side, in columns."""
    ok = [s for s in sides if "error" not in s]
    for side in sides:
        if "error" in side:
            print(f"{side['label']}: FAILED (exit {side['exit_code']}):\n{side['error']}")
    if not ok:
        return
    width = max(16, *(len(s["label"]) for s in ok)) + 2  # "3.47e-06 pass" fits
    steps = list(dict.fromkeys(k for s in ok for k in s["timings_s"]))
    print(f"\n{'step (s)':<36}" + "".join(f"{s['label']:>{width}}" for s in ok))
    for step in steps:
        cells = "".join(
            f"{s['timings_s'][step]:>{width}.1f}" if step in s["timings_s"] else f"{'-':>{width}}"
            for s in ok
        )
        print(f"{step:<36}{cells}")
    rows = [
        ("sum of steps", lambda s: f"{sum(s['timings_s'].values()):.1f}"),
        ("process wall (s)", lambda s: f"{s['wall_s']:.1f}"),
        ("process CPU (s)", lambda s: f"{s['cpu_s']:.1f}"),
        ("peak RSS (GiB)", lambda s: f"{s['peak_rss_gib']:.2f}"),
        (
            "load avg 1 min before/after",
            lambda s: f"{s['load_before'][0]:.1f}/{s['load_after'][0]:.1f}",
        ),
        ("exit code", lambda s: str(s["exit_code"])),
    ]
    for name, cell in rows:
        print(f"{name:<36}" + "".join(f"{cell(s):>{width}}" for s in ok))
    gates = list(dict.fromkeys(k for s in ok for k in s["gates"]))
    print(f"\n{'gate':<36}" + "".join(f"{s['label']:>{width}}" for s in ok))
    for gate in gates:
        cells = ""
        for s in ok:
            g = s["gates"].get(gate)
            text = (
                "absent" if g is None else f"{g['value']:.3g} {'pass' if g['passed'] else 'FAIL'}"
            )
            cells += f"{text:>{width}}"
        print(f"{gate[:35]:<36}{cells}")
    step_table(ok)
    same = all(set(s["gates"]) == set(ok[0]["gates"]) for s in ok)
    print(f"\nsame gate set on every side: {'yes' if same else 'NO'}")
    print(f"cpus: {os.cpu_count()}; times are wall clock on whatever else the machine runs")


def main(baseline: str, recipe: Path, json_path: Path | None, candidate: str | None = None) -> int:
    """Run the baseline revision, then ``candidate`` (a revision, or None for the working
    tree); print and optionally save the figures."""
    with tempfile.TemporaryDirectory(prefix="anec-bench-") as tmp:
        root = Path(tmp)
        old = export_revision(baseline, root / "old")
        new = export_revision(candidate, root / "new") if candidate else REPO
        sides = [
            run_side(baseline, old, recipe, root / "out-old"),
            run_side(candidate or "working tree", new, recipe, root / "out-new"),
        ]
    report(sides)
    if json_path is not None:
        json_path.write_text(json.dumps({"recipe": str(recipe), "sides": sides}, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0 if all(s.get("exit_code") == 0 for s in sides) else 1
