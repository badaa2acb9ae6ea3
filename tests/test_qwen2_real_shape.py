"""Qwen2.5-0.5B at its real shape through `anec convert`, from a local Hugging Face directory.

Slow tier. No Qwen2 weights ship on PyPI, so transformers' own Qwen2ForCausalLM is built from
the real config (tests/data/configs/qwen2.5-0.5b.json), every parameter perturbed after random
initialisation (zero biases and unit norm weights would hide a dropped bias or a wrong norm),
saved as safetensors, and converted with token-id fixtures. Real width and vocabulary, two
layers deep (CI); full depth is bench material (`python bench/compress.py methods --method
fp16 --layers 24`, every gate, in bench/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_configs import config_dict
from tiny_models import perturb_

from converter.checkpoints.loading import load_checkpoint
from converter.coreml.program import live_ops, to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.recipe import load_recipe
from converter.tasks.decoder_contract import tensor_contract
from converter.tasks.text_generation import reference_runs, rewrite_decoder
from parity.decoder_gates import check_decoder
from parity.thresholds import Thresholds

pytestmark = pytest.mark.slow
LAYERS = 2


RECIPE = """\
name: qwen-real-shape
task: text-generation
source:
  kind: hf-dir
  path: {path}
shapes:
  batch: 1
  sequence_length: 64
io:
  logits: last
fixtures:
  token_ids:
    - [151643, 785, 6722, 315, 9625, 374]
    - [40, 1079, 264, 3460, 4128, 1614, 13, 3555, 646, 358, 1492, 498, 448, 3351, 30]
  padded_variants: true
"""


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**config_dict("qwen2.5-0.5b"), "num_hidden_layers": LAYERS})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        perturb_(model, scale=0.02)
    path = tmp_path_factory.mktemp("qwen2.5-0.5b-random")
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_real_shape_qwen2_rewrite_is_exact_and_converts(qwen_dir: Path, tmp_path: Path) -> None:
    recipe_file = tmp_path / "qwen.yaml"
    recipe_file.write_text(RECIPE.format(path=qwen_dir))
    recipe = load_recipe(recipe_file)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    assert ckpt.tokenizer is None  # token-id fixtures only
    rewrite = rewrite_decoder(recipe, ckpt)
    report = check_decoder(
        rewrite.module,
        rewrite.batches,
        reference_runs(ckpt, rewrite),
        rewrite.embed_table,
        Thresholds(**recipe.gates.parity_thresholds()),
    )
    gates = {g.name: g for g in report.gates}
    # The rewrite is exact: every layer, q/k/v biases included, within the fp32 gate.
    assert len(report.layers) == LAYERS
    assert gates["fp32_layer_rel_error"].passed and gates["fp32_logits_rel_error"].passed
    assert gates["finite_outputs"].passed and gates["deterministic"].passed
    # Random weights give near-uniform logits (SPEC 4: weak witnesses), so fp16 may flip an
    # argmax whose margin is below fp16's resolution. Every flip must be such a position:
    # one the argmax certificate (top1 - top2 > 2 * max logit error) does not cover.
    for row in report.fixtures:
        flipped = round((1 - row.fp16_argmax_agreement) * row.tokens)
        assert flipped <= row.tokens - row.certified_positions, row

    # The same module converts at the real shape: 151,936 tokens in 16,384-token chunks.
    module = rewrite.module
    assert module.chunk_sizes == [16384] * 9 + [151936 - 9 * 16384]
    inputs, outputs = tensor_contract(module, "float16")
    assert [t.name for t in inputs] == ["inputs_embeds", "key_mask"]  # tied embeddings
    mlmodel = to_mlprogram(
        trace(module, inputs), inputs, outputs, TARGETS[recipe.target].ct_target(), "float16"
    )
    ops = live_ops(mlmodel)
    assert ops["conv"] == 4 * LAYERS + 10
    assert ops["softmax"] == 14 * LAYERS
