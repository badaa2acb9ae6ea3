"""``io.output: argmax | topk``: the in-model choice per LM-head chunk, on a tiny cached Llama.

One state-style conversion with ``io.output: argmax`` (16 decode steps) serves the module: its
gates (the choice against the program's own logits included), the manifest's head_output
section, plan-inspect's placement of the argmax, and ``anec generate``'s host loop driven by
the argmax outputs alone. The window forms (argmax, top-k) run through the MIL gates in
tests/test_mil_coverage.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import one_torch_thread, run_anec, save_tiny_llama, write_tiny_recipe

from graph_passes.logits_layout import choose, top_ids

CACHE = "cache:\n  style: state\n  length: 96\n  prefill: 8\n  extend: 4\n  decode_steps: 16\n"
CHUNKS = [128, 128, 44]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("head")
    ckpt = save_tiny_llama(root / "ckpt")
    extra = "target: macOS15\n" + CACHE
    recipe = write_tiny_recipe(
        root / "r.yaml", ckpt, "tiny-argmax", io={"output": "argmax"}, extra=extra
    )
    result = run_anec("convert", recipe, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / "tiny-argmax"


def test_the_cache_gates_ran_on_the_programs_own_logits_and_the_choice_matched(
    artifact: Path,
) -> None:
    gates = {g["name"]: g for g in json.loads((artifact / "parity.json").read_text())["gates"]}
    assert gates["kv_head_choice_mismatches"]["passed"]
    assert gates["kv_head_choice_mismatches"]["value"] == 0
    assert "positions" in gates["kv_head_choice_mismatches"]["detail"]
    assert gates["kv_argmax_flips"]["passed"] and gates["kv_fp32_max_abs_logit_error"]["passed"]


def test_anec_parity_reruns_the_choice_gate(artifact: Path, tmp_path: Path) -> None:
    result = run_anec("parity", artifact, "--out", tmp_path / "re", "--profile", "fp16")
    assert result.exit_code == 0, result.output
    gates = json.loads((tmp_path / "re" / "parity.json").read_text())["gates"]
    assert {"kv_head_choice_mismatches", "same_gate_set"} <= {g["name"] for g in gates}


def test_the_manifest_says_how_the_host_combines_the_chunks(artifact: Path) -> None:
    doc = json.loads((artifact / "manifest.json").read_text())
    head = doc["head_output"]
    assert head["choice"] == "argmax" and head["chunk_offsets"] == [0, 128, 256]
    assert "largest" in head["combine"]
    # 3 chunks x (int32 index + fp16 value) per position; extend returns 4 positions
    assert head["bytes_per_call"]["decode"] == {"dense": 18, "ne_rows": 384}
    assert head["bytes_per_call"]["extend"]["dense"] == 72
    outputs = doc["kv_cache"]["functions"]["extend"]["outputs"]
    assert [(o["name"], o["shape"], o["dtype"]) for o in outputs[:2]] == [
        ("argmax_index_0", [1, 4, 1, 1], "int32"),
        ("argmax_value_0", [1, 4, 1, 1], "float16"),
    ]


def test_plan_inspect_places_the_argmax_off_the_ne_and_says_so(artifact: Path) -> None:
    from converter.placement.ops import op_table
    from converter.placement.static import static_report
    from parity.mil.program import load_package

    table = op_table(load_package(artifact / "tiny-argmax.mlpackage"))
    report = static_report(table, "tiny-argmax.mlpackage", "-", "M1")
    decode = next(f for f in report.functions if f.name == "decode")
    argmax = [r for r in decode.rows if r.op_type == "reduce_argmax"]
    assert len(argmax) == 3 and all(r.device == "CPU" for r in argmax)
    assert all(r.rule == "R-INT" and r.also == "O-TOPK" for r in argmax)  # both rules agree
    assert decode.summary.ne_segments > 1  # reported, not hidden


def _outputs_only(make):  # type: ignore[no-untyped-def]
    """Sessions whose runner hides the captured logits, as Core ML returns only the outputs."""

    def session():  # type: ignore[no-untyped-def]
        s = make()
        run = s.runner
        s.runner = lambda f, x: {k: v for k, v in run(f, x).items() if not k.startswith("logits_")}
        return s

    return session


def test_generate_runs_on_the_argmax_outputs_alone(artifact: Path) -> None:
    """A runner that hides the captured logits (as Core ML returns only the outputs): the
    host loop combines the argmax chunks and still follows transformers' greedy path."""
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, greedy, mil_backend
    from parity.reference import greedy_ids

    outputs_only = _outputs_only(mil_backend(Runtime.from_artifact(artifact)))
    prompt = [1, 2, 3, 4, 5]
    got = greedy(outputs_only, prompt, 24)
    assert got.new_ids == greedy_ids(tiny_hf_model("llama"), tuple(prompt), 24)


