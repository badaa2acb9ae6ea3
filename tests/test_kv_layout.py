"""Recipe cache.layout: per-function: one package per cached function, each storing its own
weights once, with every cache gate; the host carries the cache between packages (io) or
copies the state from the package called last (state), checked against a stand-in of Core ML
(tests/coreml_standin.py); and the resident-bytes prediction of both layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from coreml_standin import StandInLoader
from tiny_models import run_anec, save_tiny_llama, write_tiny_recipe

from converter.drafts.host_loop import Runtime, coreml_backend, greedy, mil_backend
from converter.recipe import RecipeError, load_recipe
from converter.tasks.kv_layout import WEIGHTS, resident_predicted
from parity.mil import load_package

CACHE = (
    "cache:\n  style: {style}\n  length: 64\n  prefill: 8\n  extend: 4\n  decode_steps: 12\n"
    "  layout: per-function\n"
)
FUNCTIONS = ("decode", "extend", "prefill")


def _convert(root: Path, style: str) -> Path:
    ckpt = save_tiny_llama(root / "ckpt")
    recipe = write_tiny_recipe(
        root / "pf.yaml", ckpt, "tiny-pf", extra="target: macOS15\n" + CACHE.format(style=style)
    )
    result = run_anec("convert", recipe, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / "tiny-pf"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(tmp_path_factory.mktemp("layout"), "state")


def test_each_function_is_its_own_package_storing_its_weights_once(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    assert kv["layout"] == "per-function"
    files = {f: kv["functions"][f]["package"] for f in FUNCTIONS}
    assert files == {f: f"tiny-pf.{f}.mlpackage" for f in FUNCTIONS}
    assert manifest["package"]["file"] == files["decode"]
    assert sorted(e["file"] for e in manifest["extra_packages"]) == sorted(
        files[f] for f in ("extend", "prefill")
    )
    weights = {}
    for function, file in files.items():
        program = load_package(artifact / file)
        assert list(program.functions) == ["main"], function
        weights[function] = (artifact / file / WEIGHTS).stat().st_size
    # the same layers in each: each package stores the model's weights once
    assert len(set(weights.values())) == 1
    assert kv["sizes"]["weight_bytes"] == weights
    rows = {r["functions"]: r["bytes"] for r in kv["resident_predicted"]["rows"]}
    assert rows["decode"] == weights["decode"]
    assert rows["prefill+decode+extend"] == sum(weights.values())
    assert kv["resident_predicted"]["evidence"] == "predicted"
    plan = json.loads((artifact / "plan.json").read_text())
    assert plan["resident_predicted"] == kv["resident_predicted"]
    assert "prefill+decode+extend" in (artifact / "plan.txt").read_text()
    assert not (artifact / "functions.tmp").exists()


def test_every_cache_gate_passes_and_the_rerun_agrees(artifact: Path, tmp_path: Path) -> None:
    parity = json.loads((artifact / "parity.json").read_text())
    gates = {g["name"]: g for g in parity["gates"]}
    assert parity["passed"] is True
    names = {"kv_fp32_max_abs_logit_error", "kv_stale_max_abs_diff", "mil_fp32_layer_rel_error"}
    assert names <= set(gates)
    # no package holds two functions, so there is no weight sharing to gate
    assert "kv_weights_stored_once" not in gates
    result = run_anec("parity", artifact, "--out", tmp_path / "re", "--profile", "fp16")
    assert result.exit_code == 0, result.output


def test_the_host_relays_the_state_between_packages(artifact: Path) -> None:
    runtime = Runtime.from_artifact(artifact)
    loader = StandInLoader()
    make = coreml_backend(runtime, "CPU_AND_NE", loader)
    prompt = [5, 17, 42, 7, 99, 3, 64, 12, 8, 1]
    assert greedy(make, prompt, 10).new_ids == greedy(mil_backend(runtime), prompt, 10).new_ids
    # each package loaded once, as its main
    assert sorted(loader.loads) == sorted(
        (f"tiny-pf.{f}.mlpackage", "main", "CPU_AND_NE") for f in FUNCTIONS
    )
    session = make()
    session.prefill("prefill", prompt)
    session.poison(40, 3.0e4)  # written into the state the next call reads
    assert session.states is not None
    assert (session.states["kv_cache"][:, :, 40:, :] == 3.0e4).all()


def test_the_io_style_converts_with_every_gate(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "io")
    assert json.loads((artifact / "parity.json").read_text())["passed"] is True
    runtime = Runtime.from_artifact(artifact)
    got = greedy(coreml_backend(runtime, "CPU_ONLY", StandInLoader()), [3, 1, 4, 1, 5], 6)
    assert got.new_ids == greedy(mil_backend(runtime), [3, 1, 4, 1, 5], 6).new_ids


def test_the_layout_rules(tmp_path: Path) -> None:
    ckpt = save_tiny_llama(tmp_path / "ckpt")

    def refused(extra: str, match: str) -> None:
        recipe = write_tiny_recipe(tmp_path / "r.yaml", ckpt, "r", extra=extra)
        with pytest.raises(RecipeError, match=match):
            load_recipe(recipe)

    state = "target: macOS15\n" + CACHE.format(style="state")
    refused(state + "  package_budget_mb: 100\n", "per-function layout is not chunked")
    compression = (
        "compression:\n  held_out: [[20, 21, 22, 23, 24, 25]]\n  variants:\n"
        "    - {suffix: int8, method: int8, granularity: per-channel,\n"
        "       gates: {min_top1_agreement: 0.9, max_mean_kl: 0.01}}\n"
    )
    refused(state + compression, "compressed variants of a per-function layout")
    refused("cache:\n  layout: per-function\n", "applies to a cached decoder")


def test_the_prediction_gives_both_readings_of_a_multifunction_package() -> None:
    sizes = {"multifunction_weight_bytes": 100}
    rows = {r["functions"]: r for r in resident_predicted(sizes, list(FUNCTIONS))["rows"]}
    assert rows["decode"] == {
        "functions": "decode",
        "if_shared": 100,
        "if_copied_per_function": 100,
    }
    assert rows["decode+prefill"]["if_copied_per_function"] == 200
    assert rows["decode+extend+prefill"]["if_shared"] == 100


@pytest.mark.usefixtures("stand_in_evidence")
def test_device_check_runs_each_package_and_reads_memory_per_package(
    artifact: Path, tmp_path: Path
) -> None:
    from coreml_standin import stand_in_adapters

    from converter.device.dispatch import device_check

    evidence = device_check(artifact, ["CPU_ONLY"], stand_in_adapters(StandInLoader()))
    assert evidence.passed
    assert sorted(evidence.units[0].functions) == list(FUNCTIONS)
    by_file = {p["file"]: p["functions"] for p in evidence.packages}
    assert by_file == {f"tiny-pf.{f}.mlpackage": [f] for f in FUNCTIONS}
    # plan-inspect --observed on one function's package shows that function's calls
    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.pipeline.publish import write_json_atomic
    from converter.placement.inspect import read_observed

    path = write_json_atomic(tmp_path / "evidence.json", evidence.to_json())
    prefill = artifact / "tiny-pf.prefill.mlpackage"
    observed = read_observed(path, mlpackage_content_hash(prefill))
    calls = evidence.units[0].functions["prefill"].samples_ms
    assert observed.latency["CPU_ONLY"].runs == len(calls)
    assert evidence.memory is not None and len(evidence.memory["rows"]) == 4
    assert evidence.plans is not None
    assert set(evidence.plans) == {f"tiny-pf.{f}.mlpackage" for f in FUNCTIONS}
