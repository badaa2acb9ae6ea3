"""fp16 range, exactly: power-of-two residual-stream and branch scales (graph_passes.stream_scale).

Random weights never overflow fp16, so these tests inflate norm gains of tiny checkpoints until
the fp32 residual stream exceeds 65,504 (and, for the branch scale, the MLP product too): the
scaled module must compute the checkpoint's function in fp32 and keep every fp16 value finite,
where the unscaled one overflows.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import (
    DEFAULT_THRESHOLDS,
    LENGTH,
    PAD_ID,
    VOCAB,
    build_module,
    one_torch_thread,
    random_sequences,
    tiny_hf_model,
    write_tiny_recipe,
)
from torch import nn

from converter.coreml.program import to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.pipeline.run import convert
from converter.recipe import load_recipe, locate_recipe
from converter.tasks import text_generation
from converter.tasks.decoder_contract import stream_deviations, tensor_contract
from converter.tasks.text_generation import choose_scales
from graph_passes.archs import adapt
from graph_passes.decoder import BC1LDecoder
from graph_passes.prescale import NormScale
from graph_passes.spec import CanonicalModel
from graph_passes.stream_scale import (
    LIMIT,
    LayerRange,
    StreamScaling,
    apply_stream_scaling,
    plan_stream_scaling,
    power_of_two_below,
    recording_ranges,
)
from parity.conversion import check_conversion
from parity.decoder_gates import check_decoder, module_inputs
from parity.fixtures import Batch, build_fixtures, make_batches
from parity.reference import run_reference
from parity.report import report_to_json, report_to_text

# Gains multiplied into layer 1 of each tiny checkpoint (chosen so the measured fp32 ranges
# exceed fp16: the stream in both, and the MLP product in both).
INFLATED = {
    "llama": {"post_attention_layernorm": 300.0},
    "gemma3": {"post_feedforward_layernorm": 30000.0, "pre_feedforward_layernorm": 3000.0},
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@dataclass
class Overflowing:
    model: nn.Module
    canonical: CanonicalModel
    batches: list[Batch]


def overflowing(arch: str) -> Overflowing:
    """A tiny perturbed checkpoint with inflated gains, its canonical model and batches."""
    model = tiny_hf_model(arch)
    with torch.no_grad():
        for name, gain in INFLATED[arch].items():
            getattr(model.model.layers[1], name).weight.mul_(gain)  # type: ignore[union-attr,index]
    fixtures = build_fixtures([], random_sequences(1000), None, LENGTH, VOCAB, True)
    batches = make_batches(fixtures, 3, LENGTH, PAD_ID)
    return Overflowing(model, adapt(model.config, model.state_dict()), batches)


@pytest.fixture(scope="module", params=sorted(INFLATED))
def case(request: pytest.FixtureRequest) -> Overflowing:
    return overflowing(request.param)


def fp16_values(module: BC1LDecoder, batches: list[Batch]) -> tuple[list[str], float]:
    """Submodules whose fp16 output held an inf or NaN on any batch, and the largest |value|
    any of them produced."""
    fp16 = copy.deepcopy(module).half()
    bad: list[str] = []
    largest = 0.0
    handles = []
    for name, sub in fp16.named_modules():

        def hook(_: nn.Module, __: object, out: object, name: str = name) -> None:
            nonlocal largest
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    if not torch.isfinite(t).all() and name not in bad:
                        bad.append(name)
                    largest = max(largest, float(t.float().abs().nan_to_num(0, 0, 0).max()))

        handles.append(sub.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for batch in batches:
                x, mask = module_inputs(fp16, batch, module.host_embedding_table(), torch.float16)
                fp16.head(fp16.run_layers(x, mask)[-1])
    finally:
        for h in handles:
            h.remove()
    return bad, largest


def test_power_of_two_below() -> None:
    assert power_of_two_below(LIMIT) == 1.0
    assert power_of_two_below(LIMIT + 1) == 0.5
    assert power_of_two_below(4 * LIMIT) == 0.25
    assert power_of_two_below(4 * LIMIT + 1) == 0.125
    with pytest.raises(ValueError, match="not finite"):
        power_of_two_below(float("inf"))


def test_a_model_within_range_is_left_alone() -> None:
    model = tiny_hf_model("llama")
    canonical = adapt(model.config, model.state_dict())
    fixtures = build_fixtures([], random_sequences(1000), None, LENGTH, VOCAB, True)
    batches = make_batches(fixtures, 3, LENGTH, PAD_ID)
    module, scaling, _ = choose_scales(canonical, build_module(canonical).io, batches)
    assert scaling.identity and module.spec.stream_scale == 1.0
    assert 0 < scaling.peak < LIMIT
    (deviation,) = stream_deviations(scaling)
    assert deviation.effective == 1.0 and "per-layer max |h|" in deviation.why


def test_scales_are_chosen_from_the_measured_ranges(case: Overflowing) -> None:
    module, scaling, _ = choose_scales(
        case.canonical, build_module(case.canonical).io, case.batches
    )
    assert scaling.peak > 65504, "the inflated checkpoint must overflow fp16 in fp32"
    assert scaling.scale < 1.0 and scaling.peak * scaling.scale <= LIMIT
    assert module.spec.stream_scale == scaling.scale
    (branch,) = scaling.branches
    assert branch.layer == 1 and branch.branch == "mlp"
    assert branch.measured > LIMIT >= branch.measured * branch.scale
    # The scaled model, measured again, stays within the limit wherever values were scaled.
    with recording_ranges(module.decoder_layers()) as ranges, torch.no_grad():
        for batch in case.batches:
            x, mask = module_inputs(module, batch, module.host_embedding_table(), torch.float32)
            module.run_layers(x, mask)
    for row in ranges:
        assert max(row.stream, row.mlp_product, row.mlp_out) <= LIMIT * (1 + 1e-6), row


def test_the_scaled_module_computes_the_checkpoint_function_in_fp32(case: Overflowing) -> None:
    module, scaling, _ = choose_scales(
        case.canonical, build_module(case.canonical).io, case.batches
    )
    references = {
        f.name: run_reference(case.model, f.token_ids) for b in case.batches for f in b.fixtures
    }
    report = check_decoder(
        module, case.batches, references, module.host_embedding_table(), DEFAULT_THRESHOLDS
    )
    by_name = {g.name: g for g in report.gates if g.implementation == "torch-fp32"}
    assert by_name["fp32_layer_rel_error"].passed, by_name["fp32_layer_rel_error"]
    assert by_name["fp32_logits_rel_error"].passed, by_name["fp32_logits_rel_error"]
    # The layer table reports the checkpoint's |h|, the stored fp16 values are scaled.
    assert max(row.fp32_max_abs for row in report.layers) > 65504
    assert max(row.fp16_max_abs for row in report.layers) <= LIMIT * 1.01
    report.stream = scaling
    text = report_to_text(report)
    assert f"stream scale s = {scaling.scale:g}" in text
    assert report_to_json(report)["stream"]["branch_scales"][0]["where"] == "layers.1.mlp.up"


def test_every_fp16_value_is_finite_once_scaled(case: Overflowing) -> None:
    unscaled = build_module(case.canonical)
    bad, _ = fp16_values(unscaled, case.batches)
    assert bad, "teeth: without the scales this checkpoint overflows fp16"
    module, _, _ = scaled(case)
    bad, largest = fp16_values(module, case.batches)
    assert not bad, f"non-finite fp16 values in {bad}"
    assert largest < 65504


def test_the_scaling_is_recorded_with_its_fp16_cost(case: Overflowing) -> None:
    plan = plan_stream_scaling(
        case.canonical.spec.layers, _measured(case)
    )  # the same plan choose_scales makes
    scaled, record = apply_stream_scaling(case.canonical, plan)
    names = {t.name for t in record.tensors}
    assert "embed.weight (times the embedding scale)" in names
    assert "layers.1.mlp.up.weight" in names
    for t in record.tensors:
        assert t.to_subnormal + t.to_zero <= t.elements
    # Counted exactly: recount one tensor by hand.
    up = next(t for t in record.tensors if t.name == "layers.1.mlp.up.weight")
    before = case.canonical.weights["layers.1.mlp.up.weight"].half()
    after = scaled.weights["layers.1.mlp.up.weight"].half()
    tiny = 2.0**-14
    assert up.to_subnormal == int(
        ((before.abs() >= tiny) & (after.abs() < tiny) & (after != 0)).sum()
    )
    assert up.to_zero == int(((before != 0) & (after == 0)).sum())
    # Untouched tensors are shared, not copied.
    assert (
        scaled.weights["layers.0.attn.q.weight"] is case.canonical.weights["layers.0.attn.q.weight"]
    )
    deviations = stream_deviations(record)
    assert deviations[0].effective == plan.scale
    assert f"{record.to_subnormal} weights moved into fp16 subnormals" in deviations[0].why
    assert any(d.where == "layers.1.mlp.up" for d in deviations)


def scaled(case: Overflowing) -> tuple[BC1LDecoder, StreamScaling, list[NormScale]]:
    """What the pipeline's rewrite builds: the module with its scales chosen."""
    return choose_scales(case.canonical, build_module(case.canonical).io, case.batches)


