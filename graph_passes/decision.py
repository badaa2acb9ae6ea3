"""The BC1L decision model: the encoder and the head layers as one layer stack (the NE island),
and the CPU tail (selection, scorer, calibration, action head).

    host: embedding rows + embedding norm
    island (`DecisionIsland`): encoder layers 0..N-1 -> encoder final norm -> head layers
        N..N+H-1 -> head norm; folded [1, D, 1, B*L] in and out, nothing else crosses
    tail (`DecisionTail`, CPU): gather the K candidate slots at run-time positions -> scorer
        -> logits z -> raw softmax(z) and calibrated softmax(z / T) -> action head on the raw
        probabilities (+ the listed features)

`DecisionEncoder` is a `BC1LEncoder` whose layer list is encoder + head layers, with the
encoder's final norm between them (head layers read the encoder's ``last_hidden_state``, as
the reference does) and the head norm as its final norm; prescales, epsilon floors, masks,
the host embedding and the per-layer MIL comparison all work on it unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from graph_passes.decision_spec import DecisionHead, MlpHeadSpec
from graph_passes.encoder import BC1LEncoder, EncoderIO, build_layer_norm, fold
from graph_passes.layer_norm import LayerNorm
from graph_passes.model import Block
from graph_passes.spec import EncoderModel

OUTPUT_NAMES = ("marker_rows", "scorer_logits", "raw_probs", "calibrated_probs", "action_probs")


def combined_model(encoder: EncoderModel, head: DecisionHead) -> EncoderModel:
    """One layer stack: the encoder's layers then the head's (canonical ``layers.{N+j}``);
    the encoder's final norm becomes ``encoder_norm``, the head norm the final norm."""
    spec = encoder.spec
    if spec.final_norm is None:
        raise ValueError("a decision head reads the encoder's final norm; this encoder has none")
    weights = {
        (k.replace("final_norm.", "encoder_norm.", 1) if k.startswith("final_norm.") else k): v
        for k, v in encoder.weights.items()
    }
    for name, tensor in head.weights.items():
        if name.startswith("head_norm."):
            weights[name.replace("head_norm.", "final_norm.", 1)] = tensor
        elif name.startswith("layers."):
            weights[name] = tensor
    combined = dataclasses.replace(
        spec,
        layers=spec.layers + head.spec.layers,
        final_norm=head.spec.norm,
        classifier=None,
    )
    return EncoderModel(combined, weights)


class DecisionEncoder(BC1LEncoder):
    """Encoder + head layers; ``num_encoder_layers`` marks where the encoder's norm sits."""

    def __init__(self, encoder: EncoderModel, head: DecisionHead, io: EncoderIO) -> None:
        model = combined_model(encoder, head)
        super().__init__(model, dataclasses.replace(io, output="last-hidden-state"))
        self.num_encoder_layers = encoder.spec.num_layers
        norm = encoder.spec.final_norm
        assert norm is not None
        self.encoder_norm = build_layer_norm(norm, model.weights, "encoder_norm")

    def layer_name(self, index: int) -> str:
        """``layer i`` or ``head layer j (layer i)``: where a per-layer gate points."""
        if index < self.num_encoder_layers:
            return f"layer {index}"
        return f"head layer {index - self.num_encoder_layers} (layer {index})"

    def norms(self) -> list[tuple[str, LayerNorm]]:
        """Every LayerNorm in execution order, the encoder's final norm included."""
        named = super().norms()
        first_head = next(
            (
                i
                for i, (n, _) in enumerate(named)
                if n.startswith(f"layers.{self.num_encoder_layers}.")
            ),
            len(named),
        )
        return [*named[:first_head], ("encoder_norm", self.encoder_norm), *named[first_head:]]

    def run_layers(self, h: torch.Tensor, key_mask: torch.Tensor) -> list[torch.Tensor]:
        """The folded stream after each encoder layer, then after each head layer; the head
        layers read the encoder's final norm of the last encoder layer's output."""
        masks = self.masks(key_mask)
        states = []
        for i, layer in enumerate(self.encoder_layers()):
            if i == self.num_encoder_layers:
                h = self.encoder_norm(h)
            h = layer(h, masks[layer.window])
            states.append(h)
        return states

    def head_blocks(self) -> list[Block]:
        """The head layers."""
        return self.encoder_layers()[self.num_encoder_layers :]


