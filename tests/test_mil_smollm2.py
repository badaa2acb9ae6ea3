"""The MIL level on the packaged SmolLM2 artifact (slow: reuses the session conversion).

Done-when figures of the MIL evaluator: the emitted program in the fp16 profile keeps every
argmax of the original model on the fixtures with finite outputs, its per-layer errors are
reported, the fp32 profile matches the BC1L module within 1e-5 at every layer, and
parity.json shows every level, the Core ML one marked not run on this platform.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

LAYERS = 30


@pytest.fixture(scope="module")
def doc(smollm2_artifact: Path) -> dict[str, Any]:
    return json.loads((smollm2_artifact / "parity.json").read_text())


def _run(doc: dict[str, Any], implementation: str) -> dict[str, Any]:
    return next(r for r in doc["conversion"]["runs"] if r["implementation"] == implementation)


def test_fp16_program_keeps_every_argmax_with_finite_outputs(doc: dict[str, Any]) -> None:
    gates = {(g["name"], g["implementation"]): g for g in doc["gates"]}
    assert gates[("fp16_argmax_agreement", "mil-fp16")]["value"] == 1.0
    assert gates[("finite_outputs", "mil-fp16")]["passed"]
    assert gates[("fp16_max_abs_dprob", "mil-fp16")]["passed"]
    run = _run(doc, "mil-fp16")
    assert len(run["layer_rel_error"]) == LAYERS
    assert all(0 < float(e) < 0.05 for e in run["layer_rel_error"])  # reported, finite
    assert run["slices"]["all"]["positions"] > 0


def test_fp32_program_matches_the_bc1l_module_at_every_layer(doc: dict[str, Any]) -> None:
    run = _run(doc, "mil-fp32")
    errors = [float(e) for e in run["layer_rel_error"]]
    assert len(errors) == LAYERS and max(errors) <= 1e-5
    assert float(run["logits_rel_error"]) <= 1e-5
    assert doc["conversion"]["markers"] == [f"layer_{i}_out_cast_fp16" for i in range(LAYERS)]


def test_every_level_is_in_the_report(doc: dict[str, Any], smollm2_artifact: Path) -> None:
    levels = {lv["implementation"]: lv for lv in doc["levels"]}
    assert {"torch-fp32", "torch-fp16", "mil-fp32", "mil-fp16", "mil-fp16-acc"} <= set(levels)
    assert levels["coreml-cpu-and-ne"]["status"].startswith("not run on this platform")
    acc = _run(doc, "mil-fp16-acc")
    assert all(math.isfinite(float(e)) for e in acc["layer_rel_error"])
    html = (smollm2_artifact / "parity.html").read_text()
    assert html.count("<svg") == 3 and "Residual stream range" in html  # errors, range, margins
