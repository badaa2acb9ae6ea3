"""The decision model's parity reference: the original function, computed from the documented
checkpoint layout (``docs/decision-head.md``) with transformers' own classes.

The encoder is transformers' ``ModernBertModel`` (eager attention); each head layer is a
transformers ``ModernBertEncoderLayer`` built from the encoder's config with global or local
attention as the head config says, run with the encoder's rotary embedding and transformers'
own (sliding-window) bidirectional mask of that attention type; the head norm, scorer and
action head are plain ``nn.LayerNorm`` / ``nn.Linear`` modules. The head file's tensors load
into this module by name (``load_state_dict(strict=True)``): what the file holds is what runs.
Each request runs alone, unpadded, at positions 0..n-1.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graph_passes.decision_spec import DecisionHeadSpec, MlpHeadSpec, candidate_positions
from parity.encoder_gates import encoder_layers
from parity.reference import layer_states

_ACT = {"gelu": nn.GELU(), "tanh": nn.Tanh(), "relu": nn.ReLU()}


@dataclass(frozen=True)
class DecisionOutputs:
    """Every output of one request (fp32), in the order the model computes them.

    ``marker_rows`` (K, D) (CLS head: (1, D)), ``scorer_logits`` / ``raw_probs`` /
    ``calibrated_probs`` (K,), ``action_probs`` (A,).
    """

    marker_rows: torch.Tensor
    scorer_logits: torch.Tensor
    raw_probs: torch.Tensor
    calibrated_probs: torch.Tensor
    action_probs: torch.Tensor


@dataclass(frozen=True)
class DecisionReferenceResult:
    """Per-layer states (n, D) of the encoder layers then the head layers, and the outputs."""

    hidden: list[torch.Tensor]
    outputs: DecisionOutputs


def run_mlp(layers: nn.ModuleList, activation: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Linear, activation, ..., Linear (no activation after the last)."""
    for k, layer in enumerate(layers):
        x = layer(x)
        if k < len(layers) - 1:
            x = activation(x)
    return x


def _linears(mlp: MlpHeadSpec) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(a, b) for a, b in zip(mlp.widths, mlp.widths[1:], strict=False))


class DecisionHeadReference(nn.Module):
    """The head as the checkpoint defines it; its state dict names are the head file's."""

    def __init__(self, encoder_config: object, spec: DecisionHeadSpec) -> None:
        super().__init__()
        from transformers.models.modernbert.modeling_modernbert import ModernBertEncoderLayer

        self.spec = spec
        config: Any = copy.deepcopy(encoder_config)
        # Layer index j + 1: a head layer keeps its attention norm (index 0 is transformers'
        # identity-norm layer right after the embeddings).
        config.layer_types = ["full_attention"] + [
            "full_attention" if layer.attention.window is None else "sliding_attention"
            for layer in spec.layers
        ]
        config._attn_implementation = "eager"
        self.config = config
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(config, j + 1) for j in range(spec.num_layers)
        )
        norm = spec.norm
        self.norm = (
            nn.LayerNorm(config.hidden_size, eps=norm.eps, bias=norm.bias)
            if norm is not None
            else None
        )
        self.scorer = _linears(spec.scorer)
        self.action = _linears(spec.action)

    def load_head(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load the head file's tensors by name (every name must match, both ways)."""
        self.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)

    def decide(self, h: torch.Tensor, token_ids: tuple[int, ...], request: str) -> DecisionOutputs:
        """From the head norm's output (n, D) of one request to every decision output."""
        spec = self.spec
        positions = candidate_positions(token_ids, spec, request)
        rows = h[positions]
        logits = run_mlp(self.scorer, _ACT[spec.scorer.activation], rows).reshape(-1)
        raw = logits.softmax(-1)
        calibrated = (logits / spec.temperature).softmax(-1)
        features = {"raw_probs": raw, "scorer_logits": logits, "cls_row": h[0]}
        x = torch.cat([features[name] for name in spec.action_inputs])
        action = run_mlp(self.action, _ACT[spec.action.activation], x).softmax(-1)
        return DecisionOutputs(rows, logits, raw, calibrated, action)


def run_decision_reference(
    encoder: nn.Module, head: DecisionHeadReference, token_ids: tuple[int, ...], request: str
) -> DecisionReferenceResult:
    """The original function on one unpadded request: encoder (per-layer states hooked), head
    layers with the encoder's RoPE and mask of their attention type, head norm, selection,
    scorer, calibration, action."""
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    ids = torch.tensor([token_ids], dtype=torch.int64)
    with layer_states(encoder_layers(encoder)) as hidden, torch.no_grad():
        h = encoder(input_ids=ids).last_hidden_state
        positions = torch.arange(len(token_ids)).unsqueeze(0)
        masks = {
            "full_attention": None,  # one unpadded request: every key is real
            "sliding_attention": create_bidirectional_sliding_window_mask(
                config=head.config, inputs_embeds=h, attention_mask=None
            ),
        }
        for layer in head.layers:
            kind = str(layer.attention_type)
            rope = encoder.rotary_emb(h, positions, kind)  # type: ignore[operator]
            h = layer(h, attention_mask=masks[kind], position_embeddings=rope)
            hidden.append(h[0].clone())
        if head.norm is not None:
            h = head.norm(h)
        outputs = head.decide(h[0], token_ids, request)
    return DecisionReferenceResult(hidden, outputs)
