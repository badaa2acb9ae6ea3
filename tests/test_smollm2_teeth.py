"""The gates have teeth on the real checkpoint: deliberately wrong SmolLM2 rewrites must fail.

Slow tier. The tiny-model variants (softmax axis, RoPE halves, dropped biases) are in
test_gates_teeth.py; these two need SmolLM2's real activations.
"""

from __future__ import annotations

import math

import pytest

from converter.recipe import load_recipe, locate_recipe
from converter.tasks.text_generation import Rewrite, reference_runs, rewrite_decoder
from parity.decoder_gates import check_decoder
from parity.reference import ReferenceRun
from parity.thresholds import Thresholds

pytestmark = pytest.mark.slow

FP16_MAX = 65504.0


@pytest.fixture(scope="module")
def setup(
    smollm2_checkpoint: object,
) -> tuple[object, Rewrite, dict[str, ReferenceRun], Thresholds]:
    recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
    rewrite = rewrite_decoder(recipe, smollm2_checkpoint)  # type: ignore[arg-type]
    references = reference_runs(smollm2_checkpoint, rewrite)  # type: ignore[arg-type]
    return recipe, rewrite, references, Thresholds(**recipe.gates.parity_thresholds())


def _gates(report: object) -> dict[str, bool]:
    return {g.name: g.passed for g in report.gates}  # type: ignore[attr-defined]


def test_removing_the_fp16_prescale_is_caught_in_fp16(setup: tuple) -> None:
    _, rewrite, references, thresholds = setup
    # Where the stored sum of squares overflows fp16 without a prescale: the first layer
    # whose norm sees a position with ||x|| > sqrt(65504).
    overflowing = [s for s in rewrite.scales if s.max_l2 > math.sqrt(FP16_MAX)]
    assert overflowing, "SmolLM2's residual stream should overflow an unscaled fp16 norm"
    first = int(overflowing[0].name.split(".")[1])
    try:
        for _, norm in rewrite.module.norms():
            norm.set_prescale(1.0)
        report = check_decoder(
            rewrite.module, rewrite.batches, references, rewrite.embed_table, thresholds
        )
    finally:
        for scale, (_, norm) in zip(rewrite.scales, rewrite.module.norms(), strict=True):
            norm.set_prescale(scale.prescale)
    gates = _gates(report)
    assert not report.passed
    assert gates["fp32_layer_rel_error"] and gates["fp32_logits_rel_error"]  # fp32 exact
    assert not gates["fp16_argmax_agreement"]
    assert report.first_diverging_layer == first


def test_changed_norm_epsilon_is_caught_by_the_per_layer_gate(setup: tuple) -> None:
    _, rewrite, references, thresholds = setup
    norms = rewrite.module.norms()
    saved = [(float(n.scaled_eps), n.eps) for _, n in norms]
    try:
        for _, norm in norms:
            norm.eps *= 10
            norm.scaled_eps.mul_(10)
        # One batch is enough to see layer 0 move (all of them took 44 s in CI).
        report = check_decoder(
            rewrite.module, rewrite.batches[:1], references, rewrite.embed_table, thresholds
        )
    finally:
        for (scaled, eps), (_, norm) in zip(saved, norms, strict=True):
            norm.eps = eps
            norm.scaled_eps.fill_(scaled)
    assert not _gates(report)["fp32_layer_rel_error"]
    assert report.first_diverging_layer == 0