def test_the_core_ml_host_loop_runs_on_the_argmax_outputs(artifact: Path) -> None:
    """coreml_backend against a stand-in of MLModel / MLState (tests/coreml_standin.py),
    which returns the program's outputs alone, as Core ML does: transformers' greedy path."""
    from coreml_standin import StandInLoader
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, coreml_backend, greedy
    from parity.reference import greedy_ids

    make = coreml_backend(Runtime.from_artifact(artifact), "CPU_AND_NE", StandInLoader())
    got = greedy(make, [1, 2, 3, 4, 5], 24)
    assert got.new_ids == greedy_ids(tiny_hf_model("llama"), (1, 2, 3, 4, 5), 24)


def test_speculate_drafts_from_the_argmax_outputs_alone(artifact: Path) -> None:
    """A draft that returns only the in-model argmax per chunk (what a Core ML draft gives):
    speculative decoding drafts and absorbs from the chosen ids, and its output is still the
    target's greedy continuation."""
    from functools import partial

    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, mil_backend
    from converter.drafts.speculation import Acceptance, speculate, target_tokens
    from parity.reference import greedy_ids

    outputs_only = _outputs_only(mil_backend(Runtime.from_artifact(artifact)))
    target = tiny_hf_model("llama")
    stats = Acceptance(3)
    prompt = [7, 8, 9, 10]
    new = speculate(outputs_only, partial(target_tokens, target), prompt, 3, 12, stats)
    assert new == greedy_ids(target, tuple(prompt), 12)
    assert stats.cycles > 0 and stats.rate(0) > 0.5


def test_a_wrong_choice_is_a_mismatch_naming_the_position() -> None:
    """The check's teeth: the program's logits say one id, the returned argmax another."""
    from parity.head_outputs import ChoiceCheck

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, 1, sum(CHUNKS), generator=gen)
    parts = logits.split(CHUNKS, dim=-1)
    outputs = {f"logits_{k}": p.numpy() for k, p in enumerate(parts)}
    for k, p in enumerate(parts):
        index, value = choose(p, "argmax", 0)
        outputs[f"argmax_index_{k}"], outputs[f"argmax_value_{k}"] = index.numpy(), value.numpy()
    good = ChoiceCheck(CHUNKS)
    good.see(outputs, "call 0")
    assert good.positions == 2 and not good.mismatches
    best = int(top_ids(outputs, CHUNKS)[0, 1, 0])
    k = next(i for i in range(3) if sum(CHUNKS[: i + 1]) > best)
    outputs[f"argmax_index_{k}"] = outputs[f"argmax_index_{k}"].copy()
    outputs[f"argmax_index_{k}"][0, 1, 0, 0] = (best - sum(CHUNKS[:k]) + 1) % CHUNKS[k]
    bad = ChoiceCheck(CHUNKS)
    bad.see(outputs, "call 0")
    assert len(bad.mismatches) == 1 and "call 0 row 0 slot 1" in bad.mismatches[0]


def test_top_k_candidates_combine_to_the_global_top_k() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 1, sum(CHUNKS), generator=gen).half().float()
    logits[0, 0, 0, 5] = logits[0, 0, 0, 200] = 9.0  # a tie across chunks: the lower id first
    parts = logits.split(CHUNKS, dim=-1)
    full = {f"logits_{k}": p.numpy() for k, p in enumerate(parts)}
    chosen = {}
    for k, p in enumerate(parts):
        index, value = choose(p, "topk", 6)
        chosen[f"topk_index_{k}"], chosen[f"topk_value_{k}"] = index.numpy(), value.numpy()
    assert np.array_equal(top_ids(chosen, CHUNKS, 6), top_ids(full, CHUNKS, 6))
    assert top_ids(chosen, CHUNKS, 2)[0, 0].tolist() == [5, 200]


def test_top_k_above_the_smallest_chunk_is_refused_naming_the_key(tmp_path: Path) -> None:
    ckpt = save_tiny_llama(tmp_path / "ckpt")
    recipe = write_tiny_recipe(tmp_path / "r.yaml", ckpt, "k", io={"output": "topk", "top_k": 50})
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "io.top_k: 50 exceeds the smallest LM-head chunk (44 tokens" in result.output
    assert not (tmp_path / "out" / "k").exists()


@pytest.mark.parametrize(
    ("io", "message"),
    [
        ({"output": "topk"}, "expected a k for io.output: topk"),
        ({"top_k": 4}, "applies to io.output: topk only"),
        ({"output": "sample"}, "output"),
    ],
)
def test_recipe_rules_of_the_output_choice(tmp_path: Path, io: dict, message: str) -> None:
    from converter.recipe import RecipeError, load_recipe

    recipe = write_tiny_recipe(tmp_path / "r.yaml", tmp_path, "r", io=io)
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe)


def test_extend_drift_refuses_an_argmax_artifact_naming_the_choice(artifact: Path) -> None:
    from converter.errors import InputError
    from converter.placement.extend_drift import record_drift

    with pytest.raises(InputError, match="head_output.choice is argmax"):
        record_drift(artifact, ["CPU_AND_NE"], 4, "mil")
