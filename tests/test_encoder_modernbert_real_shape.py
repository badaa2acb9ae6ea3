"""ModernBERT-base at its real shape (tests/data/configs/modernbert-base.json: 22 layers, local
window 64 every layer but each third, theta 160000 global / 10000 local), transformers' own
class with perturbed random weights, B=1, L=96. Slow tier.

Torch fp32/fp16 gates, the right-padding invariance, and the emitted NE island (partitioned,
pre-normalised embedding table) run by the MIL evaluator when it is available.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from encoder_models import THRESHOLDS, TinyEncoder, build_encoder, real_shape_config
from tiny_models import perturb_

from converter.coreml.program import to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.tasks.encoder import program_module
from converter.tasks.encoder_contract import island_contract
from graph_passes.encoder import BC1LEncoder, EncoderIO
from graph_passes.masks import key_mask_from_padding
from graph_passes.partition import Island, host_embedding
from parity.encoder_gates import MIL_LEVEL, check_encoder, encoder_inputs
from parity.encoder_mil import output_runner
from parity.measure import folded_rows

pytestmark = pytest.mark.slow

LENGTH = 96


def random_real_shape(name: str) -> torch.nn.Module:
    """transformers' ModernBertModel at a shared config's shape, random weights drawn directly
    (std 0.02), norm weights and biases perturbed. (transformers' own truncated-normal init
    of 149-307 M parameters takes most of a minute on a busy 2-core machine.)"""
    from transformers import ModernBertModel
    from transformers.initialization import no_init_weights

    config = real_shape_config(name)
    torch.manual_seed(1)
    with no_init_weights():
        model = ModernBertModel(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.02 if "norm" not in pname else torch.ones_like(p))
    perturb_(model, scale=0.02)
    return model


@pytest.fixture(scope="module")
def real() -> Iterator[TinyEncoder]:
    model = random_real_shape("modernbert-base")
    # A full window (local bands cut at distance 64 inside it) and a padded fixture.
    yield build_encoder(
        model.config, "last-hidden-state", model=model, batch=1, length=LENGTH, lengths=(96, 41)
    )


def test_real_shape_spec(real: TinyEncoder) -> None:
    layers = real.canonical.spec.layers
    assert len(layers) == 22
    assert [ls.attention.window for ls in layers[:4]] == [None, 64, 64, None]
    assert [ls.attention.rope_theta for ls in layers[:3]] == [160000.0, 10000.0, 10000.0]
    assert sum(p.numel() for p in real.model.parameters()) == pytest.approx(149.0e6, rel=0.01)


def test_torch_gates_pass(real: TinyEncoder) -> None:
    report, rows = check_encoder(real.module, real.batches, real.references, THRESHOLDS)
    assert report.passed, [g for g in report.gates if not g.passed]
    assert all(row.fp32_rel_error <= 1e-4 for row in report.layers)
    assert {row.slice for row in rows} == {"padded", "full-window"}


@pytest.mark.parametrize("length", [64])
def test_right_padding_amount_leaves_real_tokens_within_the_gate(
    real: TinyEncoder, length: int
) -> None:
    fixture = next(f for f in real.fixtures if len(f.token_ids) == 41)
    want = real.references[fixture.name].output  # the unpadded run
    module = BC1LEncoder(real.canonical, EncoderIO(1, length, "token-ids", "last-hidden-state"))
    ids = torch.zeros(1, length, dtype=torch.int64)
    ids[0, :41] = torch.tensor(fixture.token_ids)
    mask = key_mask_from_padding((torch.arange(length) < 41).long()[None])
    with torch.no_grad():
        got = module(ids, mask)[0, :41]
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err <= THRESHOLDS.fp32_logits_rel_error


def test_emitted_island_passes_at_mil_level(real: TinyEncoder, tmp_path: Path) -> None:
    if importlib.util.find_spec("parity.mil") is None:
        pytest.skip("MIL evaluator not available")
    program = program_module(real.module, "float16")
    inputs, outputs = island_contract(program, "float16")
    mlmodel = to_mlprogram(
        trace(Island(program).eval(), inputs),
        inputs,
        outputs,
        TARGETS["macOS14"].ct_target(),
        "float16",
    )
    package = tmp_path / "island.mlpackage"
    mlmodel.save(str(package))
    host = host_embedding(real.canonical, LENGTH, prenormalize=True)
    runner = output_runner({"island": package}, real.module, host, "float16")
    report, rows = check_encoder(
        real.module,
        real.batches,
        real.references,
        THRESHOLDS,
        {MIL_LEVEL: runner},
        torch_levels=False,  # gated in test_torch_gates_pass
    )
    mil = [g for g in report.gates if g.implementation == MIL_LEVEL]
    assert mil and all(g.passed for g in mil), mil
    print({row.name: row.cosine for row in rows})


def test_mmbert_shape_folded_batch_is_exact_in_fp32() -> None:
    """mmBERT-base shape (306.9 M parameters, theta 160000 for local layers too) at B=3, L=64:
    every layer of every real token within the fp32 gate, three samples folded into one
    sequence with a block-diagonal mask."""
    model = random_real_shape("mmbert-base-shape")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(306.9e6, rel=0.01)
    t = build_encoder(
        model.config,
        "last-hidden-state",
        model=model,
        batch=3,
        length=64,
        lengths=(64, 23, 50),
    )
    assert {ls.attention.rope_theta for ls in t.canonical.spec.layers} == {160000.0}
    (batch,) = t.batches
    *x, key_mask = encoder_inputs(t.module, batch, torch.float32)
    with torch.no_grad():
        states = t.module.run_layers(t.module.embed(x[0], None), key_mask)
    for r, fixture in enumerate(batch.fixtures):
        n = len(fixture.token_ids)
        for i, state in enumerate(states):
            ref = t.references[fixture.name].hidden[i]
            got = folded_rows(64)(state, r, n)
            err = float((got.double() - ref.double()).norm() / ref.double().norm())
            assert err <= THRESHOLDS.fp32_layer_rel_error, (fixture.name, i, err)
