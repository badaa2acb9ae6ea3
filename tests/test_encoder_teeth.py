"""The encoder gates have teeth: each deliberately wrong BC1L variant fails `check_encoder`
at the layer where the error enters (SPEC sections 2 and 4), on perturbed ModernBERT / BERT.

Wrong variants are made here, by monkeypatching or altering the canonical spec; production code
is untouched. References always come from the unpatched transformers model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from encoder_models import THRESHOLDS, TinyEncoder, build_encoder, tiny_config
from test_gates_teeth import _rope_across_all_heads, _TorchWithWrongSoftmax
from tiny_models import one_torch_thread

import graph_passes.attention as attention_module
from graph_passes.encoder import BC1LEncoder
from graph_passes.layer_norm import LayerNorm
from graph_passes.rope import Rope
from graph_passes.spec import EncoderModel
from parity.encoder_gates import check_encoder, encoder_runner
from parity.fixtures import make_batches
from parity.result import OUTPUT, ParityReport

PER_LAYER = "fp32_layer_rel_error"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


_CACHE: dict[str, TinyEncoder] = {}


def modernbert() -> TinyEncoder:
    """Tiny perturbed ModernBERT, window 4, fixtures padded and full (L=16)."""
    if "mb" not in _CACHE:
        _CACHE["mb"] = build_encoder(tiny_config("modernbert"), "last-hidden-state")
    return _CACHE["mb"]


def modernbert_window_64() -> TinyEncoder:
    """Tiny-width ModernBERT with the real local window (local_attention 128 -> |q-k| <= 64)
    at L=96, fixtures longer than 65 tokens so distances 64 and 65 both occur."""
    if "mb64" not in _CACHE:
        config = tiny_config("modernbert", local_attention=128, num_hidden_layers=2)
        _CACHE["mb64"] = build_encoder(
            config, "last-hidden-state", batch=2, length=96, lengths=(96, 70, 81)
        )
    return _CACHE["mb64"]


def bert() -> TinyEncoder:
    if "bert" not in _CACHE:
        _CACHE["bert"] = build_encoder(tiny_config("bert"), "sentence-embedding")
    return _CACHE["bert"]


def check(t: TinyEncoder, module: BC1LEncoder | None = None) -> ParityReport:
    report, _ = check_encoder(module or t.module, t.batches, t.references, THRESHOLDS)
    return report


def assert_fails_at(report: ParityReport, layer: int) -> None:
    assert not report.passed
    (g,) = [g for g in report.gates if g.name == PER_LAYER]
    assert not g.passed
    assert report.first_diverging_layer == layer


def with_window(t: TinyEncoder, window: int) -> BC1LEncoder:
    spec = t.canonical.spec

    def layer(ls: Any) -> Any:
        if ls.attention.window is None:
            return ls
        return dataclasses.replace(ls, attention=dataclasses.replace(ls.attention, window=window))

    altered = dataclasses.replace(spec, layers=tuple(layer(ls) for ls in spec.layers))
    return t.rebuild(EncoderModel(altered, t.canonical.weights))


# ---- controls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["mb", "mb64", "bert"])
def test_correct_modules_pass(which: str) -> None:
    t = {"mb": modernbert, "mb64": modernbert_window_64, "bert": bert}[which]()
    report = check(t)
    assert report.passed, [g for g in report.gates if not g.passed]
    assert report.first_diverging_layer is None


def test_witnesses_are_perturbed() -> None:
    t = modernbert()
    assert t.model.layers[1].attn_norm.bias.abs().min() > 0
    assert (t.model.layers[1].mlp_norm.weight - 1).abs().max() > 0.1
    b = bert()
    assert b.model.encoder.layer[0].output.LayerNorm.bias.abs().min() > 0


# ---- RoPE and softmax ------------------------------------------------------------------------


def test_rope_halves_split_across_heads_fails_at_layer_0(monkeypatch: pytest.MonkeyPatch) -> None:
    t = modernbert()
    monkeypatch.setattr(Rope, "forward", _rope_across_all_heads)
    assert_fails_at(check(t), 0)


def test_softmax_over_the_query_axis_fails_at_layer_0(monkeypatch: pytest.MonkeyPatch) -> None:
    t = modernbert()
    monkeypatch.setattr(attention_module, "torch", _TorchWithWrongSoftmax())
    assert_fails_at(check(t), 0)


def test_swapped_layer_thetas_fail_at_the_first_local_layer() -> None:
    t = modernbert()
    spec = t.canonical.spec
    layers = tuple(
        dataclasses.replace(ls, attention=dataclasses.replace(ls.attention, rope_theta=160000.0))
        for ls in spec.layers
    )
    module = t.rebuild(EncoderModel(dataclasses.replace(spec, layers=layers), t.canonical.weights))
    assert_fails_at(check(t, module), 1)  # layer 0 is global (theta already 160000)


# ---- the local band ---------------------------------------------------------------------------


def test_real_window_is_64_inclusive() -> None:
    t = modernbert_window_64()
    assert [ls.attention.window for ls in t.canonical.spec.layers] == [None, 64]


@pytest.mark.parametrize("window", [63, 65], ids=["exclusive-at-64", "inclusive-at-65"])
def test_band_off_by_one_fails_at_the_local_layer(window: int) -> None:
    t = modernbert_window_64()
    assert_fails_at(check(t, with_window(t, window)), 1)


# ---- padding ----------------------------------------------------------------------------------


def _masks_ignoring_padding(local_only: bool) -> Any:
    original = BC1LEncoder.masks

    def masks(self: BC1LEncoder, key_mask: torch.Tensor) -> dict[int | None, torch.Tensor]:
        good = original(self, key_mask)
        bad = original(self, torch.zeros_like(key_mask))
        return {w: bad[w] if (w is not None or not local_only) else good[w] for w in good}

    return masks


@pytest.mark.parametrize("local_only", [False, True], ids=["all-layers", "local-layers-only"])
def test_key_mask_ignoring_padding_fails(monkeypatch: pytest.MonkeyPatch, local_only: bool) -> None:
    t = modernbert()
    monkeypatch.setattr(BC1LEncoder, "masks", _masks_ignoring_padding(local_only))
    # Guard: on full-window fixtures alone the mutant is invisible (the trap in the issue) ...
    unpadded = [f for f in t.fixtures if len(f.token_ids) == 16]
    assert unpadded and len(unpadded) < len(t.fixtures)
    full = make_batches(unpadded, 3, 16, 0, right=True)
    assert all(bool(b.attention_mask.all()) for b in full)
    report, _ = check_encoder(t.module, full, t.references, THRESHOLDS)
    assert report.passed
    # ... and the padded fixtures catch it where it enters (layer 1 is the first local layer).
    assert_fails_at(check(t), 1 if local_only else 0)


def test_bert_key_mask_ignoring_padding_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    t = bert()
    monkeypatch.setattr(BC1LEncoder, "masks", _masks_ignoring_padding(False))
    assert_fails_at(check(t), 0)


# ---- LayerNorm affine order -------------------------------------------------------------------


def apple_order_forward(self: LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """WRONG: Apple's reference LayerNorm order, ``(normalised + beta) * gamma``."""
    if self.prescale != 1.0:
        x = x * self.inv_scale
    centred = x - x.mean(dim=1, keepdim=True)
    normed = centred * torch.rsqrt((centred * centred).sum(dim=1, keepdim=True) + self.scaled_eps)
    normed = normed * self.channels**0.5
    if self.beta is not None:
        normed = normed + self.beta
    return normed * (self.gamma / self.channels**0.5)


