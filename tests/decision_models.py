"""Tiny (and real-shape) perturbed decision models for tests: a transformers ModernBERT
encoder plus a decision head saved in the documented layout (docs/decision-head.md).

The head's scorer is made peaked (its last layer scaled up) so that probabilities are far from
uniform and |dp| gates, the marker-offset mutant and the temperature mutant have teeth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from encoder_models import VOCAB, hf_model, random_sequences, tiny_config
from safetensors.torch import save_file
from tiny_models import perturb_
from torch import nn

from graph_passes.archs.decision_head import HeadSource, adapt_head
from graph_passes.decision import DecisionEncoder, DecisionTail
from graph_passes.decision_spec import DecisionHead
from graph_passes.encoder import EncoderIO
from parity.decision_gates import (
    DecisionRow,
    check_decision,
    make_decision_batches,
)
from parity.decision_reference import (
    DecisionHeadReference,
    DecisionReferenceResult,
    run_decision_reference,
)
from parity.fixtures import Batch, build_fixtures
from parity.result import ParityReport
from parity.thresholds import Thresholds

MARKER = 7
K = 4


def head_config(d: int, **overrides: Any) -> dict[str, Any]:
    """The documented example head: two layers, four markers (token MARKER), a D -> 32 -> 1
    GELU scorer, an action head on the raw probabilities (K -> 16 -> 3), T = 1.5."""
    data: dict[str, Any] = {
        "model_type": "anec-decision-head",
        "num_layers": 2,
        "attention": "global",
        "final_norm": True,
        "candidates": {"kind": "markers", "marker_token_ids": [MARKER]},
        "num_candidates": K,
        "scorer": {"widths": [d, 32, 1], "activation": "gelu"},
        "action": {"inputs": ["raw_probs"], "widths": [K, 16, 3], "activation": "gelu"},
        "actions": ["wait", "act", "abstain"],
        "temperature": 1.5,
    }
    data.update(overrides)
    return data


def make_head(
    encoder: nn.Module,
    data: dict[str, Any],
    seed: int = 5,
    peak: float = 30.0,
    scale: float = 0.1,
    action_peak: float | None = None,
) -> tuple[DecisionHeadReference, dict[str, torch.Tensor]]:
    """A perturbed reference head for ``encoder`` (every parameter moved by ``scale`` randn,
    norm weights by 0.2 randn around 1; the scorer's and action head's last layers scaled by
    ``peak`` / ``action_peak``) and its tensors as the head file holds them."""
    from graph_passes.archs import adapt_encoder
    from graph_passes.archs.decision_head import read_head_spec

    canonical = adapt_encoder(encoder.config, encoder.state_dict())
    spec = read_head_spec(HeadSource(data, canonical.spec))
    torch.manual_seed(seed)
    head = DecisionHeadReference(encoder.config, spec).eval()
    with torch.no_grad():
        perturb_(head, scale=scale)
        head.scorer[-1].weight.mul_(peak)  # peaked candidate probabilities
        head.action[-1].weight.mul_(peak if action_peak is None else action_peak)
    return head, {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}


def save_checkpoint(path: Path, encoder: nn.Module, data: dict[str, Any],
                    tensors: dict[str, torch.Tensor]) -> Path:  # fmt: skip
    """The documented layout: the encoder's HF directory plus decision_head/."""
    encoder.save_pretrained(path, safe_serialization=True)
    (path / "decision_head").mkdir(parents=True, exist_ok=True)
    (path / "decision_head" / "config.json").write_text(json.dumps(data, indent=2))
    save_file(tensors, str(path / "decision_head" / "model.safetensors"))
    return path


def with_markers(seqs: list[list[int]], k: int = K, seed: int = 3) -> list[list[int]]:
    """Each sequence with exactly ``k`` MARKER tokens at random positions after the first
    (any MARKER already in it replaced first)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in seqs:
        s = [t if t != MARKER else MARKER + 1 for t in s]
        slots = (torch.randperm(len(s) - 1, generator=gen)[:k] + 1).tolist()
        for i in slots:
            s[i] = MARKER
        out.append(s)
    return out


@dataclass
class TinyDecision:
    """A perturbed tiny encoder, a head and the head's mapped description."""

    encoder: nn.Module
    reference: DecisionHeadReference
    tensors: dict[str, torch.Tensor]
    head: DecisionHead
    data: dict[str, Any]


def tiny_decision(seed: int = 0, peak: float = 30.0, **overrides: Any) -> TinyDecision:
    """Tiny ModernBERT (D=64, 4 layers, window 4) and the example head (head_config)."""
    from graph_passes.archs import adapt_encoder

    encoder = hf_model(tiny_config("modernbert"), classify=False, seed=seed)
    data = head_config(64, **overrides)
    reference, tensors = make_head(encoder, data, peak=peak)
    canonical = adapt_encoder(encoder.config, encoder.state_dict())
    head = adapt_head(HeadSource(data, canonical.spec), tensors, canonical.spec.num_layers)
    return TinyDecision(encoder, reference, tensors, head, data)


THRESHOLDS = Thresholds(
    fp32_layer_rel_error=1e-4,
    fp32_logits_rel_error=1e-4,
    fp32_marker_rows_rel_error=1e-4,
    candidate_argmax_agreement=1.0,
    action_argmax_agreement=1.0,
    max_abs_dprob_calibrated=0.02,
    max_abs_dprob_action=0.02,
)


@dataclass
class DecisionCase:
    """The BC1L stack and tail of a TinyDecision, batches (adversarial copies included),
    slices and references."""

    model: TinyDecision
    module: DecisionEncoder
    tail: DecisionTail
    batches: list[Batch]
    slices: dict[str, list[str]]
    references: dict[str, DecisionReferenceResult]

    def check(self, tail: DecisionTail | None = None, module: DecisionEncoder | None = None
              ) -> tuple[ParityReport, list[DecisionRow]]:  # fmt: skip
        """Torch fp32 gates (and fp16 of the same pieces) on possibly altered pieces."""
        m, t = module or self.module, tail or self.tail
        return check_decision(m, t, self.batches, self.slices, self.references, THRESHOLDS)


def decision_case(model: TinyDecision, batch: int = 3, length: int = 24,
                  lengths: tuple[int, ...] = (24, 9, 15, 20), vocab: int = VOCAB
                  ) -> DecisionCase:  # fmt: skip
    """Fixtures with exactly K markers, right-padded batches, prescaled stack, references."""
    from converter.tasks.encoder import set_scales
    from graph_passes.archs import adapt_encoder

    canonical = adapt_encoder(model.encoder.config, model.encoder.state_dict())
    io = EncoderIO(batch, length, "token-ids", "last-hidden-state")
    module = DecisionEncoder(canonical, model.head, io).eval()
    tail = DecisionTail(model.head, io).eval()
    seqs = with_markers(random_sequences(11, lengths, vocab, first=1))
    fixtures = build_fixtures([], seqs, None, length, vocab, padded_variants=False)
    batches, slices = make_decision_batches(fixtures, batch, length, 0, model.head.spec)
    set_scales(module, batches)
    refs = {f.name: run_decision_reference(model.encoder, model.reference, f.token_ids, f.name)
            for f in fixtures}  # fmt: skip
    return DecisionCase(model, module, tail, batches, slices, refs)


__all__ = ["K", "MARKER", "THRESHOLDS", "VOCAB", "DecisionCase", "TinyDecision",
           "decision_case", "head_config", "make_head", "save_checkpoint", "tiny_decision",
           "with_markers"]  # fmt: skip
