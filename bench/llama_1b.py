"""A Llama-3.2-1B-shaped model (issue 22 item 4): does it convert in 12 GiB, window and cache?

    python bench/llama_1b.py WORK [--kv] [--layers 16] [--residual 0.01] [--limit 12GiB]

Builds transformers' ``LlamaForCausalLM`` at the vendored config
(``tests/data/configs/llama-3.2-1b.json``, random weights perturbed as the real-shape tests do,
the final norm's gain x 8 so the logits are peaked, each layer's o and down projections times
``--residual``) into ``WORK/ckpt`` once (in a fresh process), writes a window recipe (``--kv``:
the same with a state cache) with token-id fixtures, and runs ``anec convert`` under
``ANEC_MEMORY_LIMIT`` in a child process measured by ``/usr/bin/time -v``. Prints the exit
code, whether every gate passed, wall and CPU time, the child's peak RSS beside the
checkpoint's fp32 bytes, and each step's time and "peak RSS so far" from convert.log.

Random weights say nothing about quality. At full residual scale their logits hold near ties
that no fp16 program keeps (transformers' own fp16 forward agrees with its fp32 on 98.75 % of
the fixtures' argmaxes, max |dp| 0.049), so the fp16 gates stop the run before conversion. At
0.01 each token's embedding dominates the stream, the tied head's argmax is the input token by
more than 40 logits, and every gate checks the conversion's arithmetic on all 16 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
VOCAB = 128256
PEAK = 8.0
LENGTH = 64
CACHE = "cache:\n  style: state\n  length: 256\n  prefill: 64\n  extend: 4\n  decode_steps: 16\n"


def build(path: Path, layers: int, residual: float) -> None:
    """Save the checkpoint into ``path`` (run in its own process: its memory is not ours)."""
    sys.path.insert(0, str(REPO / "tests"))
    from real_configs import build_causal_lm

    build_causal_lm("llama-3.2-1b", "LlamaForCausalLM", "LlamaConfig", path, layers, VOCAB,
                    peak=PEAK, residual=residual)  # fmt: skip
    (path / "bench_layers.txt").write_text(f"{layers} {residual}")


def recipe(work: Path, kv: bool) -> Path:
    """The recipe file: a 64-token window (or cache), two token-id fixtures."""
    import numpy as np

    ids = np.random.default_rng(7).integers(3, VOCAB, size=(2, 40)).tolist()
    name = "llama-1b-kv" if kv else "llama-1b"
    text = (
        f"name: {name}\ntask: text-generation\nsource:\n  kind: hf-dir\n  path: {work / 'ckpt'}\n"
        f"shapes:\n  batch: 1\n  sequence_length: {LENGTH}\ntarget: macOS15\n"
        f"fixtures:\n  token_ids: [{ids[0][:24]}, {ids[1]}]\n" + (CACHE if kv else "")
    )
    path = work / f"{name}.yaml"
    path.write_text(text)
    return path


def main() -> None:
    """Build (once), convert, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--kv", action="store_true", help="a state-cache recipe")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--residual", type=float, default=0.01, help="o / down weight factor")
    parser.add_argument("--limit", default="12GiB", help="ANEC_MEMORY_LIMIT of the conversion")
    parser.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ckpt = args.work / "ckpt"
    if args._build:
        build(ckpt, args.layers, args.residual)
        return
    marker = ckpt / "bench_layers.txt"
    if not marker.is_file() or marker.read_text() != f"{args.layers} {args.residual}":
        args.work.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, str(args.work), "--layers", str(args.layers),
               "--residual", str(args.residual), "--_build"]  # fmt: skip
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    fp32 = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    file = recipe(args.work, args.kv)
    out = args.work / "out"
    env = dict(os.environ, ANEC_MEMORY_LIMIT=args.limit)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "converter.commands", "convert", str(file),
           "--out", str(out), "--force", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    timing = dict(re.findall(r"\t(Elapsed .*|Maximum resident set size .*|User time .*): (.*)",
                             proc.stderr))  # fmt: skip
    peak_kib = int(timing.get("Maximum resident set size (kbytes)", "0"))
    summary = next((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                   {})  # fmt: skip
    print(f"{file.name}: exit {proc.returncode}, passed {summary.get('passed')}")
    print(f"wall {timing.get('Elapsed (wall clock) time (h:mm:ss or m:ss)')}, "
          f"user {timing.get('User time (seconds)')} s")  # fmt: skip
    print(f"peak RSS {peak_kib / 2**20:.2f} GiB; checkpoint fp32 {fp32 / GIB:.2f} GiB "
          f"(3 x fp32 + 1 GiB = {3 * fp32 / GIB + 1:.2f} GiB); limit {args.limit}")  # fmt: skip
    for name, seconds in summary.get("timings_s", {}).items():
        print(f"  {name:45s} {seconds:8.1f} s")
    failed = [f"{k}: {v['value']:.4g}" for k, v in summary.get("gates", {}).items()
              if not v["passed"]]  # fmt: skip
    print("failed gates: " + (", ".join(failed) or "none"))
    if summary.get("error"):
        print("error: " + summary["error"])
    log = next(out.glob(f"{file.stem}*/convert.log"), None)
    if log is not None:
        for line in log.read_text().splitlines():
            if "peak RSS so far" in line and ": done after" in line:
                print("  " + line.split("step ", 1)[-1])


if __name__ == "__main__":
    main()
