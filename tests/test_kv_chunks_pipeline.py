"""``anec convert`` of a cached decoder whose weight budget splits it into three chunk
packages (tiny Llama, cache style state): every cache gate passes on the chain, each chunk is
its own multifunction package storing its weights once, the manifest lists the chunks, and a
host loop built from the manifest alone reproduces transformers' greedy ids.

An int8 variant of it is three chunk packages too, compressed with one plan, gated on the
chain. One conversion shared by every test here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import INT8_COMPRESSION, convert_tiny_llama, run_anec, tiny_hf_model

from converter.pipeline.manifest import SCHEMA_VERSION
from parity.mil import load_package

# 0.12 MB: a tiny Llama layer stores 73,984 bytes (fp16), the LM head + final norm 38,528;
# two layers, or the last layer with the head and another, exceed it: three chunks.
BUDGET = 120_000
CACHE = (
    "target: macOS15\ncache:\n  style: state\n  length: 96\n  prefill: 8\n  extend: 4\n"
    "  decode_steps: 64\n  package_budget_mb: 0.12\n"
)
# An int8 variant of the chunked decoder: each chunk package compressed with the one plan.
COMPRESSION = INT8_COMPRESSION


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result, out = convert_tiny_llama(
        tmp_path_factory.mktemp("kvchunks"), CACHE + COMPRESSION, "tch"
    )
    assert result.exit_code == 0, result.output
    return out / "tch"


def test_every_cache_gate_passes_on_the_chain(artifact: Path) -> None:
    parity = json.loads((artifact / "parity.json").read_text())
    gates = {g["name"]: g for g in parity["gates"] if g["level"] == "kv-cache"}
    assert len(gates) == 11 and all(g["passed"] for g in gates.values()), gates
    assert gates["kv_fp32_max_abs_logit_error"]["value"] <= 0.01
    detail = json.loads((artifact / "kv_parity.json").read_text())
    assert [row["decode_steps"] for row in detail["fixtures"]] == [64, 64]
    assert len(detail["sizes"]["chunks"]) == 3


def test_each_chunk_is_a_multifunction_package_within_the_budget(artifact: Path) -> None:
    kv = json.loads((artifact / "manifest.json").read_text())["kv_cache"]
    for i, chunk in enumerate(kv["chunks"]):
        package = artifact / f"tch.chunk{i}.mlpackage"
        assert chunk["package"] == package.name
        program = load_package(package)
        assert sorted(program.functions) == ["decode", "extend", "prefill"]
        sizes = chunk["sizes"]
        # stored once per chunk, and the weight file itself within the budget
        assert sizes["multifunction_weight_bytes"] == max(
            sizes["single_function_weight_bytes"].values()
        )
        assert chunk["weight_bytes"] <= sizes["multifunction_weight_bytes"] <= BUDGET
        assert (artifact / f"plan.chunk{i}.json").is_file()
    assert not (artifact / "tch.mlpackage").exists()


def test_the_manifest_lists_the_chunks_in_call_order(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert kv["chunking"]["chunks"] == 3 and kv["chunking"]["package_budget_bytes"] == BUDGET
    assert kv["chunking"]["call_order"] == [f"tch.chunk{i}.mlpackage" for i in range(3)]
    chunks = kv["chunks"]
    assert [c["layers"] for c in chunks] == [[0, 1], [1, 2], [2, 3]]
    assert [c["cache"]["shape"] for c in chunks] == [[2, 2, 96, 16]] * 3
    assert chunks[1]["cache"]["rows_in_one_package_layout"] == {"keys": [1, 2], "values": [4, 5]}
    first = {t["name"] for t in chunks[0]["functions"]["decode"]["inputs"]}
    later = [t["name"] for t in chunks[1]["functions"]["decode"]["inputs"]]
    assert "inputs_embeds" in first and later[0] == "hidden_in"
    assert [t["name"] for t in chunks[1]["functions"]["decode"]["outputs"]] == ["hidden_out"]
    assert chunks[2]["functions"]["decode"]["outputs"][0]["name"] == "logits_0"
    passes = chunks[0]["passes_to_next"]
    assert passes["output"] == "hidden_out" and passes["input"] == "hidden_in"
    assert passes["per_call"]["decode"] == {"shape": [1, 64, 1, 1], "bytes": 128}
    assert passes["per_call"]["prefill"] == {"shape": [1, 64, 1, 8], "bytes": 1024}
    assert chunks[2]["passes_to_next"] is None
    assert manifest["package"]["file"] == "tch.chunk0.mlpackage"
    assert [p["file"] for p in manifest["extra_packages"]] == ["tch.chunk1.mlpackage",
                                                               "tch.chunk2.mlpackage"]  # fmt: skip
    assert kv["cache"]["shape"] == [6, 2, 96, 16]  # the one-package layout the rows map into


def test_a_fresh_runtime_from_the_manifest_reproduces_the_greedy_ids(artifact: Path) -> None:
    from converter.drafts.host_loop import Runtime, greedy, mil_backend
    from parity.reference import greedy_ids

    runtime = Runtime.from_artifact(artifact)
    assert len(runtime.chunks) == 3
    got = greedy(mil_backend(runtime), [1, 2, 3, 4, 5], 40)
    # The one-package artifact's greedy ids are transformers' (tests/test_kv_pipeline.py).
    assert got.new_ids == greedy_ids(tiny_hf_model("llama"), (1, 2, 3, 4, 5), 40)


def test_the_core_ml_host_loop_chains_the_chunks(artifact: Path) -> None:
    """coreml_backend against a stand-in of MLModel / MLState (tests/coreml_standin.py): one
    state per chunk, the chain's greedy ids, and the stale-row write reaching every chunk's
    state through read_state / write_state."""
    from coreml_standin import StandInLoader

    from converter.drafts.host_loop import Runtime, coreml_backend, greedy, mil_backend

    runtime = Runtime.from_artifact(artifact)
    make = coreml_backend(runtime, "CPU_AND_NE", StandInLoader())
    got = greedy(make, [1, 2, 3, 4, 5], 12)
    assert got.new_ids == greedy(mil_backend(runtime), [1, 2, 3, 4, 5], 12).new_ids
    session = make()
    assert session.states is not None and len(session.states) == 3
    session.poison(40, 3.0e4)
    for name in session.states:
        cache = session.states[name]
        assert (cache[:, :, 40:, :] == 3.0e4).all() and not cache[:, :, :40, :].any(), name


def test_anec_parity_reruns_the_gates_on_the_chunks(artifact: Path, tmp_path: Path) -> None:
    result = run_anec("parity", artifact, "--out", tmp_path / "re", "--profile", "fp16")
    assert result.exit_code == 0, result.output
    gates = json.loads((tmp_path / "re" / "parity.json").read_text())["gates"]
    names = {g["name"]: g for g in gates}
    assert names["same_gate_set"]["passed"] and names["kv_weights_stored_once"]["passed"]


def test_speculative_decoding_runs_the_chain(artifact: Path) -> None:
    from functools import partial

    from converter.drafts.host_loop import Runtime, mil_backend
    from converter.drafts.speculation import Acceptance, speculate, target_tokens
    from parity.reference import greedy_ids

    target = tiny_hf_model("llama")
    stats = Acceptance(3)
    make = mil_backend(Runtime.from_artifact(artifact))
    new = speculate(make, partial(target_tokens, target), [7, 8, 9, 10], 3, 12, stats)
    # rollback and extend through three chunk caches: still exactly the target's tokens
    assert new == greedy_ids(target, (7, 8, 9, 10), 12)
    assert stats.rate(0) > 0.8


def test_plan_inspect_reports_every_chunk(artifact: Path) -> None:
    result = run_anec("plan-inspect", artifact, "--json")
    assert result.exit_code == 0, result.output
    for i in range(3):
        assert f"tch.chunk{i}.mlpackage" in result.output


def test_a_chunk_fed_its_predecessors_input_fails_the_rerun_naming_the_position(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import parity.kv_session as kv_session

    def wrong(fed, returned):  # type: ignore[no-untyped-def]
        return fed.get("hidden_in", returned["hidden_out"])  # chunk 1's layer skipped

    monkeypatch.setattr(kv_session, "handoff", wrong)
    result = run_anec("parity", artifact, "--out", tmp_path / "re", "--profile", "fp32")
    assert result.exit_code == 1, result.output
    gates = json.loads((tmp_path / "re" / "parity.json").read_text())["gates"]
    failed = {g["name"]: g for g in gates if not g["passed"]}
    # the fp32 cache level names the first call, the layer that went wrong and its position
    assert "fp32_layer_rel_error" in failed
    assert "prefill call 0, layer 2, position" in failed["fp32_layer_rel_error"]["where"]


def test_a_compressed_variant_is_chunked_like_its_fp16_artifact(artifact: Path) -> None:
    """One plan applied to every chunk's functions: each chunk package stores its own int8
    weights once, byte-identical to the window program's, every structural cache gate passes
    on the chain, and the manifest names the variant's own packages."""
    from converter.drafts.host_loop import Runtime, greedy, mil_backend

    variant = artifact.parent / "tch-int8"
    parity = json.loads((variant / "parity.json").read_text())
    failed = [g for g in parity["gates"] if not g["passed"]]
    assert parity["passed"] is True and not failed, failed
    names = {g["name"] for g in parity["gates"]}
    assert {"kv_weights_identical", "kv_weights_stored_once", "kv_extend_argmax_flips"} <= names
    assert {"fp32_layer_rel_error", "kv_fp32_stale_max_abs_diff"} <= names
    manifest = json.loads((variant / "manifest.json").read_text())
    files = [f"tch-int8.chunk{i}.mlpackage" for i in range(3)]
    kv = manifest["kv_cache"]
    assert kv["chunking"]["call_order"] == files == [c["package"] for c in kv["chunks"]]
    assert manifest["package"]["file"] == files[0] and manifest["package"]["function"] == "decode"
    assert [p["file"] for p in manifest["extra_packages"]] == files[1:]
    assert [p["files"] for p in manifest["pieces"]] == [[f] for f in files]
    for i, file in enumerate(files):
        program = load_package(variant / file)
        ops = {op.op_type for f in program.functions.values() for op in f.operations}
        assert "constexpr_affine_dequantize" in ops or "constexpr_blockwise_shift_scale" in ops
        sizes = kv["chunks"][i]["sizes"]
        assert sizes["multifunction_weight_bytes"] == max(
            sizes["single_function_weight_bytes"].values()
        )
    # the variant runs from its manifest alone, through its three packages
    got = greedy(mil_backend(Runtime.from_artifact(variant)), [7, 8, 9, 10], 8)
    assert len(got.new_ids) == 8
