"""``anec convert`` of a cached decoder recipe (cache.style state) on a tiny Llama: one
multifunction package whose every function passes the cache gates, a manifest a host loop can
run from, and the recipe rules of the cache section."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from tiny_models import run_anec, save_tiny_llama, write_tiny_recipe

from converter.recipe import RecipeError, load_recipe
from converter.tasks import task_of
from parity.mil import load_package

CACHE = "cache:\n  style: {style}\n  length: 96\n  prefill: 8\n  extend: 4\n  decode_steps: 64\n"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny state-style conversion for every test here (about 30 s)."""
    root = tmp_path_factory.mktemp("kv")
    ckpt = save_tiny_llama(root / "ckpt")
    extra = "target: macOS15\n" + CACHE.format(style="state")
    recipe = write_tiny_recipe(root / "kv.yaml", ckpt, "tiny-kv", extra=extra)
    result = run_anec("convert", recipe, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / "tiny-kv"


def test_every_cache_gate_ran_and_passed(artifact: Path) -> None:
    parity = json.loads((artifact / "parity.json").read_text())
    gates = {g["name"]: g for g in parity["gates"] if g["level"] == "kv-cache"}
    assert set(gates) == {
        # the fp32 cache level: the conversion's cache logic, strictly
        "fp32_layer_rel_error", "fp32_logits_rel_error", "kv_fp32_max_abs_logit_error",
        "kv_fp32_extend_max_abs_diff", "kv_fp32_stale_max_abs_diff",
        # fp16, by what a draft's user sees
        "kv_max_abs_dprob", "kv_finite_outputs", "kv_argmax_flips", "kv_extend_argmax_flips",
        "kv_stale_max_abs_diff", "kv_weights_stored_once",
    }  # fmt: skip
    assert all(g["passed"] for g in gates.values())
    assert gates["kv_max_abs_dprob"]["threshold"] == 0.03
    detail = json.loads((artifact / "kv_parity.json").read_text())
    assert [row["decode_steps"] for row in detail["fixtures"]] == [64, 64]
    # the fp16 logit error is reported, not gated
    drift = detail["fp16_logit_error"]
    assert drift["gated"] is False and drift["decode_vs_reference"]["positions"] == 2 * 65
    assert detail["rule"].startswith("2026-12-05") and parity["kv_cache_rule"] == detail["rule"]
    # the levels table says what ran: each function per layer and the cache level, not a
    # failed torch level
    statuses = {(lv["level"], lv["implementation"]): lv["status"] for lv in parity["levels"]}
    assert statuses.pop(("rewrite", "torch-fp16")).startswith("not run: on demand"), statuses
    assert set(statuses.values()) == {"run"}, statuses
    assert {level for level, _ in statuses} == {"rewrite", "mil-fp32", "kv-cache"}, statuses
    per_layer = {g["name"]: g for g in parity["gates"] if g["level"] == "mil-fp32"}
    assert set(per_layer) == {"layer_markers_present", "mil_fp32_layer_rel_error"}
    assert all(g["passed"] for g in per_layer.values())


def test_anec_parity_reruns_every_published_gate(artifact: Path, tmp_path: Path) -> None:
    result = run_anec("parity", artifact, "--out", tmp_path / "re", "--profile", "fp16")
    assert result.exit_code == 0, result.output
    gates = json.loads((tmp_path / "re" / "parity.json").read_text())["gates"]
    names = {g["name"] for g in gates}
    assert "same_gate_set" in names and "kv_stale_max_abs_diff" in names


def test_one_package_holds_every_function_and_stores_weights_once(artifact: Path) -> None:
    program = load_package(artifact / "tiny-kv.mlpackage")
    assert sorted(program.functions) == ["decode", "extend", "prefill"]
    from coremltools.converters.mil.mil import types

    inputs = program.functions["decode"].inputs.values()
    assert [v.name for v in inputs if types.is_state(v.sym_type)] == ["kv_cache"]
    ops = {op.op_type for f in program.functions.values() for op in f.operations}
    assert "slice_update" not in ops  # folded by anec::fold_whole_slice_update
    sizes = json.loads((artifact / "manifest.json").read_text())["kv_cache"]["sizes"]
    weights = sizes["single_function_weight_bytes"]
    assert sizes["multifunction_weight_bytes"] == max(weights.values())
    assert not (artifact / "functions.tmp").exists()


def test_every_function_attends_to_the_cache_as_it_is_held(artifact: Path) -> None:
    # Their tokens are written into their slots before attending: every softmax runs over the
    # 96 slots alone (no new keys concatenated after them) and no op transposes the cache.
    program = load_package(artifact / "tiny-kv.mlpackage")
    for name in ("prefill", "decode", "extend"):
        ops = program.functions[name].operations
        softmax = [op.inputs["x"].shape for op in ops if op.op_type == "softmax"]
        assert softmax and all(shape[1] == 96 for shape in softmax), (name, softmax)
        copies = [op.name for op in ops if op.op_type == "transpose" and 96 in op.inputs["x"].shape]
        assert not copies, (name, copies)


def test_the_plan_reports_every_function_its_state_traffic_and_ops_per_layer(
    artifact: Path,
) -> None:
    plan = json.loads((artifact / "plan.json").read_text())
    functions = {f["name"]: f["summary"] for f in plan["functions"]}
    assert list(functions) == ["prefill", "decode", "extend"]
    cache = 6 * 2 * 96 * 16 * 2  # (2N, KV, S, d) fp16: read and written back by every call
    for name, summary in functions.items():
        assert summary["state_read_bytes"] == summary["state_write_bytes"] == cache, name
        assert summary["ne_segments"] == 1 and summary["layers"] == 3, name
        assert summary["ops_per_layer"] == summary["layer_ops"] / 3
    text = (artifact / "plan.txt").read_text()
    assert "function decode:" in text and "36 KiB written" in text


def test_the_manifest_describes_every_function_and_the_cache(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    assert manifest["package"]["function"] == "decode"  # the package's default function
    assert kv["style"] == "state" and kv["cache_length"] == 96
    assert kv["cache"]["shape"] == [6, 2, 96, 16] and kv["cache"]["dtype"] == "float16"
    tokens = {name: f["tokens"] for name, f in kv["functions"].items()}
    assert tokens == {"prefill": 8, "decode": 1, "extend": 4}
    decode = {t["name"]: t for t in kv["functions"]["decode"]["inputs"]}
    # Every function writes its tokens into their slots before attending: the masks' keys
    # are the 96 slots alone.
    assert decode["mask"]["shape"] == [1, 96, 1, 1]
    assert decode["write_slots"]["shape"] == [1, 1, 96, 1]
    for key in ("position", "mask", "eviction", "rollback"):
        assert kv["conventions"][key]
    rope = np.load(artifact / kv["rope"]["file"])
    assert rope.shape == (1, 2, 16, 96)


def test_every_function_returns_logits_with_the_vocabulary_last(
    artifact: Path, tmp_path: Path
) -> None:
    """Schema 3: (1, n, 1, V_k) per chunk for every function; a schema 2 manifest (logits
    (1, V_k, 1, n)) is refused by the host loop, naming the file and the version."""
    from converter.drafts.host_loop import Runtime
    from converter.errors import InputError

    doc = json.loads((artifact / "manifest.json").read_text())
    functions = doc["kv_cache"]["functions"]
    for name, n in (("prefill", 1), ("decode", 1), ("extend", 4)):
        shapes = [o["shape"] for o in functions[name]["outputs"]]
        assert shapes == [[1, n, 1, 128], [1, n, 1, 128], [1, n, 1, 44]], name
    assert "[batch, position, 0, token]" in doc["kv_cache"]["conventions"]["logits"]
    doc["schema_version"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match="manifest schema_version 2 .*vocabulary last"):
        Runtime.from_artifact(tmp_path)


def test_the_host_builds_each_functions_masks_as_its_manifest_shapes_them(
    artifact: Path, tmp_path: Path
) -> None:
    """Schema 5 masks of the 96 slots alone for the functions that write in place; a schema 4
    artifact's masks (96 + T keys in every function) still get masks of that shape."""
    import shutil

    from converter.drafts.host_loop import Runtime
    from graph_passes.cache_host import call_inputs

    def mask_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
        runtime = Runtime.from_artifact(directory)
        return {
            name: call_inputs(f.shape, 0, 1, runtime.rope)["mask"].shape
            for name, f in runtime.functions.items()
        }

    assert mask_shapes(artifact) == {
        "prefill": (1, 96, 1, 8), "decode": (1, 96, 1, 1), "extend": (1, 96, 1, 4),
    }  # fmt: skip
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    doc = json.loads((old / "manifest.json").read_text())
    doc["schema_version"] = 4
    for function in doc["kv_cache"]["functions"].values():
        for tensor in function["inputs"]:
            if tensor["name"].startswith("mask"):
                tensor["shape"][1] = 96 + tensor["shape"][3]
    (old / "manifest.json").write_text(json.dumps(doc))
    assert mask_shapes(old) == {
        "prefill": (1, 104, 1, 8), "decode": (1, 97, 1, 1), "extend": (1, 100, 1, 4),
    }  # fmt: skip


def test_the_host_loop_from_the_manifest_alone_matches_transformers(artifact: Path) -> None:
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, greedy, mil_backend
    from parity.reference import greedy_ids

    runtime = Runtime.from_artifact(artifact)
    make = mil_backend(runtime)
    prompt = [1, 2, 3, 4, 5]
    got = greedy(make, prompt, 100)
    # The first 91 tokens fit the 96 slots; then the host evicts (keeps the last 88 tokens
    # and prefills them again), after which the context differs from transformers' own.
    assert got.new_ids[:91] == greedy_ids(tiny_hf_model("llama"), tuple(prompt), 91)
    assert got.evictions == 1 and len(got.new_ids) == 100


def test_speculative_decoding_reproduces_the_target_and_counts_acceptance(
    artifact: Path,
) -> None:
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, mil_backend
    from converter.drafts.speculation import Acceptance, speculate, target_tokens
    from parity.reference import greedy_ids

    target = tiny_hf_model("llama")
    make = mil_backend(Runtime.from_artifact(artifact))
    k = 3
    stats = Acceptance(k)
    prompt = [7, 8, 9, 10]
    new = speculate(make, partial(target_tokens, target), prompt, k, 20, stats)
    assert new == greedy_ids(target, tuple(prompt), 20)
    assert stats.tokens == 20 and stats.target_calls == stats.cycles
    # The draft is the target in fp16: self-acceptance is high but measured, not assumed.
    assert stats.rate(0) > 0.8 and stats.tokens_per_call >= 1.0


def test_the_torch_backend_drafts_as_the_program_does(artifact: Path) -> None:
    """``anec speculate``'s default draft: the fp16 torch module rebuilt from the manifest
    reproduces the target and its acceptance is the MIL evaluator's on the same texts
    (`mil_check` reports both)."""
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, mil_backend, torch_backend
    from converter.drafts.speculation import Acceptance, speculate, target_tokens
    from converter.drafts.sweep import mil_check
    from parity.reference import greedy_ids

    runtime = Runtime.from_artifact(artifact)
    target = tiny_hf_model("llama", seed=3)  # another model: acceptance is not all or none
    verify = partial(target_tokens, target)
    prompts = [[7, 8, 9, 10], [20, 21, 22]]
    stats, texts = Acceptance(3), []
    for prompt in prompts:
        one = Acceptance(3)
        new = speculate(torch_backend(runtime), verify, prompt, 3, 16, one)
        assert new == greedy_ids(target, tuple(prompt), 16)
        assert sum(a for _, a in one.trace) == sum(one.accepted) and len(one.trace) == one.cycles
        stats.add(one)
        texts.append(one)
    assert stats.tokens == 32 and 0 < stats.mean_accepted < 3
    check = mil_check(mil_backend(runtime), verify, prompts, 3, 16, texts)
    assert check["texts"] == 2 and check["backend_mean_accepted"] == round(stats.mean_accepted, 4)
    assert check["relative_difference"] <= 0.01, check
    # the same cycles: no difference, an interval at zero, no parting cycle
    assert check["cycle_difference"] == 0 and check["interval_covers_zero"]
    assert check["first_difference"] is None


def test_the_replayed_sweep_counts_what_the_cycles_count(artifact: Path) -> None:
    """``anec speculate``'s default loop with the torch draft: each text's target
    continuation fed once (teacher-forced, in extend calls) and every K's cycles replayed
    from it counts what the cycle loop (draft, verify, roll back, extend) counts with the
    same draft."""
    from tiny_models import tiny_hf_model

    from converter.drafts.host_loop import Runtime, torch_backend
    from converter.drafts.speculation import Acceptance, replay, speculate, target_tokens
    from converter.drafts.sweep import replay_agreements
    from parity.reference import greedy_ids

    make = torch_backend(Runtime.from_artifact(artifact))
    target = tiny_hf_model("llama", seed=3)
    prompts = [[7, 8, 9, 10], [20, 21, 22]]
    greedy = [greedy_ids(target, tuple(p), 16 + 4 - 1) for p in prompts]
    agreements = replay_agreements(make, prompts, greedy)
    for k in (1, 2, 4):
        looped, replayed = Acceptance(k), Acceptance(k)
        for prompt, agree in zip(prompts, agreements, strict=True):
            speculate(make, partial(target_tokens, target), prompt, k, 16, looped)
            replay(agree, 16, k, replayed)
        assert 0 < looped.mean_accepted < k
        assert (replayed.reached, replayed.accepted) == (looped.reached, looped.accepted)
        assert (replayed.cycles, replayed.tokens) == (looped.cycles, looped.tokens)


def test_speculate_compares_drafts_greedy_and_sampled_with_the_loop_model(
    artifact: Path, tmp_path: Path
) -> None:
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from converter.drafts.speculation import TEXTS

    # The tiny checkpoint has no tokenizer: one id per word of the built-in texts (< 300).
    draft = tmp_path / "draft"
    shutil.copytree(artifact, draft)
    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in TEXTS for w, _ in split.pre_tokenize_str(t)})
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])},
                                           unk_token="<unk>"))  # fmt: skip
    tokenizer.pre_tokenizer = split
    tokenizer.save(str(draft / "tokenizer.json"))
    manifest = json.loads((draft / "manifest.json").read_text())
    manifest["tokenizer"] = {"file": "tokenizer.json"}
    (draft / "manifest.json").write_text(json.dumps(manifest))
    twin = tmp_path / "twin"
    shutil.copytree(draft, twin)
    common = ("--k", "1,2", "--texts", "2", "--max-new-tokens", "8", "--json")
    alone = run_anec("speculate", "--draft", draft, "--temperature", "0", *common)
    assert alone.exit_code == 0, alone.output
    greedy = json.loads(alone.output[alone.output.index('{"draft"') :])
    result = run_anec(
        "speculate", "--draft", draft, "--draft", twin, "--temperature", "0",
        "--temperature", "1.0", "--verify-ms", "10", "--out", tmp_path / "report", *common,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index('{"evidence"') :])
    assert report["evidence"]["loop"] == "predicted"
    first, second = report["drafts"]
    for row, alone_row in zip(first["rows"], greedy["rows"], strict=True):
        # T = 0 is the greedy sweep, unchanged by the sampled temperatures beside it
        assert row["mean_accepted_per_cycle"] == alone_row["mean_accepted_per_cycle"]
        low, high = row["sampling"]["1.0"]["mean_accepted_95"]
        assert 0 <= low <= row["sampling"]["1.0"]["mean_accepted_per_cycle"] <= high <= row["k"]
    assert first["rows"] == second["rows"]  # the same draft twice: the same figures
    for chip, per_t in report["ranking"].items():
        assert set(per_t) == {"0", "1.0"}, chip
        assert [r["pipelined_speedup"] for r in per_t["1.0"]] == sorted(
            (r["pipelined_speedup"] for r in per_t["1.0"]), reverse=True
        )
        for loop in first["loop_model"][chip]["by_temperature"]["0"]:
            assert loop["evidence"] == "predicted"
    html = (tmp_path / "report" / "speculate.html").read_text()
    assert "<svg" in html and "predicted" in html
    assert "T=1.0" in (tmp_path / "report" / "speculate.txt").read_text()


