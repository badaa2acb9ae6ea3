"""Plan gates in `anec convert`, on real conversions of a tiny perturbed Llama: a static
placement report in every artifact, and a failed plan gate blocks publishing like a parity
gate (exit 1, reports kept in OUT/<name>.failed/)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from tiny_models import one_torch_thread, run_anec, save_tiny_llama, write_tiny_recipe

from converter.recipe import RecipeError, load_recipe

# Both plan gates, strict enough that an fp32 program (on the CPU) fails them.
PLAN_GATES = {"plan_min_ne_flop_share": 0.999, "plan_max_ne_segments": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("plan-gates") / "ckpt")


def recipe(tmp_path: Path, checkpoint: Path, name: str, precision: str) -> Path:
    file = tmp_path / f"{name}.yaml"
    return write_tiny_recipe(file, checkpoint, name, precision=precision, gates=PLAN_GATES)


def convert(*args: str | Path) -> Result:
    return run_anec("convert", *args)


def test_an_ne_resident_program_passes_and_ships_its_plan(checkpoint: Path, tmp_path: Path) -> None:
    result = convert(recipe(tmp_path, checkpoint, "tiny-plan", "float16"), "--out", tmp_path)
    assert result.exit_code == 0, result.output
    artifact = tmp_path / "tiny-plan"
    plan = json.loads((artifact / "plan.json").read_text())
    assert plan["evidence"] == "static" and plan["calibration"] == "uncalibrated"
    gates = plan["gates"]
    # Every chip of the macOS platform, both gates.
    assert {g["where"] for g in gates} == {"M1", "M2", "M3", "M4", "M5"}
    assert len(gates) == 10 and all(g["passed"] for g in gates)
    summary = plan["functions"][0]["summary"]
    assert summary["ne_share"]["flops"] == 1.0 and summary["layers_all_ne"] == 3
    text = (artifact / "plan.txt").read_text()
    assert "evidence: static (uncalibrated)" in text and "plan_max_ne_segments" in text


def test_an_fp32_program_fails_the_plan_gate_and_is_not_published(
    checkpoint: Path, tmp_path: Path
) -> None:
    file = recipe(tmp_path, checkpoint, "tiny-fp32", "float32")
    result = convert(file, "--out", tmp_path)
    assert result.exit_code == 1, result.output
    assert not (tmp_path / "tiny-fp32").exists()
    failed = tmp_path / "tiny-fp32.failed"
    assert {"plan.json", "plan.txt", "parity.json", "manifest.json"} <= {
        p.name for p in failed.iterdir()
    }
    assert "plan gate failed" in result.output
    assert "plan_min_ne_flop_share (static, uncalibrated at M1): 0 >= 0.999: FAIL" in result.output
    text = (failed / "plan.txt").read_text()
    assert "R-FP32" in text and "convert in fp16" in text


def test_plan_gate_values_are_validated(tmp_path: Path, checkpoint: Path) -> None:
    file = recipe(tmp_path, checkpoint, "tiny-bad", "float16")
    file.write_text(file.read_text().replace("0.999", "1.5"))
    with pytest.raises(RecipeError, match="plan_min_ne_flop_share"):
        load_recipe(file)
    gates = load_recipe(recipe(tmp_path, checkpoint, "tiny-ok", "float16")).gates
    assert "plan_max_ne_segments" not in gates.parity_thresholds()
