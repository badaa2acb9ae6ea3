"""plan-inspect on the real SmolLM2 artifact, and against its naive (B, L, C) baseline (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from converter.commands import main
from converter.pipeline.manifest import Manifest

pytestmark = pytest.mark.slow


def inspect_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["plan-inspect", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_every_op_has_a_device_and_rule_and_the_layers_are_all_on_the_ne(
    smollm2_artifact: Path,
) -> None:
    doc = inspect_json(str(smollm2_artifact))
    (package,) = doc["packages"]
    static = package["static"]
    assert static["evidence"] == "static" and static["calibration"] == "uncalibrated"
    (function,) = static["functions"]
    rows = function["rows"]
    manifest = Manifest.model_validate_json((smollm2_artifact / "manifest.json").read_text())
    assert len(rows) == sum(manifest.package.live_ops.values())
    assert all(r["device"] and r["rule"] and r["confidence"] for r in rows)
    layers = {r["layer"] for r in rows if r["layer"] is not None}
    assert layers == set(range(len(manifest.rope_theta)))
    assert all(r["device"] == "NE" for r in rows if r["layer"] is not None)
    summary = function["summary"]
    assert summary["layers_all_ne"] == summary["layers"] == 30
    # Nothing leaves the NE, so nothing needs a reason; were there a CPU op it would be here.
    assert [r for r in rows if r["device"] != "NE"] == summary["breakers"] == []
    assert summary["ne_segments"] == 1
    floors = package["predicted"]["floors"]
    assert {f["chip"] for f in floors} >= {"M1", "M2", "M3", "M4", "A17 Pro"}
    assert all(f["evidence"] == "predicted" for f in floors)
    # 270 MB of fp16 weights for 14 GFLOP: streaming the weights bounds every chip.
    assert {f["bound"] for f in floors} == {"weights"}


def test_the_artifact_ships_its_plan_with_the_recipe_gates_passed(smollm2_artifact: Path) -> None:
    plan = json.loads((smollm2_artifact / "plan.json").read_text())
    assert plan["evidence"] == "static" and plan["calibration"] == "uncalibrated"
    assert plan["gates"] and all(g["passed"] for g in plan["gates"])


def test_the_naive_baseline_differs_where_the_rewrite_says_it_should(
    smollm2_artifact: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        main, ["plan-baseline", "smollm2-135m-draft", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    naive = tmp_path / "smollm2-135m-draft-naive"
    baseline = json.loads((naive / "baseline.json").read_text())
    assert baseline["layers"] == 30 and "no parity gates" in baseline["not_an_artifact"]
    doc = inspect_json("--compare", str(smollm2_artifact), str(naive))
    m = {x["name"]: x for x in doc["comparison"]["metrics"]}
    assert m["layers"]["a"] == m["layers"]["b"] == 30
    assert m["rank5_tensors"]["a"] == 0 < m["rank5_tensors"]["b"]
    assert m["transposes_per_layer"]["b"] > m["transposes_per_layer"]["a"]
    # The naive vocabulary-wide head exceeds the M1 axis limit; anec's chunks do not.
    assert m["off_ne_ops"]["a"] == 0 and m["off_ne_ops"]["b"] == 1
    assert "R-LMHEAD" in m["off_ne"]["b"]
    assert m["floor_ms M1"]["evidence"] == "predicted"
    assert m["floor_ms M1"]["b"] > m["floor_ms M1"]["a"]
