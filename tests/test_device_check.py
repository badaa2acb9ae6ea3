"""``anec device-check`` up to the Core ML call, on a tiny state-style cached decoder, with
stand-ins of coremltools' MLModel / MLState (tests/coreml_standin.py); and the Core ML host
loop (`coreml_backend`) against the MIL evaluator's."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest
from coreml_standin import StandInLoader, stand_in_adapters
from tiny_models import run_anec, save_tiny_llama, write_tiny_recipe

from converter.coreml.runtime import parse_vm_stat
from converter.drafts.host_loop import Runtime, coreml_backend, greedy, mil_backend
from converter.errors import InputError

pytestmark = pytest.mark.usefixtures("stand_in_evidence")

CACHE = "cache:\n  style: state\n  length: 64\n  prefill: 8\n  extend: 4\n  decode_steps: 12\n"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("device")
    ckpt = save_tiny_llama(root / "ckpt")
    recipe = write_tiny_recipe(root / "kv.yaml", ckpt, "tiny-kv", extra="target: macOS15\n" + CACHE)
    result = run_anec("convert", recipe, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / "tiny-kv"


def _use(monkeypatch: pytest.MonkeyPatch, loader: StandInLoader) -> StandInLoader:
    """Make device-check's Mac adapters the stand-ins around ``loader``; returns it."""
    import converter.commands.device_check as cli

    monkeypatch.setattr(cli, "mac_adapters", lambda: stand_in_adapters(loader))
    return loader


def _cpu_evidence(
    artifact: Path, out: Path, monkeypatch: pytest.MonkeyPatch, loader: StandInLoader
) -> Path:
    """``anec device-check --units CPU_ONLY --no-memory`` against ``loader``; its file."""
    _use(monkeypatch, loader)
    result = run_anec("device-check", artifact, "--units", "CPU_ONLY", "--no-memory",
                      "--out", out)  # fmt: skip
    assert out.is_file(), result.output
    return out


@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS Core ML really runs")
def test_off_macos_it_stops_before_core_ml_naming_the_reason(artifact: Path) -> None:
    result = run_anec("device-check", artifact)
    assert result.exit_code == 2
    assert "needs macOS" in result.output
    assert not (artifact.parent / "tiny-kv.device-check.json").exists()


