"""Decision gates and their teeth (fast): the tiny model passes every gate and slice; each of
the issue's mutants fails its gate, naming the first diverging output or layer."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from decision_models import VOCAB, DecisionCase, K, decision_case, save_checkpoint, tiny_decision
from decision_models import with_markers as markers_in
from encoder_models import random_sequences

from converter.errors import InputError
from converter.pipeline.run import convert
from converter.recipe import validate_recipe
from graph_passes.attention import Attention
from graph_passes.decision import DecisionTail
from parity.decision_gates import ADVERSARIAL, NARROW
from parity.gate_registry import GateResult


@pytest.fixture(scope="module")
def case() -> DecisionCase:
    return decision_case(tiny_decision())


def failed(gates: list[GateResult]) -> dict[str, GateResult]:
    return {f"{g.implementation}/{g.name}": g for g in gates if not g.passed}


def test_tiny_model_passes_every_gate_on_every_slice(case: DecisionCase) -> None:
    report, rows = case.check()
    assert report.passed, failed(report.gates)
    slices = {s for row in rows for s in row.slices}
    assert {"padded", "full-window", NARROW, ADVERSARIAL} <= slices
    assert len(report.layers) == 6  # 4 encoder + 2 head layers, each gated in fp32
    # Peaked scorer: the |dp| gates and the mutants below have something to see.
    assert max(float(r.outputs.raw_probs.max()) for r in case.references.values()) > 0.9


class CalibratedActionTail(DecisionTail):
    """Mutant: the action head reads the calibrated probabilities instead of the raw ones."""

    def action_features(self, raw, calibrated, logits, cls):  # type: ignore[no-untyped-def]
        return super().action_features(calibrated, calibrated, logits, cls)


def with_temperature(case: DecisionCase, temperature: float) -> DecisionCase:
    model = copy.copy(case.model)
    spec = dataclasses.replace(model.head.spec, temperature=temperature)
    model.head = copy.copy(model.head)
    model.head.spec = spec
    model.reference = copy.deepcopy(model.reference)
    model.reference.spec = spec
    return decision_case(model)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_action_head_fed_calibrated_probabilities_fails_at_action_probs(
    case: DecisionCase, temperature: float
) -> None:
    c = with_temperature(case, temperature)
    assert c.check()[0].passed
    mutant = CalibratedActionTail(c.model.head, c.tail.io).eval()
    report, rows = c.check(tail=mutant)
    bad = failed(report.gates)
    assert "torch-fp32/fp32_logits_rel_error" in bad
    assert bad["torch-fp32/fp32_logits_rel_error"].where.startswith("action_probs")
    assert "first diverging output: action_probs" in bad["torch-fp32/fp32_logits_rel_error"].detail
    assert "torch-fp32/fp32_marker_rows_rel_error" not in bad
    assert {r.first_diverging_output["torch-fp32"] for r in rows} == {"action_probs"}


def test_at_temperature_one_the_calibration_mutant_cannot_show(case: DecisionCase) -> None:
    c = with_temperature(case, 1.0)
    report, _ = c.check(tail=CalibratedActionTail(c.model.head, c.tail.io).eval())
    assert report.passed


class WrongTemperatureTail(DecisionTail):
    """Mutant: the tail calibrates with 1.1 T instead of the head's T."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.inv_temperature /= 1.1


def test_calibration_with_another_temperature_breaks_the_certificate(case: DecisionCase) -> None:
    report, rows = case.check(tail=WrongTemperatureTail(case.model.head, case.tail.io).eval())
    bad = failed(report.gates)
    assert bad["torch-fp16/temperature_certificate"].value > 1
    assert {r.first_diverging_output["torch-fp32"] for r in rows} == {"calibrated_probs"}
    # The unaltered tail's certificate holds, with room to spare.
    good = {f"{g.implementation}/{g.name}": g for g in case.check()[0].gates}
    assert good["torch-fp16/temperature_certificate"].value < 0.9


class OffsetTail(DecisionTail):
    """Mutant: every marker position read one slot later."""

    def select(self, rows, positions):  # type: ignore[no-untyped-def]
        return super().select(rows, None if positions is None else positions + 1)


def test_marker_offset_by_one_fails_at_marker_rows(case: DecisionCase) -> None:
    report, rows = case.check(tail=OffsetTail(case.model.head, case.tail.io).eval())
    bad = failed(report.gates)
    assert bad["torch-fp32/fp32_marker_rows_rel_error"].where.startswith("marker_rows")
    assert "torch-fp32/fp32_layer_rel_error" not in bad
    assert {r.first_diverging_output["torch-fp32"] for r in rows} == {"marker_rows"}
    assert "torch-fp16/candidate_argmax_agreement" in bad  # peaked: the choice moves too


