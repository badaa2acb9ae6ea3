"""Each compression method's time and peak memory on Qwen2.5-0.5B-shaped weights (issue 12).

    python bench/compress.py methods                        # every method, 24 layers
    python bench/compress.py methods --layers 2 --method int8 --method gptq4 --json out.json

The checkpoint: transformers' ``Qwen2ForCausalLM`` at the vendored real config
(``tests/data/configs/qwen2.5-0.5b.json``, full vocabulary, ``--layers`` deep), random
initialisation perturbed as the real-shape tests do, the final norm's gain raised so the logits
are peaked (fewer near-ties for the fp16 gate), then every decoder-layer projection passed
through gguf's own Q4_1 quantizer and de-quantizer so ``method: grid`` finds its grid (the
embedding table, norms and biases stay as initialised). It is saved as an hf-dir checkpoint
without a tokenizer, so the recipe's held-out and calibration slices are token-id lists (a
``pydoc_data`` corpus needs the checkpoint's tokenizer): fixed pseudo-random ids, disjoint.

For each case a recipe holding the fp16 artifact plus ONE variant is converted by anec's CLI
(``converter.commands``'s ``main``, as ``python -m converter.commands convert RECIPE --json`` runs
it,
with one more handler copying the pipeline's step lines to stderr) in a fresh process;
``fp16`` is the same recipe without a compression section, so a method's marginal cost is
visible. Per case: the step times the pipeline records (``timings_s`` of the --json summary,
the same as convert.log; from the step lines when the child was killed), the process wall and
CPU time, the child's peak RSS (``os.wait4``: that child's own ``ru_maxrss``), its RSS sampled
once a second and laid over the steps (each step's peak; the step a killed run was in), the
variant's stored-weight ratio and whether its gates passed. A child above ``--cap-gib`` is
killed (the machine is shared). Quality on random weights means nothing: gates are reported,
not judged. Times are wall clock on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG_NAME = "qwen2.5-0.5b"
LIMIT_GIB = 12.0  # issue 12: peak under 12 GiB on Qwen2.5-0.5B-shaped weights
# Logits spread (as tests/test_kv_real_width.py does) so fp16 flips few argmaxes.
PEAK = 8.0
LENGTH = 64
# Short slices keep each run about the method, not the scoring: 2 x 64 held-out positions,
# 2 x 64 calibration tokens (GPTQ Hessians, SKM Fisher weights, W8A8 ranges, the search).
HELD_OUT_TEXTS = 2
CALIBRATION_TEXTS = 2
# Thresholds no random-weight variant is expected to meet or miss for a reason: quality here
# is not the question, and a variant's gates never stop the measurement.
VARIANT_GATES = {"min_top1_agreement": 0.5, "max_mean_kl": 1.0}

# One variant per case: every method in converter/compression/methods/ that applies to
# text-generation. ``None``: the fp16 artifact alone (the baseline).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "fp16": None,
    "int8": {"method": "int8", "granularity": "per-channel"},
    "lut4": {"method": "lut", "bits": 4},
    "lut4g32": {"method": "lut", "bits": 4, "granularity": "per-grouped-channel",
                "group_size": 32},
    "scaled4": {"method": "scaled", "bits": 4},
    "o4g32": {"method": "outliers", "bits": 4, "granularity": "per-grouped-channel",
              "group_size": 32, "outlier_columns": 4},
    "gptq4": {"method": "gptq", "bits": 4, "granularity": "per-channel"},
    "skm4g32": {"method": "skm", "bits": 4, "granularity": "per-grouped-channel",
                "group_size": 32},
    "w8a8-smooth": {"method": "w8a8", "granularity": "per-channel", "smooth": True},
    "grid": {"method": "grid", "granularity": "per-block", "group_size": 32},
    # A small search space: lut4 per tensor or fp16, per weight (one candidate each).
    "mixed": {"method": "mixed", "search": {"bits": [16, 4], "methods": ["lut"],
              "budget": {"min_top1_agreement": 0.5, "max_mean_kl": 1.0}}},
}  # fmt: skip


# ---- the checkpoint --------------------------------------------------------------------------


def q4_1(w: Any) -> Any:
    """``w`` (rows of whole 32-value blocks) through gguf's Q4_1 quantizer and back."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType.Q4_1
    return np.asarray(dequantize(quantize(w.astype(np.float32), kind), kind), np.float32)