def test_every_gate_runs_per_units_with_timing_and_memory(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = _use(monkeypatch, StandInLoader())
    out = tmp_path / "evidence.json"
    result = run_anec("device-check", artifact, "--out", out)
    assert result.exit_code == 0, result.output + result.stderr
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and doc["stand_in"] is True
    assert set(doc["units"]) == {"CPU_ONLY", "CPU_AND_NE"}
    names = {g["name"] for g in doc["program"]["gates"]}
    for unit, row in doc["units"].items():
        assert {g["name"] for g in row["gates"]} == names, unit
        assert all(g["attribution"] == "passed" for g in row["gates"])
        assert set(row["functions"]) == {"prefill", "decode", "extend"}
        decode = row["functions"]["decode"]
        assert decode["calls"] > 12 and decode["latency"]["runs"] == decode["calls"]
    # the census: each function alone, then all three; every model loaded per units setting
    rows = doc["memory"]["rows"]
    assert [sorted(r["functions"]) for r in rows] == [["decode"], ["extend"], ["prefill"],
                                                      ["decode", "extend", "prefill"]]  # fmt: skip
    assert ("tiny-kv.mlpackage", "decode", "CPU_AND_NE") in loader.loads
    plans = doc["compute_plans"]["tiny-kv.mlpackage"]
    assert set(plans) == {"CPU_ONLY", "CPU_AND_NE"}
    decode = plans["CPU_AND_NE"]["decode"]
    assert decode["devices"] == {"NE": len(decode["ops"])} and decode["ops"][0][2] == "NE"
    assert "STAND-IN" in result.output and "kv_max_abs_dprob" in result.output


def _favour_one_token(logits: np.ndarray) -> np.ndarray:
    """A device's drift users see: one token's logit 5 higher (a shift of every logit would
    change no probability)."""
    out = np.array(logits, copy=True)
    out[..., 7] += 5.0
    return out


def test_a_compressed_variant_is_refused_before_anything_runs(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    loader = _use(monkeypatch, StandInLoader())
    variant = tmp_path / "tiny-kv-int8"
    shutil.copytree(artifact, variant)
    manifest = json.loads((variant / "manifest.json").read_text())
    manifest["compression"] = {"method": "int8"}
    (variant / "manifest.json").write_text(json.dumps(manifest))
    result = run_anec("device-check", variant, "--out", tmp_path / "e.json")
    assert result.exit_code == 2 and "compressed variant" in result.output
    assert not loader.loads and not (tmp_path / "e.json").exists()


def test_a_device_that_drifts_fails_naming_the_gate_and_the_device(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drift(function: str, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if function != "decode":
            return outputs
        return {k: _favour_one_token(v) if k.startswith("logits") else v
                for k, v in outputs.items()}  # fmt: skip

    _use(monkeypatch, StandInLoader(drift))
    out = tmp_path / "evidence.json"
    result = run_anec("device-check", artifact, "--units", "CPU_AND_NE", "--no-memory",
                      "--out", out)  # fmt: skip
    assert result.exit_code == 1, result.output
    doc = json.loads(out.read_text())
    gates = {g["name"]: g for g in doc["units"]["CPU_AND_NE"]["gates"]}
    failed = gates["kv_max_abs_dprob"]
    assert failed["passed"] is False and failed["attribution"].startswith("device:")
    assert doc["memory"] is None
    assert "kv_max_abs_dprob" in result.output and "FAIL" in result.output


def test_plan_inspect_reads_the_evidence_and_refuses_another_artifacts(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from converter.device.evidence_file import read_evidence

    out = _cpu_evidence(artifact, tmp_path / "evidence.json", monkeypatch, StandInLoader())
    package = artifact / "tiny-kv.mlpackage"
    result = run_anec("plan-inspect", package, "--observed", out, "--json")
    assert result.exit_code == 0, result.output
    observed = json.loads(result.stdout)["packages"][0]["observed"]
    assert observed["stand_in"] is True and set(observed["latency"]) == {"CPU_ONLY"}
    assert read_evidence(out, artifact)["passed"] is True

    other = json.loads(out.read_text())
    other["packages"][0]["content_sha256"] = "0" * 64
    wrong = tmp_path / "other.json"
    wrong.write_text(json.dumps(other))
    result = run_anec("plan-inspect", package, "--observed", wrong)
    assert result.exit_code == 2 and "another artifact" in result.output
    with pytest.raises(InputError, match="another artifact"):
        read_evidence(wrong, artifact)


def test_the_core_ml_host_loop_generates_what_the_evaluator_does(artifact: Path) -> None:
    """coreml_backend against the stand-in: one state made by the decode function's model,
    shared by prefill, decode and extend, gives the MIL evaluator's greedy tokens."""
    runtime = Runtime.from_artifact(artifact)
    loader = StandInLoader()
    prompt = [5, 17, 42, 7, 99, 3, 64, 12, 8, 1]
    core_ml = greedy(coreml_backend(runtime, "CPU_AND_NE", loader), prompt, 10)
    assert core_ml.new_ids == greedy(mil_backend(runtime), prompt, 10).new_ids
    assert sorted(f for _, f, _ in loader.loads) == ["decode", "extend", "prefill"]


def test_wired_memory_is_read_from_vm_stat() -> None:
    text = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
        "Pages free:                               12345.\n"
        "Pages wired down:                        200000.\n"
    )
    assert parse_vm_stat(text) == 16384 * 200000
    with pytest.raises(ValueError, match="Pages wired down"):
        parse_vm_stat("Pages free: 1.\n")


def test_anec_parity_adds_the_device_gates_and_refuses_another_artifacts(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drift(function: str, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: _favour_one_token(v) if k.startswith("logits") else v
                for k, v in outputs.items()}  # fmt: skip

    evidence = _cpu_evidence(artifact, tmp_path / "evidence.json", monkeypatch,
                             StandInLoader(drift))  # fmt: skip
    other = json.loads(evidence.read_text())
    other["packages"][0]["content_sha256"] = "f" * 64
    wrong = tmp_path / "other.json"
    wrong.write_text(json.dumps(other))
    result = run_anec("parity", artifact, "--out", tmp_path / "no", "--device-evidence", wrong)
    assert result.exit_code == 2 and "another artifact" in result.output
    assert not (tmp_path / "no").exists()  # refused before anything ran

    out = tmp_path / "re"
    result = run_anec("parity", artifact, "--out", out, "--profile", "fp16",
                      "--device-evidence", evidence)  # fmt: skip
    assert result.exit_code == 1, result.output  # the drifting device's gates failed
    gates = json.loads((out / "parity.json").read_text())["gates"]
    device = {g["name"]: g for g in gates if g["implementation"] == "coreml-cpu-only"}
    assert not device["kv_max_abs_dprob"]["passed"]
    assert "device:" in device["kv_max_abs_dprob"]["detail"]
    assert "STAND-IN" in device["kv_max_abs_dprob"]["detail"]
    same_set = [g for g in gates if g["name"] == "same_gate_set"]
    assert same_set and same_set[0]["passed"]


@pytest.fixture(scope="module")
def window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import convert_tiny_llama

    result, out = convert_tiny_llama(tmp_path_factory.mktemp("window"), "", "tiny-window")
    assert result.exit_code == 0, result.output
    return out / "tiny-window"


def test_a_window_decoder_is_gated_on_its_outputs_per_units(
    window: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use(monkeypatch, StandInLoader())
    out = tmp_path / "evidence.json"
    result = run_anec("device-check", window, "--out", out)
    assert result.exit_code == 0, result.output + result.stderr
    doc = json.loads(out.read_text())
    for unit in ("CPU_ONLY", "CPU_AND_NE"):
        gates = {g["name"]: g for g in doc["units"][unit]["gates"]}
        assert {"fp16_argmax_agreement", "fp16_max_abs_dprob", "finite_outputs"} <= set(gates)
        assert gates["fp16_argmax_agreement"]["value"] == 1.0
        assert doc["units"][unit]["functions"]["main"]["calls"] >= 1
    # the program's own gates on the same feeds are the baseline
    assert {g["implementation"] for g in doc["program"]["gates"]} == {"mil-fp16"}
    assert [r["functions"] for r in doc["memory"]["rows"]] == [["main"]]


def test_a_window_device_that_moves_the_logits_fails_naming_the_gate(
    window: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tilt(function: str, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(outputs)
        for name, value in outputs.items():
            if name.startswith("logits"):
                out[name] = value + np.arange(value.shape[-1]) % 7  # not a uniform shift
        return out

    _use(monkeypatch, StandInLoader(tilt))
    out = tmp_path / "evidence.json"
    result = run_anec("device-check", window, "--units", "ALL", "--no-memory", "--out", out)
    assert result.exit_code == 1, result.output
    gates = {g["name"]: g for g in json.loads(out.read_text())["units"]["ALL"]["gates"]}
    assert not gates["fp16_max_abs_dprob"]["passed"]
    assert gates["fp16_max_abs_dprob"]["attribution"].startswith("device:")
    assert "fp16_max_abs_dprob" in result.output


def test_anec_parity_reads_a_window_decoders_evidence_and_refuses_a_malformed_one(
    window: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evidence = _cpu_evidence(window, tmp_path / "evidence.json", monkeypatch, StandInLoader())
    result = run_anec("parity", window, "--out", tmp_path / "re", "--device-evidence", evidence)
    assert result.exit_code == 0, result.output
    gates = json.loads((tmp_path / "re" / "parity.json").read_text())["gates"]
    device = {g["name"]: g for g in gates if g["implementation"] == "coreml-cpu-only"}
    # a recipe gate keeps the recipe's threshold
    assert (
        device["fp16_max_abs_dprob"]["threshold"] == 0.02 and device["fp16_max_abs_dprob"]["passed"]
    )

    doc = json.loads(evidence.read_text())
    del doc["units"]["CPU_ONLY"]["gates"][0]["value"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    result = run_anec("parity", window, "--out", tmp_path / "no", "--device-evidence", broken)
    assert result.exit_code == 2 and "malformed units section" in result.output