class QueryAxisAttention(Attention):
    """Mutant: the softmax over the query axis (axis 3) instead of the key axis (axis 1)."""

    def weights(self, score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(score + mask, dim=3)


def test_head_softmax_on_the_query_axis_fails_at_head_layer_0(case: DecisionCase) -> None:
    module = copy.deepcopy(case.module)
    for block in module.head_blocks():
        block.attention.__class__ = QueryAxisAttention
    report, _ = case.check(module=module)
    gate = failed(report.gates)["torch-fp32/fp32_layer_rel_error"]
    assert report.first_diverging_layer == 4
    assert "first diverging layer: head layer 0 (layer 4)" in gate.detail
    assert all(row.fp32_rel_error < 1e-5 for row in report.layers[:4])  # the encoder is intact


def test_a_fixture_with_another_number_of_markers_is_refused_naming_it(tmp_path: Path) -> None:
    t = tiny_decision()
    path = save_checkpoint(tmp_path / "ckpt", t.encoder, t.data, t.tensors)
    seqs = markers_in(random_sequences(11, (20, 12), VOCAB, first=1))
    seqs[1] = markers_in([seqs[1]], k=K - 1)[0]
    recipe = validate_recipe({
        "name": "d", "task": "decision", "source": {"kind": "hf-dir", "path": str(path)},
        "shapes": {"batch": 1, "sequence_length": 24},
        "fixtures": {"token_ids": seqs, "padded_variants": False},
    })  # fmt: skip
    with pytest.raises(InputError, match=r"fixtures: request token_ids\[1\]: holds 3 marker"):
        convert(recipe, tmp_path / "out")
    assert not (tmp_path / "out" / "d").exists()


@pytest.mark.parametrize("batch", [1, 3])
def test_tiny_decision_recipe_converts_partitioned_with_one_ne_segment(
    tmp_path: Path, batch: int
) -> None:
    t = tiny_decision()
    path = save_checkpoint(tmp_path / "ckpt", t.encoder, t.data, t.tensors)
    seqs = markers_in(random_sequences(11, (24, 9, 15, 20), VOCAB, first=1))
    recipe = validate_recipe({
        "name": "tiny-decision", "task": "decision",
        "source": {"kind": "hf-dir", "path": str(path)},
        "shapes": {"batch": batch, "sequence_length": 24},
        "fixtures": {"token_ids": seqs, "padded_variants": False},
        "gates": {"plan_max_ne_segments": 1, "plan_min_ne_flop_share": 1.0},
    })  # fmt: skip
    result = convert(recipe, tmp_path / "out")
    assert result.exit_code == 0, result.notes
    out = tmp_path / "out" / "tiny-decision"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["pieces"]] == ["embedding", "island", "tail"]
    assert manifest["pieces"][2]["runs_on"].startswith("cpu")
    crossings = {(b["source"], b["target"]): b for b in manifest["boundaries"]}
    hidden = crossings[("island", "tail")]["tensors"][0]
    assert hidden["shape"] == [1, 64, 1, batch * 24] and hidden["dtype"] == "float16"
    assert crossings[("embedding (host)", "island")]["bytes"] == batch * 24 * (64 + 1) * 2
    assert manifest["encoder"]["decision"]["action"]["reads"] == ["raw_probs"]
    parity = json.loads((out / "parity.json").read_text())
    names = {(g["level"], g["name"], g["implementation"]) for g in parity["gates"]}
    for impl in ("torch-fp16", "partitioned-fp16", "mil-fp16"):
        level = "mil-fp16" if impl == "mil-fp16" else "torch-fp16"
        assert (level, "temperature_certificate", impl) in names
    assert ("mil-fp32", "mil_fp32_layer_rel_error", "mil-fp32") in names
    plan = json.loads((out / "plan.json").read_text())
    assert all(g["passed"] for g in plan["gates"]) and plan["gates"]
    if batch == 1:  # anec parity re-runs every gate; a changed head is refused
        from converter.evidence.recheck import recheck

        again = recheck(out)
        assert again.report.passed and again.document["gates"]
        same = [g for g in again.document["gates"] if g["name"] == "same_gate_set"]
        assert same and same[0]["passed"], same
        cfg = path / "decision_head" / "config.json"
        cfg.write_text(cfg.read_text().replace('"temperature": 1.5', '"temperature": 1.25'))
        with pytest.raises(InputError, match="encoder and decision head"):
            recheck(out)


