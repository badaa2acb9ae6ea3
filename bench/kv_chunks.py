"""How a weight budget splits full-depth cached decoders into chunk packages, from the config.

    python bench/kv_chunks.py                      # Qwen2.5-0.5B and Qwen3-0.6B, iOS and macOS
    python bench/kv_chunks.py --budget-mb 300 --json /tmp/chunks.json

Nothing is converted: each config's model is built by transformers on the meta device (shapes
only, no weights), adapted by anec's architecture file, and its parameters are counted as the
BC1L program stores them (fp16; tied embeddings: the table stays on the host, as
``io.inputs: auto`` does, and the LM head is a program constant). `converter.tasks.kv_chunks.
split_layers` then splits the layers within each budget (the defaults: 1000 MB for iOS
targets, 2000 MB for macOS) and the table gives the chunk count, the layers and stored weight
bytes of each chunk, and the bytes one call passes from a chunk to the next (the fp16 stream
(1, D, 1, T): T = 1 for decode, the prefill and extend widths of the shipped kv recipe).
These are computed figures, not measurements of converted packages; the fast test
(tests/test_kv_chunks_pipeline.py) checks on converted tiny packages that the stored weight
files stay within the budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "tests" / "data" / "configs"
CASES = {"qwen2.5-0.5b": "qwen2.5-0.5b.json", "qwen3-0.6b": "qwen3-0.6b.json"}
CALLS = {"decode": 1, "extend": 4, "prefill": 64}  # tokens per call (recipes/*-kv.yaml)


def stored_bytes(config_file: Path) -> tuple[Any, Any]:
    """(WeightBytes of the BC1L program in fp16, hidden size) from a config alone."""
    import torch
    import transformers

    from converter.tasks.kv_chunks import weight_bytes
    from graph_passes.archs import adapt

    config = transformers.AutoConfig.for_model(**json.loads(config_file.read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor; adapt compares them otherwise
    canonical = adapt(model.config, state)
    named = [(n, w.numel()) for n, w in canonical.weights.items()]
    if canonical.spec.tied_embeddings:  # the program's LM head is its own constant
        named.append(("lm_head.weight", canonical.lm_head_weight().numel()))
    # io.inputs auto: tied embeddings are gathered on the host, untied ones in the program
    in_program = not canonical.spec.tied_embeddings
    w = weight_bytes(named, canonical.spec.num_layers, "float16", in_program)
    return w, canonical.spec.hidden_size


def split_rows(case: str, budgets: dict[str, int]) -> list[dict[str, Any]]:
    """One row per budget: the chunks and what passes between them."""
    from converter.errors import InputError
    from converter.tasks.kv_chunks import split_layers

    w, hidden = stored_bytes(CONFIGS / CASES[case])
    rows = []
    for label, budget in budgets.items():
        try:
            chunks = split_layers(w, budget)
        except InputError as e:  # a layer (or the head) alone exceeds it: the refusal
            rows.append({"case": case, "budget": label, "budget_bytes": budget,
                         "total_weight_bytes": w.total, "refused": str(e)})  # fmt: skip
            continue
        rows.append(
            {
                "case": case,
                "budget": label,
                "budget_bytes": budget,
                "total_weight_bytes": w.total,
                "chunks": [
                    {"layers": [c.start, c.stop], "weight_bytes": c.weight_bytes} for c in chunks
                ],
                "passed_per_call": {
                    name: (len(chunks) - 1) * hidden * t * 2 for name, t in CALLS.items()
                },
                "passed_per_boundary": {name: hidden * t * 2 for name, t in CALLS.items()},
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as the markdown table bench/README.md carries."""
    lines = [
        "| shape | budget | stored weights | chunks | layers per chunk | bytes per chunk | "
        "passed per boundary per call (decode / extend 4 / prefill 64) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['case']} | {r['budget']} | {r['total_weight_bytes']:,} | "
                         f"refused: {r['refused']} | | | |")  # fmt: skip
            continue
        layers = ", ".join(f"{a}-{b - 1}" for a, b in (c["layers"] for c in r["chunks"]))
        sizes = ", ".join(f"{c['weight_bytes']:,}" for c in r["chunks"])
        p = r["passed_per_boundary"]
        passed = (
            "-"
            if len(r["chunks"]) == 1
            else (f"{p['decode']:,} / {p['extend']:,} / {p['prefill']:,}")
        )
        lines.append(
            f"| {r['case']} | {r['budget']} | {r['total_weight_bytes']:,} | {len(r['chunks'])} "
            f"| {layers} | {sizes} | {passed} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, action="append", help="extra budgets (MB)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    from converter.coreml.targets import package_budget_bytes

    budgets = {
        "iOS (1000 MB)": package_budget_bytes(None, "iOS"),
        "macOS (2000 MB)": package_budget_bytes(None, "macOS"),
    }
    for mb in args.budget_mb or []:
        budgets[f"{mb:g} MB"] = package_budget_bytes(mb, "macOS")
    rows = [row for case in CASES for row in split_rows(case, budgets)]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
