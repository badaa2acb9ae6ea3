"""bench/memory_census.py: a conversion run under the census still converts (same exit
code, artifact published) and reports every pipeline step's start and end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tiny_models import save_tiny_llama, write_tiny_recipe

BENCH = Path(__file__).resolve().parent.parent / "bench" / "memory_census.py"


def test_census_lines_frame_every_step_and_the_conversion_publishes(tmp_path: Path) -> None:
    recipe = write_tiny_recipe(tmp_path / "r.yaml", save_tiny_llama(tmp_path / "ck"))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH), str(recipe), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "tiny" / "manifest.json").is_file()
    lines = [line for line in done.stderr.splitlines() if line.startswith("[census]")]
    starts = [re.match(r"\[census\] start (.+?): rss", line) for line in lines]
    ends = [re.match(r"\[census\] end (.+?): rss", line) for line in lines]
    started = [m.group(1) for m in starts if m]
    assert started and started == [m.group(1) for m in ends if m]
    assert {"load checkpoint", "convert to ML Program", "parity (MIL evaluator)"} <= set(started)
    for line in lines:
        rss = float(re.search(r"rss ([0-9.]+) GiB", line).group(1))  # type: ignore[union-attr]
        assert 0.05 < rss < 64