def test_a_decision_program_the_evaluator_cannot_run_is_named_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a kernel for an op of the island, the MIL level fails (exit 1, nothing
    published), and the report's levels say why, as an encoder's do."""
    from parity.mil.registry import KERNELS

    monkeypatch.delitem(KERNELS, "softmax")
    t = tiny_decision()
    path = save_checkpoint(tmp_path / "ckpt", t.encoder, t.data, t.tensors)
    recipe = validate_recipe({
        "name": "d", "task": "decision", "source": {"kind": "hf-dir", "path": str(path)},
        "shapes": {"batch": 1, "sequence_length": 24},
        "fixtures": {"token_ids": markers_in(random_sequences(11, (24, 9), VOCAB, first=1)),
                     "padded_variants": False},
    })  # fmt: skip
    result = convert(recipe, tmp_path / "out")
    assert result.exit_code == 1 and result.failed_gate == "MIL-level"
    assert not (tmp_path / "out" / "d").exists()
    parity = json.loads((tmp_path / "out" / "d.failed" / "parity.json").read_text())
    described = parity["implementations"]["mil-fp16"]
    assert described.startswith("failed: ") and "softmax" in described, described


def test_mil_marker_rows_gate_catches_an_emitted_tail_reading_the_wrong_slot(
    case: DecisionCase, tmp_path: Path
) -> None:
    from converter.coreml.program import save_package, to_mlprogram, trace
    from converter.coreml.targets import TARGETS
    from converter.tasks.decision_contract import island_contract, tail_contract
    from converter.tasks.encoder import program_module
    from graph_passes.decision import DecisionIsland
    from graph_passes.partition import host_embedding
    from parity.encoder_mil import tail_marker_rows_error

    program = program_module(case.module, "float16")
    host = host_embedding(_encoder(case), 24, True)

    def emit(module: torch.nn.Module, contract, name: str) -> Path:  # type: ignore[no-untyped-def]
        inputs, outputs = contract
        target = TARGETS["macOS14"].ct_target()
        ml = to_mlprogram(trace(module, inputs), inputs, outputs, target, "float16")
        return save_package(ml, tmp_path / name)

    island = emit(
        DecisionIsland(program).eval(), island_contract(program, "float16"), "i.mlpackage"
    )
    errors = {}
    for label, cls in (("right", DecisionTail), ("offset", OffsetTail)):
        tail = cls(case.model.head, case.tail.io).eval()
        package = emit(tail, tail_contract(program, tail, "float16"), f"{label}.mlpackage")
        errors[label] = tail_marker_rows_error(
            package, island, host, tail.spec, case.batches, "float16"
        )
    assert errors["right"][0] < 1e-6
    assert errors["offset"][0] > 0.1 and errors["offset"][1].startswith("marker_rows")


def _encoder(case: DecisionCase):  # type: ignore[no-untyped-def]
    from graph_passes.archs import adapt_encoder

    return adapt_encoder(case.model.encoder.config, case.model.encoder.state_dict())


@pytest.mark.usefixtures("stand_in_evidence")
def test_device_check_gates_the_island_and_tail_on_core_ml(tmp_path: Path) -> None:
    """anec device-check of a decision model against a stand-in of Core ML: the host
    embedding, the island, then the tail, gated as the MIL level gates them."""
    from coreml_standin import StandInLoader, stand_in_adapters

    from converter.device.dispatch import device_check

    t = tiny_decision()
    path = save_checkpoint(tmp_path / "ckpt", t.encoder, t.data, t.tensors)
    recipe = validate_recipe({
        "name": "tiny-decision", "task": "decision",
        "source": {"kind": "hf-dir", "path": str(path)},
        "shapes": {"batch": 1, "sequence_length": 24},
        "fixtures": {"token_ids": markers_in(random_sequences(11, (24, 9), VOCAB, first=1)),
                     "padded_variants": False},
    })  # fmt: skip
    assert convert(recipe, tmp_path / "out").exit_code == 0
    evidence = device_check(tmp_path / "out" / "tiny-decision", ["CPU_AND_NE"],
                            stand_in_adapters(StandInLoader()), memory=False)  # fmt: skip
    assert evidence.passed
    (unit,) = evidence.units
    assert sorted(unit.functions) == ["island", "tail"]
    names = {g.name for g in unit.gates}
    assert "temperature_certificate" in names and names == {g.name for g in evidence.program}
    assert {g.implementation for g in unit.gates} == {"coreml-cpu-and-ne"}