def _measured(case: Overflowing) -> list[LayerRange]:
    return list(scaled(case)[1].layers)


def test_post_norm_gains_carry_the_scale_as_effective_gains() -> None:
    case = overflowing("gemma3")
    plan = plan_stream_scaling(case.canonical.spec.layers, _measured(case))
    scaled, _ = apply_stream_scaling(case.canonical, plan)
    layer = scaled.spec.layers[1]
    original = case.canonical.spec.layers[1]
    assert layer.mlp_out_norm is not None and original.mlp_out_norm is not None
    assert layer.mlp_out_norm.weight_offset == 0.0 and original.mlp_out_norm.weight_offset == 1.0
    w = case.canonical.weights["layers.1.mlp_out_norm.weight"]
    assert torch.equal(scaled.weights["layers.1.mlp_out_norm.weight"], (w + 1.0) * plan.scale)
    (branch,) = plan.branches
    assert layer.mlp_out_norm.eps == original.mlp_out_norm.eps * branch.scale**2
    assert layer.mlp_norm.eps == original.mlp_norm.eps * plan.scale**2
    assert scaled.spec.final_norm.eps == case.canonical.spec.final_norm.eps * plan.scale**2


def test_post_placement_is_refused() -> None:
    case = overflowing("llama")
    layers = tuple(replace(ls, placement="post") for ls in case.canonical.spec.layers)
    with pytest.raises(ValueError, match="pre- and both-norm"):
        plan_stream_scaling(layers, _measured(case))