def test_apple_layer_norm_order_equals_ours_without_bias() -> None:
    # Guards the mutant: with beta = 0 it is the same function, so what fails below is the order.
    torch.manual_seed(0)
    w = 1 + 0.2 * torch.randn(16)
    x = torch.randn(2, 16, 1, 3)
    norm = LayerNorm(w, torch.zeros(16), 1e-5)
    torch.testing.assert_close(apple_order_forward(norm, x), norm(x))


def test_apple_layer_norm_order_fails_on_bert(monkeypatch: pytest.MonkeyPatch) -> None:
    t = bert()
    monkeypatch.setattr(LayerNorm, "forward", apple_order_forward)
    assert_fails_at(check(t), 0)


# ---- one score: a cross-encoder reranker's head ------------------------------------------------


def cross_encoder() -> TinyEncoder:
    """Tiny perturbed BERT with one label: a cross-encoder's relevance score."""
    if "ce" not in _CACHE:
        _CACHE["ce"] = build_encoder(tiny_config("bert", num_labels=1), "logits")
    return _CACHE["ce"]


@pytest.mark.parametrize(("scale", "fails"), [
    (-1.0, {"fp16_argmax_agreement", "fp16_max_abs_dprob"}),  # every decision flipped
    (3.0, {"fp16_max_abs_dprob"}),  # the same signs, other probabilities
])  # fmt: skip
def test_a_wrong_score_fails_the_fp16_gates(scale: float, fails: set[str]) -> None:
    """An argmax or softmax over one label can never change, so a one-score head is judged by
    its sign and its sigmoid: a program returning a scaled score must fail."""
    t = cross_encoder()
    correct = check(t)
    assert correct.passed, [g for g in correct.gates if not g.passed]
    base = encoder_runner(t.module, torch.float32)

    def scaled(batch: Any) -> Any:
        return None, {OUTPUT: scale * base(batch)[1][OUTPUT]}

    report, _ = check_encoder(t.module, t.batches, t.references, THRESHOLDS,
                              {"mil-fp16": scaled}, torch_levels=False)  # fmt: skip
    assert {g.name for g in report.gates if not g.passed} == fails
    sign = next(g for g in report.gates if g.name == "fp16_argmax_agreement")
    assert "sign" in sign.detail
