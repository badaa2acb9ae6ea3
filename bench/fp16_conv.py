"""The torch-fp16 level with torch's own fp16 1x1 convolutions against `parity.fp16_conv`'s
lanes: one recipe converted both ways, back to back, each in a fresh process.

    python bench/fp16_conv.py minilm-l6-embed
    python bench/fp16_conv.py smollm2-135m-draft --json /tmp/fp16_conv.json

Prints each step's seconds side by side and whether the two parity.json files are equal once
the evaluator's seconds are left out (they must be: the lanes give torch's bits).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = """
import json, sys, time
from pathlib import Path
import parity.fp16_conv as lanes
from converter.pipeline.run import convert
from converter.pipeline.progress import Steps
from converter.recipe import load_recipe, locate_recipe

name, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if mode == "torch":
    lanes.matches_torch = lambda: False  # every fp16 convolution stays torch's
steps = Steps(quiet=True)
start = time.perf_counter()
result = convert(load_recipe(locate_recipe(name)), out, force=True, steps=steps)
print(json.dumps({"wall": time.perf_counter() - start, "passed": result.passed,
                  "steps": steps.timings, "reports": str(result.report_dir)}))
"""


def _without_seconds(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def run(recipe: str, mode: str, out: Path) -> dict[str, Any]:
    """Convert ``recipe`` into ``out`` in a fresh interpreter; its figures."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, recipe, mode, str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    parity = json.loads((Path(figures["reports"]) / "parity.json").read_text())
    figures["parity"] = _without_seconds(parity)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="a shipped recipe name or a recipe file")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {mode: run(args.recipe, mode, Path(tmp) / mode) for mode in ("torch", "lanes")}
    before, after = figures["torch"], figures["lanes"]
    print(f"{'step':<44} {'torch s':>9} {'lanes s':>9}")
    for step, seconds in before["steps"].items():
        print(f"{step:<44} {seconds:>9.1f} {after['steps'].get(step, float('nan')):>9.1f}")
    print(f"{'process wall':<44} {before['wall']:>9.1f} {after['wall']:>9.1f}")
    same = before["parity"] == after["parity"]
    print(f"gates passed: {before['passed']} / {after['passed']}; parity.json equal: {same}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
