"""The program-level fp32 check of a Gemma 3 whose sliding window binds inside the sequence.

A window of 4 on layers 0-2 and a global layer 3, at a 32-slot window: the program applies
each local layer's window mask, so the fp64 baseline the ``mil-fp32`` profile is compared with
must too (`BC1LDecoder.layer_masks`). Given one causal mask for every layer it charged the
program a relative error of 1.2 from layer 0 on and refused a correct conversion. A program
whose local layers lose their window (the mutant) must fail the same check.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tiny_models import Tiny, build_tiny

from converter.coreml.program import to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.tasks.decoder_contract import tensor_contract
from graph_passes.decoder import BC1LDecoder
from graph_passes.markers import mark_layer_outputs

LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
LENGTH = 32  # fixtures of 5 to 16 tokens plus their 32-token full-window variants


@pytest.fixture(scope="module")
def gemma() -> Tiny:
    """Four layers, window 4 on 0-2, query_pre_attn_scalar 64 != head_dim 16, one kv head."""
    return build_tiny(
        "gemma3",
        length=LENGTH,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        max_position_embeddings=64,
    )


def emit(module: BC1LDecoder, out: Path) -> Path:
    """``module`` converted as ``anec convert`` converts it (layer markers included)."""
    inputs, outputs = tensor_contract(module, "float16")
    traced = trace(module, inputs)
    mark_layer_outputs(traced, len(module.layers))
    package = out / "program.mlpackage"
    to_mlprogram(traced, inputs, outputs, TARGETS["macOS14"].ct_target(), "float16").save(
        str(package)
    )
    return package


def test_the_window_binds_inside_the_sequence(gemma: Tiny) -> None:
    layers = gemma.module.decoder_layers()
    assert [layer.window for layer in layers] == [4, 4, 4, None]
    assert gemma.module.windows == [4]
    assert max(len(f.token_ids) for f in gemma.fixtures) == LENGTH


def test_a_windowed_program_passes_every_conversion_gate(gemma: Tiny, tmp_path: Path) -> None:
    report = gemma.check_program(emit(gemma.module, tmp_path))
    assert report.passed, [g for g in report.gates if not g.passed]
    fp32 = next(run for run in report.runs if run.implementation == "mil-fp32")
    # fp32 rounding only, as on a model without a window (was 1.2 from layer 0 on).
    assert max(fp32.layer_rel_error) < 1e-5, fp32.layer_rel_error


def test_a_program_that_drops_the_window_fails_the_fp32_check(gemma: Tiny, tmp_path: Path) -> None:
    mutant = copy.deepcopy(gemma.module)
    mutant.windows = []  # every layer now attends with the causal mask alone
    report = gemma.check_program(emit(mutant, tmp_path))
    gates = {(g.name, g.implementation): g for g in report.gates}
    per_layer = gates[("mil_fp32_layer_rel_error", "mil-fp32")]
    assert not per_layer.passed
    fp32 = next(run for run in report.runs if run.implementation == "mil-fp32")
    assert fp32.layer_rel_error[0] > 1e-3  # found at the first local layer
