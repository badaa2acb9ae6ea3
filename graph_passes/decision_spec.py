"""The decision head's description: what follows a ModernBERT encoder in a decision model.

    encoder (every layer, its final norm) -> H head layers (the encoder's block, global
    attention) -> head norm -> candidate rows (K marker positions, or the CLS row) -> scorer
    -> K logits -> raw probabilities softmax(z) -> calibrated probabilities softmax(z / T)
    -> action head on [raw probabilities (+ listed features)] -> action probabilities

The checkpoint layout, every key and every tensor name is in ``docs/decision-head.md``; the
architecture file (`graph_passes.archs.decision_head`) reads the JSON config and maps the
head's tensors into a `DecisionHead` (this description plus canonical weights).

Canonical head weight names (``N`` encoder layers, head layer ``j``)::

    layers.{N+j}.*                    the shared block names (`graph_passes.spec`)
    head_norm.weight / .bias          (D,)        after the last head layer
    scorer.{k}.weight / .bias         (w[k+1], w[k])
    action.{k}.weight / .bias         (a[k+1], a[k])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from graph_passes.spec import LayerSpec, NormSpec

CandidateKind = Literal["markers", "cls"]
MlpActivation = Literal["gelu", "tanh", "relu"]
# What the action head reads, concatenated in the listed order; "raw_probs" comes first.
ActionInput = Literal["raw_probs", "scorer_logits", "cls_row"]
ACTION_INPUTS: tuple[str, ...] = ("raw_probs", "scorer_logits", "cls_row")


@dataclass(frozen=True)
class CandidateSpec:
    """How the K candidate positions of a request are found.

    ``markers``: the positions whose token id is one of ``marker_token_ids``, in order; a
    request must hold exactly K of them (anything else is an error naming the request).
    ``cls``: the request's first token (position 0); the scorer maps that one row to K logits.
    """

    kind: CandidateKind
    marker_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class MlpHeadSpec:
    """A small MLP: Linear(widths[0] -> widths[1]), activation, ..., Linear(-> widths[-1]).
    The activation sits between linear layers, never after the last one."""

    widths: tuple[int, ...]
    activation: MlpActivation

    @property
    def num_linear(self) -> int:
        """Number of linear layers."""
        return len(self.widths) - 1


@dataclass(frozen=True)
class DecisionHeadSpec:
    """The decision head, completely: layers, norm, candidates, scorer, calibration, action."""

    layers: tuple[LayerSpec, ...]  # the encoder's block (global or local), attention norm kept
    norm: NormSpec | None  # the head norm after the last head layer (None: none)
    candidates: CandidateSpec
    num_candidates: int  # K
    scorer: MlpHeadSpec  # D -> ... -> 1 per marker row (markers) or D -> ... -> K (cls)
    action: MlpHeadSpec  # sum of the action inputs' widths -> ... -> len(actions)
    action_inputs: tuple[ActionInput, ...]
    actions: tuple[str, ...]  # action names in logit order
    temperature: float  # T: calibrated = softmax(logits / T); the action head never reads it

    @property
    def num_layers(self) -> int:
        """Head layers (H)."""
        return len(self.layers)

    @property
    def num_actions(self) -> int:
        """Action logits."""
        return len(self.actions)


@dataclass
class DecisionHead:
    """A head description plus its weights under canonical names (module docstring)."""

    spec: DecisionHeadSpec
    weights: dict[str, torch.Tensor] = field(repr=False)
    config: dict[str, object] = field(default_factory=dict)  # the JSON config as read


class CandidateError(ValueError):
    """A request whose candidates do not fit the head (wrong number of markers)."""


def candidate_positions(
    token_ids: tuple[int, ...] | list[int], spec: DecisionHeadSpec, request: str
) -> list[int]:
    """The K candidate positions of one request, in order: the marker tokens' positions, or
    position 0 (CLS) for a ``cls`` head. A request holding another number of markers than K is
    an error naming it: never a silent pad or truncation."""
    if spec.candidates.kind == "cls":
        return [0]
    markers = set(spec.candidates.marker_token_ids)
    found = [i for i, t in enumerate(token_ids) if t in markers]
    if len(found) != spec.num_candidates:
        raise CandidateError(
            f"request {request}: holds {len(found)} marker token(s) "
            f"{list(spec.candidates.marker_token_ids)} at positions {found}; the head scores "
            f"exactly num_candidates = {spec.num_candidates}"
        )
    return found
