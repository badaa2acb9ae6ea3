"""Qwen2.5-0.5B and Qwen3-0.6B at their real width through the cached-decoder pipeline.

Slow tier. No weights ship for them, so transformers' own models are built from the vendored
configs (tests/data/configs), two layers deep, the vocabulary cut to 20,000 rows (two LM-head
chunks; the vocabulary is not part of a layer's width), every parameter perturbed and the
final norm's gain raised so the logits are peaked, then converted by `anec convert` with cache
style state: one multifunction package (prefill 64, decode, extend 4 over 256 slots) whose
cache gates run a prefill and 64 sequential decode steps in the MIL evaluator's fp16 profile
against transformers' full recompute. Full depth and the full vocabulary are bench/kv.py
material.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_configs import build_causal_lm
from tiny_models import DEFAULT_KV_GATES, run_anec

pytestmark = pytest.mark.slow

CASES = {
    "qwen2": ("qwen2.5-0.5b", "Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("qwen3-0.6b", "Qwen3ForCausalLM", "Qwen3Config"),
}
# Qwen3 is also split by a weight budget: a layer is 31.5 MB in fp16 and the 20,000-row LM head
# 41 MB, so 75 MB puts layer 0 in one package and layer 1 with the head in another.
BUDGET_MB = {"qwen3": 75}
LAYERS = 2
VOCAB = 20_000
# Logits spread enough (std about 5) that many reference margins exceed the flip gate's 0.5:
# an argmax flip, a wrong cache axis or an off-by-one position shows, not only a small error.
PEAK = 8.0

RECIPE = """\
name: {name}-kv
task: text-generation
source:
  kind: hf-dir
  path: {path}
shapes:
  batch: 1
  sequence_length: 64
io:
  logits: last
target: macOS15
fixtures:
  token_ids:
    - [40, 1079, 264, 3460, 4128, 1614, 13, 3555, 646, 358, 1492, 498, 448, 3351, 30]
  padded_variants: false
cache:
  style: state
  length: 256
  prefill: 64
  extend: 4
  decode_steps: 64
{budget}"""


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_width_converts_statefully_with_every_cache_gate(name: str, tmp_path: Path) -> None:
    config_name, model_class, config_class = CASES[name]
    config = build_causal_lm(
        config_name, model_class, config_class, tmp_path / "ckpt", LAYERS, VOCAB, peak=PEAK
    )
    recipe = tmp_path / "recipe.yaml"
    budget = f"  package_budget_mb: {BUDGET_MB[name]}\n" if name in BUDGET_MB else ""
    text = RECIPE.format(name=name, path=tmp_path / "ckpt", budget=budget)
    recipe.write_text(text, encoding="utf-8")
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    artifact = tmp_path / "out" / f"{name}-kv"
    parity = json.loads((artifact / "parity.json").read_text())
    failed = [g for g in parity["gates"] if not g["passed"]]
    assert result.exit_code == 0 and not failed, (result.output[-2000:], failed)
    assert {g["name"] for g in parity["gates"] if g["level"] == "kv-cache"} == DEFAULT_KV_GATES
    detail = json.loads((artifact / "kv_parity.json").read_text())
    assert [row["decode_steps"] for row in detail["fixtures"]] == [64]
    # The flip gate had positions to judge (reference margin above 0.5).
    assert detail["fixtures"][0]["flip_judged_positions"] >= 16, detail["fixtures"]
    cache = json.loads((artifact / "manifest.json").read_text())["kv_cache"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if name not in BUDGET_MB:
        # One cache holding K and V of every layer at the checkpoint's kv heads and head size.
        assert str([2 * LAYERS, config.num_key_value_heads, 256, head_dim]) in json.dumps(cache)
    else:
        # Two packages within the budget, each with its own cache of its own layer, handing the
        # residual stream (1, D, 1, T) on, each planned all on the NE (a prediction).
        assert cache["chunking"]["weight_bytes"] == [31_457_280, 72_417_280]
        assert max(cache["chunking"]["weight_bytes"]) <= BUDGET_MB[name] * 1_000_000
        first, second = cache["chunks"]
        assert first["layers"] == [0, 1] and second["layers"] == [1, 2]
        for chunk in (first, second):
            assert chunk["cache"]["shape"] == [2, config.num_key_value_heads, 256, head_dim]
            assert (artifact / chunk["package"]).is_dir()
        handoff = first["passes_to_next"]["per_call"]["decode"]
        assert handoff["shape"] == [1, config.hidden_size, 1, 1] and handoff["bytes"] == 2048
        for i in (0, 1):
            plan = json.loads((artifact / f"plan.chunk{i}.json").read_text())
            summary = plan["functions"][0]["summary"]
            assert summary["ne_segments"] == 1 and summary["ne_share"]["flops"] == 1.0
    print(json.dumps({g["name"]: g["value"] for g in parity["gates"] if g["level"] == "kv-cache"}))