def test_speculate_refuses_a_draft_whose_gates_failed(artifact: Path, tmp_path: Path) -> None:
    import shutil

    failed = tmp_path / "failed-draft"
    shutil.copytree(artifact, failed)
    doc = json.loads((failed / "parity.json").read_text())
    (failed / "parity.json").write_text(json.dumps({**doc, "passed": False}))
    result = run_anec("speculate", "--draft", artifact, "--draft", failed, "--k", "1",
                      "--texts", "1", "--max-new-tokens", "4")  # fmt: skip
    assert result.exit_code != 0
    assert "failed-draft" in result.output and "gates failed" in result.output


def test_the_torch_backend_refuses_a_variant_without_compressed_weights(
    artifact: Path, tmp_path: Path
) -> None:
    import shutil

    from converter.drafts.host_loop import Runtime, torch_backend
    from converter.errors import InputError

    variant = tmp_path / "variant"
    shutil.copytree(artifact, variant)
    doc = json.loads((variant / "manifest.json").read_text())
    doc["compression"] = {"variant": "lut4"}  # says compressed; its package is not
    (variant / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match="variant without compressed weights"):
        torch_backend(Runtime.from_artifact(variant))


def test_bench_device_extend_drift_runs_the_k_vs_1_comparison(
    artifact: Path, tmp_path: Path
) -> None:
    # The device comparison's loop, run here by the MIL evaluator (the Core ML path is the
    # same loop with another session maker; never run on this machine).
    out = tmp_path / "drift.json"
    args = ("--extend-drift", "--backend", "mil", "--steps", "6")
    result = run_anec("bench-device", artifact, "--out", out, *args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    row = doc["results"]["mil-fp16"]
    assert row["passed"] and row["finite"] and row["extend_tokens"] == 4
    assert row["prompts"] == 2 and row["positions"] == 2 * 6
    assert [g["name"] for g in row["gates"]] == ["kv_extend_argmax_flips"]
    assert 0 <= row["max_abs_diff"] < 0.25 and "position" in row["max_abs_diff_at"]
    assert "not a device" in doc["evidence"] and "mil-fp16: passed" in result.output


def test_extend_vs_decode_flags_drift_and_flips_only_past_the_margin() -> None:
    from parity.gate_registry import Worst
    from parity.kv_gates import extend_vs_decode

    decode = {5: np.array([0.0, 2.0, 1.0]), 6: np.array([1.0, 1.2, 0.0])}
    # Position 5: margin 1.0 and the extend path picks another token (a flip); position 6:
    # margin 0.2, below the 0.5 the gate judges, so its different argmax is no flip.
    extend = {5: np.array([0.0, 1.6, 1.7]), 6: np.array([1.3, 1.1, 0.0])}
    worst = Worst(0.0)
    flips = extend_vs_decode(decode, extend, "p", worst)
    assert flips == ["p position 5: decode 1 (margin 1.000), extend 2"]
    assert worst.value == pytest.approx(0.7) and worst.where == "p position 5"


RECIPE = """name: r
task: text-generation
source: {{kind: hf-dir, path: .}}
target: {target}
fixtures: {{token_ids: [[1, 2, 3]]}}
"""


@pytest.mark.parametrize(
    ("target", "cache", "message"),
    [
        ("macOS14", "cache: {style: state}", "cache.style"),
        ("macOS15", "cache: {style: state, length: 100}", "multiple of 32"),
        ("macOS15", "cache: {style: io, length: 64, prefill: 128}", "exceed the cache length"),
        ("macOS15", "cache: {style: state, window: 3}", "window"),
        ("macOS15", "cache: {style: paged}", "style"),
    ],
)
def test_cache_section_rules(tmp_path: Path, target: str, cache: str, message: str) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(RECIPE.format(target=target) + cache + "\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert message in str(info.value)


def test_style_none_is_the_window_task(tmp_path: Path) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(RECIPE.format(target="macOS14") + "cache: {style: none}\n")
    assert task_of(load_recipe(file)).steps[-1].name == "plan (static)"
    assert "convert to ML Program" in [s.name for s in task_of(load_recipe(file)).steps]


def test_anec_parity_on_an_artifact_of_the_earlier_cache_rule_says_so(
    artifact: Path, tmp_path: Path
) -> None:
    import shutil

    from parity.kv_gates import RETIRED

    # As schema 6 published it: the absolute fp16 logit gates, no fp32 cache level.
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["schema_version"] = 6
    (old / "manifest.json").write_text(json.dumps(manifest))
    parity = json.loads((old / "parity.json").read_text())
    kept = [g for g in parity["gates"] if g["level"] != "kv-cache" or
            not g["name"].startswith(("fp32_", "kv_fp32_"))]  # fmt: skip
    retired = [dict(kept[-1], name=name, level="kv-cache") for name in RETIRED]
    parity["gates"] = kept + retired
    (old / "parity.json").write_text(json.dumps(parity))
    result = run_anec("parity", old, "--out", tmp_path / "re")
    assert result.exit_code == 0, result.output
    assert "cache rule of manifest schema 6" in result.output
    doc = json.loads((tmp_path / "re" / "parity.json").read_text())
    assert "schema 6" in doc["judged_by"] and "2026-12-05" in doc["judged_by"]
    names = {g["name"]: g for g in doc["gates"]}
    assert names["same_gate_set"]["passed"] and "kv_fp32_max_abs_logit_error" in names
    assert not set(RETIRED) & set(names)
    assert "cache rule of manifest schema 6" in (tmp_path / "re" / "parity.txt").read_text()


def test_the_mil_check_names_the_first_cycle_where_the_two_loops_part() -> None:
    from converter.drafts.speculation import Acceptance, replay
    from converter.drafts.sweep import _first_difference

    same = [True] * 9
    parted = [True, True, False] + [True] * 6  # the draft misses continuation index 2
    a, b, c = Acceptance(4), Acceptance(4), Acceptance(4)
    replay(same, 6, 4, a)
    replay(same, 6, 4, b)
    replay(parted, 6, 4, c)
    assert _first_difference([a], [b]) is None
    assert _first_difference([a, a], [b, c]) == {
        "text": 1, "continuation_index": 0, "backend_accepted": 4, "mil_accepted": 2,
    }  # fmt: skip
    assert c.trace[:2] == [(0, 2), (3, 4)]  # k = 4 caps the second cycle