def test_an_overflowing_checkpoint_converts_with_every_fp16_value_finite(tmp_path: Path) -> None:
    """The whole pipeline on the inflated Llama: every gate passes, the MIL evaluator's fp16
    profile finds no inf or NaN in any value of the program, and the artifact records the
    scales, the ranges and the subnormal count."""
    case = overflowing("llama")
    case.model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    recipe = write_tiny_recipe(tmp_path / "r.yaml", tmp_path / "ckpt")
    result = convert(load_recipe(recipe), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    art = tmp_path / "out" / "tiny"
    doc = json.loads((art / "parity.json").read_text())
    finite = [g for g in doc["gates"] if g["name"] == "finite_values"]
    assert finite and finite[0]["passed"] and finite[0]["value"] == 0
    assert doc["stream"]["scale"] < 1 and doc["stream"]["peak"] > 65504
    manifest = json.loads((art / "manifest.json").read_text())
    whats = [d["what"] for d in manifest["deviations"]]
    assert any("residual stream is carried as" in w for w in whats)
    assert any("branch scaled by" in w for w in whats)
    assert "Residual stream range" in (art / "parity.html").read_text()
    assert "stream scale s =" in (art / "parity.txt").read_text()


def test_the_mil_gate_finds_an_overflow_inside_the_program(tmp_path: Path) -> None:
    """Teeth for `finite_values`: the inflated Llama converted without its scales overflows
    inside the program; the gate fails and names the values."""
    case = overflowing("llama")
    module = build_module(case.canonical)
    text_generation.set_prescales(module, case.batches)
    inputs, outputs = tensor_contract(module, "float16")
    package = tmp_path / "unscaled.mlpackage"
    to_mlprogram(
        trace(module, inputs), inputs, outputs, TARGETS["macOS14"].ct_target(), "float16"
    ).save(str(package))
    references = {
        f.name: run_reference(case.model, f.token_ids) for b in case.batches for f in b.fixtures
    }
    report = check_conversion(
        package, module, case.batches, references, module.host_embedding_table(),
        DEFAULT_THRESHOLDS, "float16", profiles=("fp16",),
    )  # fmt: skip
    (finite,) = [g for g in report.gates if g.name == "finite_values"]
    assert not finite.passed and finite.value > 0 and finite.where


# The window that pushes SmolLM2's residual stream highest: bench/stream_peak.py runs every
# vocabulary entry as the first token (position 0 attends only to itself, and holds the peak on
# every shipped fixture) and "delta" gives the largest |h|, 30,762; repeated, it fills the window.
PEAK_WINDOW = "delta" + " delta" * 63


@pytest.mark.slow
def test_smollm2_peak_window_stays_within_the_limit(smollm2_checkpoint: Any) -> None:
    """The measured margin, not an assumed one: on its worst window SmolLM2's fp32 stream stays
    below the scaling limit (so the converter correctly leaves it unscaled), above every shipped
    fixture's peak (so this window is the one that pushes it)."""
    model, tok = smollm2_checkpoint.model, smollm2_checkpoint.tokenizer

    def peak(text: str) -> float:
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            states = model.model(ids, output_hidden_states=True).hidden_states[:-1]
        return max(float(h.abs().max()) for h in states)

    worst = peak(PEAK_WINDOW)
    recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
    assert max(peak(p) for p in recipe.fixtures.prompts) < worst
    assert 30_000 < worst < LIMIT and power_of_two_below(worst) == 1.0
