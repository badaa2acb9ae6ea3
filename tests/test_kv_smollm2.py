"""SmolLM2 at real width through the cached-decoder pipeline, in CI's budget: the packaged
checkpoint's first two layers (embeddings, norms and LM head as shipped) saved as a Hugging
Face directory and converted with the kv recipe's settings (cache style state, 512 slots,
prefill 64, extend 4), two fixture prompts and 64 sequential decode steps each.

Full depth (30 layers, six prompts) is `anec convert recipes/smollm2-135m-draft-kv.yaml` and
`bench/kv.py`; the figures are in bench/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_models import DEFAULT_KV_GATES, run_anec

from converter.recipe import locate_recipe

pytestmark = pytest.mark.slow

LAYERS = 2
PROMPTS = 2


@pytest.fixture(scope="module")
def kv_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two-layer SmolLM2 kv artifact, converted once through the CLI."""
    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import load_recipe

    root = tmp_path_factory.mktemp("smollm2-kv")
    shipped = locate_recipe("smollm2-135m-draft-kv")
    recipe = load_recipe(shipped)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model = ckpt.model
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    ckpt.tokenizer.save_pretrained(root / "ckpt")
    data = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    data["name"] = "smollm2-kv-2-layers"
    data["source"] = {"kind": "hf-dir", "path": str(root / "ckpt")}
    data["fixtures"]["prompts"] = data["fixtures"]["prompts"][:PROMPTS]
    file = root / "recipe.yaml"
    file.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = run_anec("convert", file, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / data["name"]


def test_every_gate_passes_and_weights_are_stored_once(kv_artifact: Path) -> None:
    parity = json.loads((kv_artifact / "parity.json").read_text())
    kv = [g for g in parity["gates"] if g["level"] == "kv-cache"]
    assert {g["name"] for g in kv} == DEFAULT_KV_GATES
    assert all(g["passed"] for g in parity["gates"])
    detail = json.loads((kv_artifact / "kv_parity.json").read_text())
    assert [row["decode_steps"] for row in detail["fixtures"]] == [64] * PROMPTS
    sizes = json.loads((kv_artifact / "manifest.json").read_text())["kv_cache"]["sizes"]
    # Two layers hold few weights beside the 28M-parameter embedding-tied LM head, so the
    # program text weighs little: one package's bytes and the combined one's differ by it.
    assert sizes["package_ratio"] <= 1.05, sizes
    print(json.dumps({g["name"]: g["value"] for g in kv}), json.dumps(sizes))


def test_generate_matches_transformers_step_for_step(kv_artifact: Path) -> None:
    result = run_anec(
        "generate", kv_artifact, "--prompt", "The capital of France is",
        "--max-new-tokens", "64", "--check", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    doc = json.loads(out[out.index('{"backend"') :])  # after the loaders' progress bars
    assert doc["steps_matched"] == doc["steps"] == 64 and doc["passed"]
    assert "first_near_tie" in doc and len(doc["reference_gaps"]) == 64


def test_speculate_drafts_with_the_torch_module_and_checks_it_against_the_program(
    kv_artifact: Path,
) -> None:
    result = run_anec(
        "speculate", "--draft", kv_artifact, "--k", "2", "--texts", "1",
        "--max-new-tokens", "12", "--check-mil", "1", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    doc = json.loads(out[out.index('{"draft"') :])
    assert doc["draft_backend"] == "torch" and doc["label"].startswith("self-acceptance")
    (row,) = doc["rows"]
    check = row["mil_check"]
    assert check["texts"] == 1 and check["backend_mean_accepted"] == row["mean_accepted_per_cycle"]
    # The draft is the target's own checkpoint: both drafts agree with it almost always.
    assert check["relative_difference"] <= 0.01, check
