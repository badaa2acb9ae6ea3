"""Cached draft decoders against the window program, per model shape, in one run.

    python bench/kv.py                       # SmolLM2 (packaged checkpoint), Qwen2.5-0.5B and
                                             # Qwen3-0.6B shapes (random weights), full depth
    python bench/kv.py --layers 2 --case smollm2 --json /tmp/kv.json

For each case it builds the window module (64-token window, host embeddings, one logit) and
the cached functions (state style, cache 512, prefill 64, extend 4), converts all four, and
prints:

* package bytes: each single-function package and the multifunction one (measured on disk);
* output bytes per call for each output choice (computed from the shapes: fp16 logits, or an
  int32 index and an fp16 value per LM-head chunk and position for in-model argmax, or k of
  each for top-k; the io style adds the new K/V rows), with the 64-byte NE rows of the
  vocabulary-last logits and of schema 2's (1, V_k, 1, n) layout (one row per logit) beside;
* the window program converted once per output choice (logits, argmax, top-8): the plan's
  output bytes per call and NE segments, and the device plan-inspect predicts for the argmax
  / top-k ops (static placement, M1);
* live MIL ops per layer of the decode function and of the window program (measured);
* predicted per-token floors per chip (`converter.placement.cost`, static placement: a model, not a
  measurement) for the decode function and the window program's per-call floor.

Random weights are fine for sizes, ops and floors (nothing here depends on their values); the
parity of real weights is `anec convert recipes/smollm2-135m-draft-kv.yaml`'s job.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "tests" / "data" / "configs"
CASES = ("smollm2", "qwen2.5-0.5b", "qwen3-0.6b")
CACHE, PREFILL, EXTEND, WINDOW, TOP_K = 512, 64, 4, 64, 8
CHOICE_OPS = ("reduce_argmax", "reduce_max", "topk")


def load_model(case: str, layers: int | None) -> Any:
    """The transformers model of a case (SmolLM2 from its package; Qwen shapes random)."""
    import torch
    import transformers

    if case == "smollm2":
        from converter.checkpoints.loading import load_checkpoint
        from converter.recipe import load_recipe, locate_recipe

        recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
        model = load_checkpoint(recipe.resolve_source(), recipe.task).model
        if layers:
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
        return model.float().eval()
    data = json.loads((CONFIGS / f"{case}.json").read_text())
    if layers:
        data["num_hidden_layers"] = layers
    config = transformers.AutoConfig.for_model(**data)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def output_bytes(chunks: list[int], positions: int, rows: int) -> dict[str, Any]:
    """Bytes one call returns for each output choice (computed from shapes: fp16 values,
    int32 indices; ``+ rows`` the io style's new K/V rows): dense, and in 64-byte NE rows for
    the vocabulary-last logits; schema 2's (1, V_k, 1, n) rows beside them for comparison."""
    from converter.tasks.decoder_contract import head_bytes

    vocab = sum(chunks)
    logits = head_bytes(chunks, positions, "logits", 0)
    argmax = head_bytes(chunks, positions, "argmax", 1)
    topk = head_bytes(chunks, positions, "topk", TOP_K)
    return {
        "logits": logits["dense"] + rows,
        "logits_ne_rows_64B": logits["ne_rows"] + rows,
        "logits_schema2_ne_rows_64B": 64 * vocab * positions + rows,
        "argmax_per_chunk": argmax["dense"] + rows,
        f"top{TOP_K}_per_chunk": topk["dense"] + rows,
    }


def window_choices(window: Any, target: Any) -> dict[str, Any]:
    """Convert the window program once per output choice; from each real conversion the
    plan's output bytes per call (64-byte rows where the NE writes them), NE segments and the
    device plan-inspect predicts for the choice's ops (static placement, chip M1)."""
    import dataclasses

    from converter.coreml.program import to_mlprogram, trace
    from converter.placement.ops import op_table
    from converter.placement.static import static_report
    from converter.tasks.decoder_contract import tensor_contract

    base = window.io
    out: dict[str, Any] = {}
    for choice in ("logits", "argmax", "topk"):
        window.io = dataclasses.replace(base, output=choice, top_k=TOP_K if choice == "topk" else 0)
        try:
            ins, outs = tensor_contract(window, "float16")
            ml = to_mlprogram(trace(window, ins), ins, outs, target, "float16")
        finally:
            window.io = base
        function = static_report(op_table(ml._mil_program), choice, "-", "M1").functions[0]
        ops = {r.op_type: r.device for r in function.rows if r.op_type in CHOICE_OPS}
        out[choice] = {
            "plan_output_bytes": function.summary.output_bytes,
            "ne_segments": function.summary.ne_segments,
            "choice_op_devices": ops,
        }
    return out


def run_case(case: str, layers: int | None, out: Path) -> dict[str, Any]:
    """Convert the window program and the cached functions of one case; measure them."""
    import coremltools as ct
    import torch

    from converter.coreml.program import live_ops, to_mlprogram, trace
    from converter.placement.chips import chips_for
    from converter.placement.cost import floor
    from converter.placement.ops import op_table
    from converter.placement.static import static_report
    from converter.tasks.decoder_contract import tensor_contract
    from converter.tasks.kv_contract import function_calls
    from converter.tasks.text_generation_kv import emit_functions
    from graph_passes.archs import adapt
    from graph_passes.cached_decoder import cached_functions
    from graph_passes.decoder import BC1LDecoder, DecoderIO
    from parity.mil.program import load_package

    torch.set_num_threads(1)
    started = time.time()
    model = load_model(case, layers)
    canonical = adapt(model.config, model.state_dict())
    spec = canonical.spec
    window = BC1LDecoder(canonical, DecoderIO(1, WINDOW, "embeddings", 1, 16384)).eval()
    target = ct.target.macOS15
    ins, outs = tensor_contract(window, "float16")
    window_ml = to_mlprogram(trace(window, ins), ins, outs, target, "float16")
    window_ops = sum(live_ops(window_ml).values())
    calls = function_calls(PREFILL, EXTEND)
    functions = cached_functions(window, "state", CACHE, calls)
    folder = out / case
    folder.mkdir(parents=True)
    emitted = emit_functions(functions, "float16", "float16", target, folder / f"{case}.mlpackage")
    program = load_package(emitted.package)
    n = spec.num_layers
    decode_ops = sum(1 for op in program.functions["decode"].operations if op.op_type != "const")
    chunks = window.chunk_sizes
    first = functions["decode"]
    row_bytes = {name: 2 * m.rows_shape()[0] * m.rows_shape()[1] * m.io.tokens * m.rows_shape()[3]
                 for name, m in functions.items()}  # fmt: skip
    outputs = {
        name: {
            "state": output_bytes(chunks, t if lg == "all" else 1, 0),
            "io": output_bytes(chunks, t if lg == "all" else 1, row_bytes[name]),
        }
        for name, (t, lg) in calls.items()
    }
    floors: dict[str, dict[str, float]] = {}
    table = op_table(program)
    window_table = op_table(window_ml._mil_program)
    for chip in chips_for("macOS") + chips_for("iOS"):
        report = static_report(table, emitted.package.name, "-", chip.name)
        window_report = static_report(window_table, "window", "-", chip.name)
        by_name = {f.name: f for f in report.functions}
        floors[chip.name] = {
            "decode_ms": floor(by_name["decode"], chip).ms,
            "extend_ms_per_call": floor(by_name["extend"], chip).ms,
            "window_ms_per_call": floor(window_report.functions[0], chip).ms,
        }
    return {
        "case": case,
        "layers": n,
        "cache_shape": list(first.cache_shape()),
        "sizes": emitted.sizes,
        "ops_per_layer": {"decode": decode_ops / n, "window": window_ops / n},
        "output_bytes_per_call": outputs,
        "window_output_choices": window_choices(window, target),
        "predicted_floors": floors,
        "seconds": time.time() - started,
    }


def print_case(r: dict[str, Any]) -> None:
    """The case's figures as plain lines."""
    s = r["sizes"]
    print(
        f"\n== {r['case']} ({r['layers']} layers, cache {r['cache_shape']}, {r['seconds']:.0f} s)"
    )
    singles = ", ".join(f"{k} {v:,}" for k, v in s["single_function_package_bytes"].items())
    multi = s["multifunction_package_bytes"]
    print(f"package bytes (measured): single {singles}; multifunction {multi:,}")
    print(f"  multifunction / largest single: {s['package_ratio']:.4f}")
    ops = r["ops_per_layer"]
    print(f"live ops per layer (measured): decode {ops['decode']:.1f}, window {ops['window']:.1f}")
    print("output bytes per call (computed from shapes):")
    for name, styles in r["output_bytes_per_call"].items():
        for style, choices in styles.items():
            text = ", ".join(f"{k} {v:,}" for k, v in choices.items())
            print(f"  {name:8s} {style:5s} {text}")
    print("window program per output choice (converted; plan-inspect static, M1):")
    for choice, w in r["window_output_choices"].items():
        devices = ", ".join(f"{op} {dev}" for op, dev in w["choice_op_devices"].items()) or "-"
        print(f"  {choice:7s} output bytes/call {w['plan_output_bytes']:,}  "
              f"NE segments {w['ne_segments']}  choice ops: {devices}")  # fmt: skip
    print("predicted per-token floors, ms (cost model, static placement; not measured):")
    for chip, f in r["predicted_floors"].items():
        extend, window = f["extend_ms_per_call"], f["window_ms_per_call"]
        print(f"  {chip:10s} decode {f['decode_ms']:.3f}  extend(K={EXTEND}) {extend:.3f}/call"
              f"  window(64) {window:.3f}/call")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", choices=CASES)
    parser.add_argument("--layers", type=int, default=None, help="truncate every model")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.case or CASES:
            results.append(run_case(case, args.layers, Path(tmp)))
            print_case(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
