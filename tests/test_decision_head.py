"""The decision head's layout: config reading, weight table, reference, BC1L stack (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decision_models import MARKER, head_config, save_checkpoint, tiny_decision, with_markers

from converter.errors import InputError
from converter.tasks.decision_load import load_head
from graph_passes.archs import adapt_encoder, architectures
from graph_passes.archs.decision_head import HeadSource, adapt_head, read_head_spec
from graph_passes.decision import DecisionEncoder, DecisionTail, tail_outputs
from graph_passes.decision_spec import CandidateError, candidate_positions
from graph_passes.encoder import EncoderIO
from graph_passes.masks import key_mask_from_padding
from parity.decision_reference import run_decision_reference


def test_head_registers_like_an_architecture() -> None:
    head = [a for a in architectures() if a.name == "decision-head"]
    assert head and head[0].model_types == ("anec-decision-head",)
    assert head[0].tasks == ("decision",)


@pytest.mark.parametrize("attention", ["global", "local", ["local", "global"]])
def test_bc1l_stack_and_tail_compute_the_reference_in_fp32(attention: object) -> None:
    # The tiny encoder's window is 4 and the request 25 tokens: a local head layer's band
    # hides most keys, so a head layer on the wrong mask or theta fails the 1e-5 below.
    t = tiny_decision(attention=attention)
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    io = EncoderIO(1, 24, "token-ids", "last-hidden-state")
    module, tail = DecisionEncoder(canonical, t.head, io).eval(), DecisionTail(t.head, io).eval()
    seq = with_markers([[1, *range(10, 30)]])[0]
    ref = run_decision_reference(t.encoder, t.reference, tuple(seq), "r0")
    ids = torch.zeros(1, 24, dtype=torch.long)
    ids[0, : len(seq)] = torch.tensor(seq)
    mask = (ids != 0).long()
    with torch.no_grad():
        states = module.run_layers(module.embed(ids, None), key_mask_from_padding(mask))
        positions = torch.tensor([candidate_positions(seq, t.head.spec, "r0")])
        out = tail_outputs(tail(module.finish(states[-1]), positions))
    assert len(states) == len(ref.hidden) == 6  # 4 encoder + 2 head layers
    for state, want in zip(states, ref.hidden, strict=True):
        got = state[0, :, 0, : len(seq)].T
        assert float((got - want).norm() / want.norm()) < 1e-5
    for name, value in out.items():
        assert torch.allclose(value[0], getattr(ref.outputs, name), atol=1e-5), name
    assert module.layer_name(4) == "head layer 0 (layer 4)"


def test_a_request_with_another_number_of_markers_is_an_error_naming_it() -> None:
    t = tiny_decision()
    seq = with_markers([[1, *range(10, 30)]], k=3)[0]
    with pytest.raises(CandidateError, match=r"request greeting-7: holds 3 marker.*= 4"):
        candidate_positions(seq, t.head.spec, "greeting-7")
    with pytest.raises(CandidateError, match="request r1"):
        run_decision_reference(t.encoder, t.reference, tuple(seq + [MARKER, MARKER]), "r1")


def test_unmapped_and_missing_tensors_are_errors_naming_them() -> None:
    t = tiny_decision()
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    source = HeadSource(t.data, canonical.spec)
    extra = {**t.tensors, "scorer.9.weight": torch.zeros(1)}
    with pytest.raises(InputError, match=r"not mapped .*scorer\.9\.weight"):
        adapt_head(source, extra, 4)
    missing = {k: v for k, v in t.tensors.items() if k != "layers.1.mlp.Wi.weight"}
    with pytest.raises(InputError, match=r"'layers\.1\.mlp\.Wi\.weight' is missing"):
        adapt_head(source, missing, 4)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"attention": "sliding"}, "attention"),
        ({"attention": ["local"]}, "attention"),  # one kind per head layer: two are needed
        ({"temperature": 0}, "temperature"),
        ({"scorer": {"widths": [63, 1], "activation": "gelu"}}, "scorer.widths"),
        (
            {"action": {"inputs": ["calibrated_probs"], "widths": [4, 3], "activation": "gelu"}},
            "action.inputs",
        ),  # fmt: skip
        ({"scorer": {"widths": [64, 1], "activation": "swish"}}, "scorer.activation"),
        ({"window": 8}, "window"),
    ],
)
def test_bad_head_config_names_the_key(override: dict[str, object], key: str) -> None:
    t = tiny_decision()
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    data = head_config(64, **override)
    with pytest.raises(InputError, match=rf"head\.json: {key}:"):
        read_head_spec(HeadSource(data, canonical.spec, "head.json"))


def test_load_head_from_the_documented_layout(tmp_path: Path) -> None:
    t = tiny_decision()
    path = save_checkpoint(tmp_path / "ckpt", t.encoder, t.data, t.tensors)
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    head, tensors, digest = load_head(path, canonical.spec)
    assert head.spec.num_candidates == 4 and set(tensors) == set(t.tensors) and len(digest) == 128
    (path / "decision_head" / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"decision_head/model\.safetensors: missing"):
        load_head(path, canonical.spec)


def test_a_cls_head_with_extra_action_features_matches_its_reference() -> None:
    # The scorer reads the CLS row and gives K logits; the action head reads the raw
    # probabilities, the logits and the CLS row (4 + 4 + 64 inputs).
    t = tiny_decision(
        candidates={"kind": "cls"},
        scorer={"widths": [64, 16, 4], "activation": "tanh"},
        action={
            "inputs": ["raw_probs", "scorer_logits", "cls_row"],
            "widths": [72, 8, 3],
            "activation": "relu",
        },  # fmt: skip
    )
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    io = EncoderIO(1, 24, "token-ids", "last-hidden-state")
    module, tail = DecisionEncoder(canonical, t.head, io).eval(), DecisionTail(t.head, io).eval()
    seq = [1, *range(10, 27)]
    ref = run_decision_reference(t.encoder, t.reference, tuple(seq), "r0")
    ids = torch.zeros(1, 24, dtype=torch.long)
    ids[0, : len(seq)] = torch.tensor(seq)
    with torch.no_grad():
        states = module.run_layers(module.embed(ids, None), key_mask_from_padding(ids != 0))
        out = tail_outputs(tail(module.finish(states[-1]), None))
    assert out["marker_rows"].shape == (1, 1, 64) and out["scorer_logits"].shape == (1, 4)
    for name, value in out.items():
        assert torch.allclose(value[0], getattr(ref.outputs, name), atol=1e-5), name
