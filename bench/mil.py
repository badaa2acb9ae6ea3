"""MIL evaluator speed: the SmolLM2 L=64 artifact in each numeric profile, against the torch
fp32 forward of the original model, measured in the same run.

Usage: ``python bench/mil.py [--artifact DIR] [--repeats N] [--json PATH]``. Without
``--artifact`` the shipped ``smollm2-135m-draft`` recipe is converted first into a temporary
directory. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = "smollm2-135m-draft"
TARGET_FP16_S = 10.0  # printed next to the figure, never asserted
PROMPT = (
    "The Apple Neural Engine runs convolutions, matrix multiplications and elementwise "
    "operations on half-precision tensors laid out with channels first, so a transformer "
    "converted for it keeps its activations in that layout from the first layer to the last."
)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls, after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def spread(values: list[float]) -> str:
    """``median [min-max]`` in seconds."""
    return f"{statistics.median(values):7.3f} [{min(values):.3f}-{max(values):.3f}]"


def torch_forward(model: Any, ids: Any, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per forward of the original model: torch's default threads, then one thread."""
    import torch

    model.eval()

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    default = timed(forward, repeats)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = timed(forward, repeats)
    finally:
        torch.set_num_threads(threads)
    return default, one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifact", type=Path, help="an existing smollm2-135m-draft artifact")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    from converter.pipeline.progress import quiet_third_party_output

    quiet_third_party_output()
    import numpy as np
    import torch

    from converter.checkpoints.loading import load_checkpoint
    from converter.evidence.recheck import checkpoint_source, read_manifest, recipe_from_manifest
    from converter.pipeline.run import convert
    from converter.recipe import load_recipe, locate_recipe
    from parity.mil import PROFILES, Evaluator, load_package

    artifact = args.artifact
    if artifact is None:
        out = Path(tempfile.mkdtemp(prefix="anec-bench-mil-"))
        print(f"converting {RECIPE} into {out} ...", file=sys.stderr)
        result = convert(load_recipe(locate_recipe(RECIPE)), out)
        if not result.passed:
            raise SystemExit("the conversion failed its gates; see its parity report")
        artifact = out / RECIPE
        convert_steps = {k: round(v, 1) for k, v in result.timings.items()}
        print(f"anec convert step times (s): {convert_steps}")
    manifest = read_manifest(artifact)
    recipe = recipe_from_manifest(manifest)
    length = recipe.shapes.sequence_length
    ckpt = load_checkpoint(checkpoint_source(manifest), recipe.task)
    tokenizer: Any = ckpt.tokenizer
    tokens = list(tokenizer(PROMPT)["input_ids"]) * 8
    ids = torch.tensor([tokens[:length]])  # one full window, no padding
    table = np.load(artifact / "embeddings.npy")
    inputs = {
        "inputs_embeds": table[ids.numpy()].astype(np.float16),
        "key_mask": np.zeros((1, length), np.float16),
    }

    figures: dict[str, Any] = {
        "artifact": str(artifact),
        "length": length,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {platform.system()}",
        "torch_threads_default": torch.get_num_threads(),
    }
    torch_default, torch_one = torch_forward(ckpt.model, ids, args.repeats)
    threads = figures["torch_threads_default"]
    figures["torch_fp32_forward_s"] = torch_default
    figures["torch_fp32_forward_1thread_s"] = torch_one
    del ckpt

    program = load_package(artifact / manifest.package.file)
    rows = []
    for name in PROFILES:
        start = time.perf_counter()
        evaluator = Evaluator(program, name)
        prepare = time.perf_counter() - start
        runs = timed(partial(evaluator.run, inputs), args.repeats)
        figures[f"mil_{name}"] = {"prepare_s": prepare, "run_s": runs}
        rows.append((name, prepare, runs))

    base, base1 = statistics.median(torch_default), statistics.median(torch_one)
    print(f"SmolLM2 L={length} artifact, {args.repeats} timed runs each (median [min-max] s)")
    print(f"  torch fp32 forward, original model, {threads} threads: {spread(torch_default)}")
    print(f"  torch fp32 forward, original model, 1 thread:  {spread(torch_one)}")
    print("  profile    prepare s   run s median [min-max]   / torch   / torch 1 thread")
    for name, prepare, runs in rows:
        med = statistics.median(runs)
        ratios = f"{med / base:7.1f}x  {med / base1:7.1f}x"
        print(f"  {name:<9} {prepare:9.2f}  {spread(runs):>24}  {ratios}")
    fp16 = statistics.median(figures["mil_fp16"]["run_s"])
    verdict = "meets" if fp16 <= TARGET_FP16_S else "misses"
    print(f"fp16 profile {fp16:.2f} s {verdict} the target of {TARGET_FP16_S:g} s per evaluation")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {rss:.2f} GiB (the original model, the program and one profile's constants)")
    figures["peak_rss_gib"] = rss
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
