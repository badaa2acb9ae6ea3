"""`anec convert` runs the MIL level before publishing, and `anec parity` re-runs every gate
on a published artifact: real conversions of a tiny perturbed Llama."""

from __future__ import annotations

import json
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import one_torch_thread, run_anec, save_tiny_llama, write_tiny_recipe

from converter.pipeline.manifest import SCHEMA_VERSION


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mil_cli")
    save_tiny_llama(root / "ckpt")
    return root


def _recipe(root: Path, name: str, mil_gate: float) -> Path:
    gates = {"mil_fp32_layer_rel_error": mil_gate}
    return write_tiny_recipe(root / f"{name}.yaml", root / "ckpt", name, gates=gates)


@pytest.fixture(scope="module")
def artifact(root: Path) -> Path:
    result = run_anec("convert", _recipe(root, "tiny", 1e-5), "--out", root / "out", "--json")
    assert result.exit_code == 0, result.output
    return root / "out" / "tiny"


SAME_SET = ("same_gate_set", "recheck")
OFF_MAC = platform.system() != "Darwin"


def _gates(doc: dict) -> dict[tuple[str, str], dict]:
    return {(g["name"], g["implementation"]): g for g in doc["gates"]}


def test_published_parity_covers_every_level(artifact: Path) -> None:
    doc = json.loads((artifact / "parity.json").read_text())
    assert doc["passed"] is True
    levels = {(lv["level"], lv["implementation"]): lv["status"] for lv in doc["levels"]}
    # the torch-fp16 level only localizes what the program's own fp16 level finds: on demand
    assert levels[("rewrite", "torch-fp16")].startswith("not run: on demand")
    assert not any(g["level"] == "torch-fp16" for g in doc["gates"])
    for key in [
        ("rewrite", "torch-fp32"),
        ("conversion", "mil-fp32"),
        ("conversion", "mil-fp16"),
        ("conversion", "mil-fp16-acc"),
    ]:
        assert levels[key] == "run"
    # Core ML runs the package only on macOS (the macOS workflow runs these tests there)
    runtime = levels[("runtime", "coreml-cpu-and-ne")]
    assert runtime.startswith("not run on this platform") == OFF_MAC, runtime
    gates = _gates(doc)
    assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
    assert gates[("fp16_argmax_agreement", "mil-fp16")]["passed"]
    runs = {r["implementation"]: r for r in doc["conversion"]["runs"]}
    assert len(runs["mil-fp16"]["layer_rel_error"]) == 3
    assert set(runs["mil-fp16-acc"]["slices"]) >= {"narrow-margin", "padded", "full-window"}
    assert {r["implementation"] for r in doc["conversion"]["runs"]} <= set(doc["implementations"])
    html = (artifact / "parity.html").read_text()
    assert html.count("<svg") == 3  # errors, range, margins
    assert ("not run on this platform" in html) == OFF_MAC
    assert "Residual stream range" in html
    assert "Conversion level" in (artifact / "parity.txt").read_text()


def test_a_failed_mil_gate_publishes_nothing(root: Path) -> None:
    # The program matches its module to about 1e-6 here: a 1e-12 gate must fail.
    out = root / "strict-out"
    result = run_anec("convert", _recipe(root, "strict", 1e-12), "--out", out, "--json")
    assert result.exit_code == 1, result.output
    assert not (out / "strict").exists()
    doc = json.loads((out / "strict.failed" / "parity.json").read_text())
    gates = _gates(doc)
    assert not gates[("mil_fp32_layer_rel_error", "mil-fp32")]["passed"]
    assert gates[("fp32_layer_rel_error", "torch-fp32")]["passed"]