class DecisionIsland(nn.Module):
    """The NE island: normalised embedding rows (B, L, D) and the key mask -> the folded head
    norm output (1, D, 1, B*L)."""

    def __init__(self, model: DecisionEncoder) -> None:
        super().__init__()
        self.encoder = model

    def forward(self, inputs_embeds: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder.finish(self.encoder.run_layers(fold(inputs_embeds), key_mask)[-1])


def _linears(mlp: MlpHeadSpec, weights: dict[str, torch.Tensor], name: str) -> nn.ModuleList:
    layers = nn.ModuleList()
    for k in range(mlp.num_linear):
        layer = nn.Linear(mlp.widths[k], mlp.widths[k + 1])
        with torch.no_grad():
            layer.weight.copy_(weights[f"{name}.{k}.weight"])
            layer.bias.copy_(weights[f"{name}.{k}.bias"])
        layers.append(layer)
    return layers


def _activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return nn.functional.gelu(x)  # the exact (erf) GELU
    return torch.tanh(x) if kind == "tanh" else torch.relu(x)


def run_mlp(layers: nn.ModuleList, activation: str, x: torch.Tensor) -> torch.Tensor:
    """Linear, activation, ..., Linear (no activation after the last)."""
    for k, layer in enumerate(layers):
        x = layer(x)
        if k < len(layers) - 1:
            x = _activate(x, activation)
    return x


class DecisionTail(nn.Module):
    """The CPU tail on the island's folded output.

    Inputs: ``hidden`` (1, D, 1, B*L); ``candidate_positions`` (B, K) int32, the positions of
    each request's K markers (a ``cls`` head takes no positions: it reads slot b*L).
    Outputs, in order: ``marker_rows`` (B, K, D) [(B, 1, D) for cls], ``scorer_logits``,
    ``raw_probs``, ``calibrated_probs`` (B, K) and ``action_probs`` (B, A).
    """

    offsets: torch.Tensor

    def __init__(self, head: DecisionHead, io: EncoderIO) -> None:
        super().__init__()
        spec = head.spec
        self.spec = spec
        self.io = io
        self.scorer = _linears(spec.scorer, head.weights, "scorer")
        self.action = _linears(spec.action, head.weights, "action")
        self.inv_temperature = 1.0 / spec.temperature
        self.hidden_size = spec.scorer.widths[0]  # D: a constant, not a traced shape read
        # Slot of sample b's position p is b*L + p: a constant offset per sample.
        self.register_buffer("offsets", (torch.arange(io.batch) * io.length).reshape(-1, 1))

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B*L, D): one row per slot."""
        return hidden[0, :, 0, :].transpose(0, 1)

    def select(self, rows: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The candidate rows (B, K, D) at run-time positions (a gather), or the CLS rows."""
        if positions is None:
            return rows[:: self.io.length].unsqueeze(1)
        slots = (positions.long() + self.offsets).reshape(-1)
        return rows.index_select(0, slots).reshape(self.io.batch, -1, self.hidden_size)

    def action_features(
        self, raw: torch.Tensor, calibrated: torch.Tensor, logits: torch.Tensor, cls: torch.Tensor
    ) -> torch.Tensor:
        """What the action head reads: the raw probabilities (+ the listed features), never
        the calibrated ones."""
        features = {"raw_probs": raw, "scorer_logits": logits, "cls_row": cls}
        return torch.cat([features[name] for name in self.spec.action_inputs], dim=1)

    def forward(
        self, hidden: torch.Tensor, candidate_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        rows = self.rows(hidden)
        selected = self.select(rows, candidate_positions)
        logits = run_mlp(self.scorer, self.spec.scorer.activation, selected)
        logits = logits.reshape(self.io.batch, -1)  # (B, K): one logit per row, or K from CLS
        raw = torch.softmax(logits, dim=1)
        calibrated = torch.softmax(logits * self.inv_temperature, dim=1)
        cls = rows[:: self.io.length]
        x = self.action_features(raw, calibrated, logits, cls)
        action = torch.softmax(run_mlp(self.action, self.spec.action.activation, x), dim=1)
        return selected, logits, raw, calibrated, action


def tail_outputs(outputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """The tail's outputs by name."""
    return dict(zip(OUTPUT_NAMES, outputs, strict=True))


def as_decision(module: nn.Module) -> DecisionEncoder:
    """``module`` typed as the decision encoder."""
    return cast(DecisionEncoder, module)
