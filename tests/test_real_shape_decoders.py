"""Decoder architectures at their real width, two or three layers deep, through the pipeline.

Slow tier. No weights ship for these checkpoints, so transformers' own ``*ForCausalLM`` is
built from the vendored config (tests/data/configs) with ``num_hidden_layers`` cut to a few
layers, the vocabulary cut to 20,000 rows (two LM-head chunks, the second a remainder: the
vocabulary is not part of a layer's width, and at 151,936 or 262,144 rows the fp16 torch
logits alone took 2 minutes here) and every parameter perturbed after random
initialisation (SPEC section 4), saved as
a local Hugging Face directory and read through `anec`'s own loading, rewrite and gates:
every layer within the fp32 gate against transformers, fp16 argmax flips only where the
argmax certificate does not cover the position, and the module converts to an ML program.
Full depth belongs in bench/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers
from real_configs import build_causal_lm

from converter.checkpoints.loading import load_checkpoint
from converter.coreml.program import live_ops, to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.recipe import load_recipe
from converter.tasks.decoder_contract import tensor_contract
from converter.tasks.text_generation import reference_runs, rewrite_decoder
from parity.decoder_gates import check_decoder
from parity.thresholds import Thresholds

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class RealShape:
    """One row: a vendored config, transformers' classes, how deep to cut it, token ids."""

    config: str
    config_class: str
    model_class: str
    layers: int
    token_ids: tuple[tuple[int, ...], ...]
    layer_types: tuple[str, ...] = ()  # replaces the config's (cut) list where given


VOCAB = 20_000  # two LM-head chunks: 16,384 + 3,616


CASES = {
    "qwen3": RealShape(
        "qwen3-0.6b", "Qwen3Config", "Qwen3ForCausalLM", 2,
        ((40, 1079, 264, 3460, 4128, 1614, 13, 3555, 646, 358, 1492, 498, 448, 3351, 30),),
    ),
    # One local layer (theta 1e4, window 512) and one global layer (theta 1e6); at L = 64 the
    # window hides nothing: tests/test_archs.py checks it with a window of 4.
    "gemma3": RealShape(
        "gemma-3-270m", "Gemma3TextConfig", "Gemma3ForCausalLM", 2,
        ((2, 818, 5279, 529, 7001, 563, 496, 1584, 3331, 19764, 13, 108, 1018, 7, 3),),
        ("sliding_attention", "full_attention"),
    ),
}  # fmt: skip

RECIPE = """\
name: {name}-real-shape
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
  token_ids: {ids}
  padded_variants: true
"""


def build_checkpoint(case: RealShape, path: Path) -> transformers.PretrainedConfig:
    return build_causal_lm(
        case.config, case.model_class, case.config_class, path, case.layers, VOCAB,
        case.layer_types,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_width_rewrite_is_exact_and_converts(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    config = build_checkpoint(case, tmp_path / "checkpoint")
    recipe_file = tmp_path / "recipe.yaml"
    ids = [list(t) for t in case.token_ids]
    recipe_file.write_text(RECIPE.format(name=name, path=tmp_path / "checkpoint", ids=ids))
    recipe = load_recipe(recipe_file)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    rewrite = rewrite_decoder(recipe, ckpt)
    assert rewrite.spec.architecture == name
    report = check_decoder(
        rewrite.module,
        rewrite.batches,
        reference_runs(ckpt, rewrite),
        rewrite.embed_table,
        Thresholds(**recipe.gates.parity_thresholds()),
    )
    gates = {g.name: g for g in report.gates}
    assert len(report.layers) == case.layers
    assert gates["fp32_layer_rel_error"].passed and gates["fp32_logits_rel_error"].passed
    assert gates["finite_outputs"].passed and gates["deterministic"].passed
    # Random weights give near-uniform logits (SPEC 4: weak witnesses): fp16 may flip only
    # an argmax the certificate (top1 - top2 > 2 * max logit error) does not cover.
    for row in report.fixtures:
        flipped = round((1 - row.fp16_argmax_agreement) * row.tokens)
        assert flipped <= row.tokens - row.certified_positions, row

    module = rewrite.module
    inputs, outputs = tensor_contract(module, "float16")
    mlmodel = to_mlprogram(
        trace(module, inputs), inputs, outputs, TARGETS[recipe.target].ct_target(), "float16"
    )
    assert module.chunk_sizes == [16384, VOCAB - 16384]
    ops = live_ops(mlmodel)
    assert ops["conv"] == 4 * case.layers + len(module.chunk_sizes)
    assert ops["softmax"] == config.num_attention_heads * case.layers
