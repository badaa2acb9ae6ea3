"""Both decision recipes at mmBERT-base width (tests/data/configs/mmbert-base-shape.json: D=768,
12 heads, I=1152, theta 160000, window 64) with three encoder layers (global, local, local) and
the documented two-layer head, randomly initialised and fully perturbed. Slow tier; one
conversion per recipe shared by the module's tests. The vocabulary is cut to 4,096 rows here
to keep the host table small in CI (the table never enters the island); full depth and the
full vocabulary are bench/ material.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from decision_models import head_config, make_head, save_checkpoint, with_markers
from encoder_models import random_sequences, real_shape_config
from tiny_models import perturb_

from converter.pipeline.run import ConvertResult, convert
from converter.recipe import load_recipe, recipe_from_dict, recipe_to_dict

pytestmark = pytest.mark.slow
VOCAB = 4096
RECIPES = ("decision-mmbert-b1-l96-k4", "decision-mmbert-b3-l64-k4")


def mmbert_encoder() -> torch.nn.Module:
    from transformers import ModernBertModel
    from transformers.initialization import no_init_weights

    config = real_shape_config("mmbert-base-shape", num_hidden_layers=3, vocab_size=VOCAB)
    torch.manual_seed(1)
    with no_init_weights():
        model = ModernBertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.02 if "norm" not in name else torch.ones_like(p))
        perturb_(model, scale=0.02)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ConvertResult]]:
    root = tmp_path_factory.mktemp("decision")
    encoder = mmbert_encoder()
    data = head_config(768, scorer={"widths": [768, 256, 1], "activation": "gelu"})
    # Perturbation at the real init's scale; scorer scaled until the candidates are peaked
    # (max raw probability about 0.8; reference margins 0.2 to 2.2 logits, narrow ones too).
    _, tensors = make_head(encoder, data, peak=40.0, scale=0.02, action_peak=8.0)
    path = save_checkpoint(root / "ckpt", encoder, data, tensors)
    results = {}
    for name in RECIPES:
        recipe = load_recipe(Path("recipes") / f"{name}.yaml")
        length = recipe.shapes.sequence_length
        seqs = with_markers(random_sequences(7, (length, 41, 23, length - 5), VOCAB, first=1))
        raw = recipe_to_dict(recipe)
        raw.update(source={"kind": "hf-dir", "path": str(path)},
                   fixtures={"token_ids": seqs, "padded_variants": False})  # fmt: skip
        results[name] = convert(recipe_from_dict(raw), root / "out")
    yield results


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_converts_with_every_gate_and_one_ne_segment(
    converted: dict[str, ConvertResult], name: str
) -> None:
    result = converted[name]
    parity = json.loads((result.report_dir / "parity.json").read_text())
    assert result.exit_code == 0, [g for g in parity["gates"] if not g["passed"]]
    levels = {(g["level"], g["implementation"]) for g in parity["gates"]}
    assert {("torch-fp32", "torch-fp32"), ("torch-fp16", "partitioned-fp16"),
            ("mil-fp32", "mil-fp32"), ("mil-fp16", "mil-fp16")} <= levels  # fmt: skip
    slices = {s for row in parity["decision_requests"] for s in row["slices"]}
    assert {"padded", "full-window", "adversarial-mask", "narrow-margin"} <= slices
    plan = json.loads((result.report_dir / "plan.json").read_text())
    assert [g["value"] for g in plan["gates"] if g["name"] == "plan_max_ne_segments"] == [1] * 5
    manifest = json.loads((result.report_dir / "manifest.json").read_text())
    crossing = {(b["source"], b["target"]): b for b in manifest["boundaries"]}
    rows = crossing[("embedding (host)", "island")]["tensors"][0]
    b, l_ = manifest["batch"], manifest["sequence_length"]
    assert rows["shape"] == [b, l_, 768]
    # fp16 embeddings: 147,456 bytes at B=1, L=96; 294,912 at B=3, L=64 (+ the key mask).
    assert b * l_ * 768 * 2 == {1: 147_456, 3: 294_912}[b]
    assert crossing[("embedding (host)", "island")]["bytes"] == b * l_ * 768 * 2 + b * l_ * 2


@pytest.mark.parametrize("name", RECIPES)
def test_plan_inspect_predicts_one_ne_segment_and_counts_the_boundary_copies(
    converted: dict[str, ConvertResult], name: str
) -> None:
    from click.testing import CliRunner

    from converter.commands import main

    island = converted[name].report_dir / f"{name}.island.mlpackage"
    result = CliRunner().invoke(main, ["plan-inspect", str(island), "--json"])
    assert result.exit_code == 0, result.output
    package = json.loads(result.output)["packages"][0]
    static = package["static"]
    assert (static["evidence"], static["calibration"]) == ("static", "uncalibrated")
    summary = static["functions"][0]["summary"]
    b, length = (1, 96) if "b1" in name else (3, 64)
    assert summary["ne_segments"] == 1 and summary["boundary_bytes"] == 0
    # The island's only copies are its endpoints: embedding rows + key mask in, hidden out.
    assert summary["input_bytes"] == b * length * (768 + 1) * 2
    assert summary["output_bytes"] == b * length * 768 * 2
    floors = package["predicted"]["floors"]
    assert {f["chip"] for f in floors} >= {"M1", "M2", "M3", "M4"}
    for f in floors:
        assert f["evidence"] == "predicted"
        assert f["components_ms"]["copies"] > 0 and f["components_ms"]["outputs"] > 0