def build_checkpoint(path: Path, layers: int) -> dict[str, Any]:
    """Save the Q4_1-projected random Qwen2.5-0.5B-shaped checkpoint into ``path``."""
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    import transformers
    from real_configs import config_dict
    from tiny_models import perturb_

    start = time.perf_counter()
    data = config_dict(CONFIG_NAME)
    data.pop("architectures", None)
    data["num_hidden_layers"] = layers
    config = transformers.Qwen2Config(**data)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    projected = 0
    with torch.no_grad():
        perturb_(model, scale=0.02)
        model.model.norm.weight.mul_(PEAK)
        for p in model.model.layers.parameters():
            if p.ndim == 2:  # the seven projections of each layer
                p.copy_(torch.from_numpy(q4_1(p.numpy())))
                projected += p.numel()
    model.save_pretrained(path, safe_serialization=True)
    return {
        "layers": layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "q4_1_parameters": projected,
        "vocab": config.vocab_size,
        "build_s": round(time.perf_counter() - start, 1),
    }


def ensure_checkpoint(path: Path, layers: int) -> dict[str, Any]:
    """The checkpoint in ``path`` (built there in a fresh process unless one of ``layers``
    layers is already there); its description."""
    info = path / "bench_checkpoint.json"
    if info.is_file() and json.loads(info.read_text())["layers"] == layers:
        doc: dict[str, Any] = json.loads(info.read_text())
        return doc | {"reused": True}
    path.mkdir(parents=True, exist_ok=True)
    print(f"building the {layers}-layer checkpoint in {path} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, __file__, "_build", str(path), str(layers)]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    doc = json.loads(info.read_text())
    return doc | {"reused": False}


# ---- the recipe ------------------------------------------------------------------------------


def token_texts(vocab: int) -> dict[str, list[list[int]]]:
    """Fixture, held-out and calibration token ids: pseudo-random, fixed, never shared (ids
    3 and up: 0-2 are the special ids of transformers' default Qwen2 config)."""
    import numpy as np

    rng = np.random.default_rng(12)
    count = 1 + HELD_OUT_TEXTS + CALIBRATION_TEXTS
    ids = rng.integers(3, vocab, size=(count, LENGTH)).tolist()
    return {
        "fixtures": [ids[0][:16]],
        "held_out": ids[1 : 1 + HELD_OUT_TEXTS],
        "calibration": ids[1 + HELD_OUT_TEXTS :],
    }


def recipe_text(case: str, checkpoint: Path, vocab: int) -> str:
    """The recipe of ``case``: the fp16 artifact and, unless ``fp16``, one variant."""
    from converter.compression import methods

    texts = token_texts(vocab)
    recipe: dict[str, Any] = {
        "name": "qwen-methods",
        "task": "text-generation",
        "source": {"kind": "hf-dir", "path": str(checkpoint)},
        "shapes": {"batch": 1, "sequence_length": LENGTH},
        "io": {"logits": "last", "lm_head_chunk": 16384, "dtype": "float16"},
        "precision": "float16",
        "target": "macOS15",  # grouped-channel palettes and per-block integers
        "attention": "per-head",
        # Random weights have near-ties that fp16 may flip; the fp16 artifact only has to be
        # published for its variant to be built, so its argmax gate is loosened here.
        "gates": {"fp16_argmax_agreement": 0.9, "fp16_max_abs_dprob": 0.1},
        "fixtures": {"token_ids": texts["fixtures"], "padded_variants": False},
    }
    spec = VARIANTS[case]
    if spec is not None:
        compression: dict[str, Any] = {"held_out": texts["held_out"]}
        if spec["method"] in methods.calibrated():
            compression["calibration"] = texts["calibration"]
        compression["variants"] = [{"suffix": case, **spec, "gates": VARIANT_GATES}]
        recipe["compression"] = compression
    # JSON is YAML: no hand-written quoting of token lists or paths.
    return json.dumps(recipe, indent=1) + "\n"


# ---- one case in a fresh process -------------------------------------------------------------


def _rss_gib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


# The child is ``anec``'s own CLI (converter.commands's main, what ``python -m converter.commands``
# runs) with one more handler on the pipeline's step log: each step's start and end reach
# stderr with a timestamp, so the sampled memory can be laid over the steps (--json keeps the
# progress display quiet, and a killed run writes no convert.log).
STEP_MARK = "BENCH-STEP"
CHILD = f"""\
import logging, sys
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("{STEP_MARK} %(created).3f %(message)s"))
logging.getLogger("converter.pipeline.progress").addHandler(handler)
from converter.commands import main
sys.argv[0] = "anec"
main()
"""
_STEP_RE = re.compile(
    rf"^{STEP_MARK} (\d+\.\d+) step (.+): (started|done|stopped)(?: after (\d+\.\d+) s)?"
)


def step_peaks(
    lines: list[str], samples: list[tuple[float, float]]
) -> tuple[dict[str, float], dict[str, float], str | None]:
    """From the child's step lines and ``samples`` (epoch seconds, GiB): each step's highest
    sampled RSS (GiB), each ended step's seconds (as the pipeline logs them: a killed run
    has no --json summary), and the step still running when the child ended, if any."""
    starts: dict[str, float] = {}
    peaks: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for line in lines:
        m = _STEP_RE.match(line)
        if m is None:
            continue
        when, name, what = float(m[1]), m[2], m[3]
        if what == "started":
            starts[name] = when
            continue
        begin = starts.pop(name, when)
        inside = [rss for t, rss in samples if begin <= t <= when]
        peaks[name] = round(max(inside, default=0.0), 2)
        if m[4] is not None:
            seconds[name] = float(m[4])
    running = None
    for name, begin in starts.items():  # started, never ended: the child was killed in it
        peaks[name] = round(max((rss for t, rss in samples if t >= begin), default=0.0), 2)
        running = name
    return peaks, seconds, running


def run_case(case: str, recipe: Path, out: Path, cap_gib: float) -> dict[str, Any]:
    """``anec convert RECIPE --json`` in a fresh process; its figures. The child is killed
    if its resident memory passes ``cap_gib`` (the machine is shared); its RSS is sampled
    every second to give each step's peak."""
    cmd = [sys.executable, "-c", CHILD, "convert", str(recipe)]
    cmd += ["--out", str(out), "--force", "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    load_before = os.getloadavg()
    start = time.perf_counter()
    capped = False
    samples: list[tuple[float, float]] = []
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            samples.append((time.time(), _rss_gib(proc.pid)))
            if not capped and samples[-1][1] > cap_gib:
                capped = True
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(1.0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        stdout.seek(0)
        stderr.seek(0)
        text, errors = stdout.read().decode(), stderr.read().decode()
    peaks, logged, running = step_peaks(errors.splitlines(), samples)
    row: dict[str, Any] = {
        "case": case,
        "method": (VARIANTS[case] or {"method": "fp16"})["method"],
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),  # Linux: KiB
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "step_peak_rss_gib": peaks,  # sampled once a second: a lower bound
    }
    if running is not None:  # killed: the steps it finished, from its step log
        row["timings_s"] = logged
        row["killed_during"] = running
    if capped:
        row["error"] = f"killed at the {cap_gib} GiB cap (during {running!r})"
    elif proc.returncode == -signal.SIGKILL:
        row["error"] = f"killed by SIGKILL from outside, not this bench's cap (during {running!r})"
    errors = "\n".join(line for line in errors.splitlines() if not line.startswith(STEP_MARK))
    summaries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not summaries or "timings_s" not in summaries[0]:
        tail = "\n".join(errors.strip().splitlines()[-30:])
        row.setdefault("error", tail or (summaries[0].get("error") if summaries else "no output"))
        return row
    summary = summaries[0]
    row["fp16_passed"] = summary["passed"]
    row["timings_s"] = summary["timings_s"]
    if summary["variants"]:
        (v,) = summary["variants"]
        size = v["size"]
        row["variant_passed"] = v["passed"]
        row["variant_seconds"] = v["seconds"]
        # every weight byte the package stores (LM head and kept tensors too) over the fp16
        # package's weights, and the compressed weights alone
        row["stored_ratio"] = round(
            size["all_weights_stored_bytes"] / size["all_weights_fp16_bytes"], 4
        )
        row["compressed_ratio"] = round(size["compressed_ratio"], 4)
        row["variant_gates"] = {
            f"{g['name']} [{g['implementation']}]": float(f"{g['value']:.4g}") for g in v["gates"]
        }
    return row


# ---- the table -------------------------------------------------------------------------------


# the steps every variant runs (converter/compression/variant_steps.py), named "<suffix>: <step>"
EMIT_STEPS = ("compress", "records and size", "parity (torch, MIL)")
# Methods whose own step (GPTQ, sensitive k-means) runs in their ``prepare``, inside emit's
# compress step: counted once. The others' (find grids, search) run before it.
INSIDE_COMPRESS = frozenset({"gptq", "skm"})


def variant_steps(row: dict[str, Any]) -> dict[str, float]:
    """The pipeline's step times that belong to the variant (named ``<suffix>: ...``) and the
    compression baselines every variant run shares."""
    timings = row.get("timings_s", {})
    own = {k: v for k, v in timings.items() if k.startswith(f"{row['case']}: ")}
    if "compression: fp16 baselines" in timings:
        own["compression: fp16 baselines"] = timings["compression: fp16 baselines"]
    return own


def method_step(row: dict[str, Any]) -> tuple[str, float] | None:
    """The method's own step (GPTQ, sensitive k-means, find grids, search), if it has one."""
    for name, seconds in variant_steps(row).items():
        step = name.removeprefix(f"{row['case']}: ")
        if name != step and step not in EMIT_STEPS:
            return step, seconds
    return None


def variant_s(row: dict[str, Any]) -> float:
    """Every second the variant added to the run (baselines, method step, compress, records,
    parity), a nested method step counted once."""
    total = sum(variant_steps(row).values())
    own = method_step(row)
    if own is not None and row["method"] in INSIDE_COMPRESS:
        total -= own[1]
    return total


def fp16_steps_s(row: dict[str, Any]) -> float:
    """The seconds of the steps that make the fp16 artifact (everything but the variant)."""
    timings = row.get("timings_s", {})
    return sum(v for k, v in timings.items() if k not in variant_steps(row))


def _cell(value: Any, spec: str) -> str:
    """``value`` in ``spec`` (width.precision), or a dash of the same width."""
    width = int(spec.split(".")[0])
    return format(value, spec) if isinstance(value, int | float) else f"{'-':>{width}}"


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per case, then each case's variant steps and the 12 GiB check."""
    print(
        f"\n{'case':<12} {'method':<9} {'exit':>4} {'fp16 steps':>10} {'baselines':>9} "
        f"{'method step':>11} {'compress':>8} {'parity':>7} {'variant':>7} {'wall':>7} "
        f"{'CPU':>7} {'peak GiB':>8} {'stored':>6} {'compr.':>6}  gates"
    )
    for r in rows:
        case, timings = r["case"], r.get("timings_s", {})
        timed = "timings_s" in r and case != "fp16"
        own = method_step(r) if timed else None
        gates = "-" if "variant_passed" not in r else ("pass" if r["variant_passed"] else "fail")
        if "error" in r:
            gates = f"killed in {r['killed_during']}" if "killed_during" in r else "ERROR"
        print(
            f"{r['case']:<12} {r['method']:<9} {r['exit_code']:>4} "
            f"{_cell(fp16_steps_s(r) if 'timings_s' in r else None, '10.1f')} "
            f"{_cell(r.get('timings_s', {}).get('compression: fp16 baselines'), '9.1f')} "
            f"{_cell(own[1] if own else None, '11.1f')} "
            f"{_cell(timings.get(f'{case}: compress'), '8.1f')} "
            f"{_cell(timings.get(f'{case}: parity (torch, MIL)'), '7.1f')} "
            f"{_cell(variant_s(r) if timed else None, '7.1f')} "
            f"{r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['peak_rss_gib']:>8.2f} "
            f"{_cell(r.get('stored_ratio'), '6.3f')} {_cell(r.get('compressed_ratio'), '6.3f')}"
            f"  {gates}"
        )
    print(
        "seconds, wall clock on a shared machine. fp16 steps: the fp16 artifact's steps; "
        "baselines: the compression baselines; method step: "
        + ", ".join(f"{m} inside compress" for m in sorted(INSIDE_COMPRESS))
        + ", the others before it; variant: all the variant's steps (a nested step once); "
        "wall / CPU: the whole process. stored: every weight byte the variant's package "
        "stores over the fp16 package's (the LM head, embedding rows and norms stay fp16: "
        "keep_fp16 default); compr.: the compressed weights alone. Gates on random weights "
        "are not a quality figure."
    )
    print("\nvariant steps as the pipeline records them (timings_s, s):")
    for r in rows:
        steps = variant_steps(r)
        if steps:
            print(f"  {r['case']}: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    print("\nhighest sampled RSS per step (GiB, sampled once a second: lower bounds):")
    for r in rows:
        peaks = r.get("step_peak_rss_gib", {})
        if r["case"] != "fp16":  # the fp16 artifact's steps are the fp16 row's
            peaks = {k: v for k, v in peaks.items() if k.startswith((f"{r['case']}:", "compr"))}
        print(f"  {r['case']}: " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items()))
    for r in rows:
        if "error" in r:
            print(f"\n{r['case']}: exit {r['exit_code']}:\n{r['error']}")
    print(f"\npeak RSS limit {LIMIT_GIB:.0f} GiB (issue 12), printed, not asserted:")
    for r in rows:
        verdict = "under" if r["peak_rss_gib"] < LIMIT_GIB else "OVER"
        if "killed_during" in r:
            verdict = f"OVER: killed in {r['killed_during']} ({r['error'].split(' (')[0]})"
        print(f"  {r['case']:<12} {r['peak_rss_gib']:>6.2f} GiB  {verdict}")


def cmd_methods(args: argparse.Namespace) -> None:
    """Build (or reuse) the checkpoint, then run every chosen case one after another (or,
    with ``--report``, print the table of an earlier run's JSON)."""
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        info = doc["checkpoint"]
        print(f"{args.report}: {info['layers']} layers, {info['parameters'] / 1e6:.0f}M parameters")
        print_table(doc["cases"])
        return
    cases = args.method or list(VARIANTS)
    root = Path(args.work or tempfile.mkdtemp(prefix="anec-methods-"))
    checkpoint = root / f"ckpt-{args.layers}"
    info = ensure_checkpoint(checkpoint, args.layers)
    print(
        f"checkpoint {checkpoint}: {info['layers']} layers, {info['parameters'] / 1e6:.0f}M "
        f"parameters ({info['q4_1_parameters'] / 1e6:.0f}M Q4_1-projected), built in "
        f"{info['build_s']} s{' (reused)' if info['reused'] else ''}",
        flush=True,
    )
    rows = []
    for case in cases:
        recipe = root / f"{case}.yaml"
        recipe.write_text(recipe_text(case, checkpoint, info["vocab"]), encoding="utf-8")
        print(f"running {case} ...", file=sys.stderr, flush=True)
        row = run_case(case, recipe, root / f"out-{case}", args.cap_gib)
        print(
            f"  {case}: exit {row['exit_code']} in {row['wall_s']:.0f} s, peak "
            f"{row['peak_rss_gib']:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
        if args.json:  # written after every case: a long run keeps what it measured
            doc = {"checkpoint": info, "work": str(root), "cases": rows}
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print_table(rows)
    print(f"cpus: {os.cpu_count()}; work directory {root}")


def add_parser(sub: Any) -> None:
    """The ``methods`` subcommand of bench/compress.py."""
    p = sub.add_parser("methods", help="each method's time and peak memory, Qwen2.5-0.5B shape")
    p.add_argument("--layers", type=int, default=24, help="decoder layers (default: all 24)")
    p.add_argument("--method", action="append", choices=list(VARIANTS), help="repeatable")
    p.add_argument("--work", help="directory for the checkpoint, recipes and outputs (kept)")
    p.add_argument("--cap-gib", type=float, default=16.0, help="kill a case above this RSS")
    p.add_argument("--json", help="write every figure here (after each case)")
    p.add_argument("--report", help="print the table of an earlier run's --json file")


if __name__ == "__main__" and sys.argv[1:2] == ["_build"]:
    sys.path.insert(0, str(REPO))
    built = build_checkpoint(Path(sys.argv[2]), int(sys.argv[3]))
    (Path(sys.argv[2]) / "bench_checkpoint.json").write_text(json.dumps(built) + "\n")