def test_a_failed_fp16_gate_of_the_program_runs_the_torch_fp16_level_to_say_where(
    root: Path,
) -> None:
    # max |dp| <= 1e-9 fails in the program's fp16 level, and in the module's fp16 too
    recipe = write_tiny_recipe(root / "dp.yaml", root / "ckpt", "dp",
                               gates={"fp16_max_abs_dprob": 1e-9})  # fmt: skip
    out = root / "dp-out"
    result = run_anec("convert", recipe, "--out", out, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads((out / "dp.failed" / "parity.json").read_text())
    gates = _gates(doc)
    assert not gates[("fp16_max_abs_dprob", "mil-fp16")]["passed"]
    assert not gates[("fp16_max_abs_dprob", "torch-fp16")]["passed"]
    levels = {(lv["level"], lv["implementation"]): lv["status"] for lv in doc["levels"]}
    status = levels[("rewrite", "torch-fp16")]
    assert status.startswith("run because fp16_max_abs_dprob (mil-fp16) failed")
    assert "the rewrite's own fp16 arithmetic fails too" in status


def test_torch_fp16_always_runs_the_level_every_time(root: Path) -> None:
    recipe = write_tiny_recipe(root / "always.yaml", root / "ckpt", "always",
                               gates={"torch_fp16": "always"})  # fmt: skip
    result = run_anec("convert", recipe, "--out", root / "always-out", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads((root / "always-out" / "always" / "parity.json").read_text())
    levels = {(lv["level"], lv["implementation"]): lv["status"] for lv in doc["levels"]}
    assert levels[("rewrite", "torch-fp16")] == "run"
    assert {"fp16_argmax_agreement", "deterministic"} <= {
        g["name"] for g in doc["gates"] if g["level"] == "torch-fp16"
    }


def test_anec_parity_reruns_the_gates_on_the_artifact(artifact: Path, root: Path) -> None:
    out = root / "recheck"
    result = run_anec("parity", artifact, "--out", out, "--profile", "fp32", "--profile", "fp16")
    assert result.exit_code == 0, result.output
    assert "Conversion level" in result.output
    assert ("not run on this platform" in result.output) == OFF_MAC
    published = _gates(json.loads((artifact / "parity.json").read_text()))
    again = _gates(json.loads((out / "parity.json").read_text()))
    same_set = again.pop(SAME_SET)
    assert same_set["passed"] and same_set["value"] == 0
    assert set(again) == set(published)  # every published gate re-run, none dropped
    for key, gate in again.items():  # deterministic: the same numbers again
        assert gate["value"] == pytest.approx(published[key]["value"], rel=1e-6), key
    assert (out / "parity.html").is_file()


def test_anec_parity_with_the_fp16_profile_alone_reruns_the_same_gate_set(
    artifact: Path, root: Path
) -> None:
    """A window re-checked without the fp32 profile still records its markers gate (found in
    the program, not run): that is no gate "re-run, not published"."""
    out = root / "recheck-fp16"
    result = run_anec("parity", artifact, "--out", out, "--profile", "fp16")
    assert result.exit_code == 0, result.output
    again = _gates(json.loads((out / "parity.json").read_text()))
    assert again[SAME_SET]["passed"], again[SAME_SET]["detail"]
    assert not any(name == "mil_fp32_layer_rel_error" for name, _ in again)


def test_anec_parity_fails_a_rerun_that_dropped_a_gate(
    artifact: Path, root: Path, tmp_path: Path
) -> None:
    import shutil

    # The artifact was published with one more gate than the re-run runs (as if a change to
    # anec had dropped it): the re-check must fail and name it, not pass on the rest.
    copy = tmp_path / "tiny"
    shutil.copytree(artifact, copy)
    doc = json.loads((copy / "parity.json").read_text())
    dropped = dict(doc["gates"][0], name="a gate the re-run dropped")
    doc["gates"].append(dropped)
    (copy / "parity.json").write_text(json.dumps(doc))
    out = root / "recheck-dropped"
    result = run_anec("parity", copy, "--out", out, "--profile", "fp32", "--profile", "fp16")
    assert result.exit_code == 1, result.output
    same_set = _gates(json.loads((out / "parity.json").read_text()))[SAME_SET]
    assert not same_set["passed"]
    assert (
        f"published, not re-run: a gate the re-run dropped / {dropped['implementation']}"
        in (same_set["detail"])
    )


def test_anec_parity_refuses_a_package_that_differs_from_its_manifest(
    artifact: Path, root: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "tiny"
    shutil.copytree(artifact, copy)
    weights = next(copy.glob("*.mlpackage/Data/com.apple.CoreML/weights/weight.bin"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    result = run_anec("parity", copy)
    assert result.exit_code == 2
    assert "differs from the hash in manifest.json" in result.output


def test_the_window_returns_logits_with_the_vocabulary_last(artifact: Path) -> None:
    """Manifest schema 3: each chunk (B, n, 1, V_k); the plan's output bytes are the dense
    rows (one 64-byte row per position and chunk, not one per logit) and the transposes that
    produce the outputs stay in the program's one NE segment."""
    from converter.placement.ops import op_table
    from converter.placement.static import static_report
    from parity.mil.program import load_package

    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION
    # every contract change since schema 3 is listed, in order, for the host to read
    assert [c["schema_version"] for c in manifest["io_contract_changes"]] == list(
        range(3, SCHEMA_VERSION + 1)
    )
    assert [o["shape"] for o in manifest["outputs"]] == [[1, 1, 1, 128], [1, 1, 1, 128],
                                                         [1, 1, 1, 44]]  # fmt: skip
    assert "[batch, position, 0, token]" in manifest["conventions"]["logits"]
    table = op_table(load_package(artifact / "tiny.mlpackage"))
    report = static_report(table, "tiny.mlpackage", "-", "M1")
    function = report.functions[0]
    # (vocabulary on axis 1 would be 300 rows of 64 bytes: 19,200 bytes)
    assert function.summary.output_bytes == 128 + 256 + 256
    assert function.summary.ne_segments == 1
    heads = [r for r in function.rows if r.op_type == "transpose" and r.shape[:3] == [1, 1, 1]]
    assert sorted(r.shape[3] for r in heads) == [44, 128, 128]
    assert all(r.device == "NE" for r in heads)


def test_a_decoder_manifest_of_schema_2_is_refused_naming_the_version(
    artifact: Path, tmp_path: Path
) -> None:
    """Schema 2 packages return (B, V_k, 1, n) logits: `anec parity` refuses to read them
    rather than compare the wrong axis (exit 2, the file, the version and what changed)."""
    old = tmp_path / "old"
    old.mkdir()
    doc = json.loads((artifact / "manifest.json").read_text())
    doc["schema_version"] = 2
    (old / "manifest.json").write_text(json.dumps(doc))
    result = run_anec("parity", old, "--out", tmp_path / "re")
    assert result.exit_code == 2
    text = result.output + str(result.stderr if result.stderr_bytes else "")
    assert "manifest schema_version 2" in text and "vocabulary last" in text
