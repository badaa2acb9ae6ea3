"""One threshold type and one result type for every model kind's parity run.

`parity.thresholds.Thresholds` holds every parity gate's threshold (re-exported here);
`ParityReport` is what a torch- or MIL-level run
measured: its gates, the per-layer rows and, for decoders, the per-fixture rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from graph_passes.stream_scale import FP16_MAX, StreamScaling
from parity.fixtures import Batch
from parity.gate_registry import Gated, GateResult, json_number
from parity.thresholds import Thresholds

# Outputs by name: an encoder's task output under `OUTPUT`, a decision model's tail outputs
# under graph_passes.decision.OUTPUT_NAMES.
Outputs = dict[str, torch.Tensor]
OUTPUT = "output"
# One implementation: a batch (right-padded for encoders and decision models, left-padded for
# decoders) -> its per-layer states (None where the implementation does not expose them) and
# outputs (`parity.measure`).
Runner = Callable[[Batch], tuple[list[torch.Tensor] | None, Outputs]]

# Diagnostic only (names the layer where an fp16 failure starts; gates are in the recipe):
# fp16 storage alone gives relative errors around 1e-3, so 1e-2 marks a real divergence.
FP16_DIVERGENCE = 1e-2


@dataclass
class LayerRow:
    """Per-layer figures, worst case over all fixtures (real positions)."""

    layer: int
    fp32_rel_error: float = 0.0
    fp16_rel_error: float = 0.0
    fp32_max_abs: float = 0.0  # the checkpoint's |h| (stream scale divided out), real positions
    fp16_max_abs: float = 0.0  # as the fp16 module stores it, every position (padding included)

    @property
    def fp16_overflow_margin(self) -> float:
        """How many times larger |h| could grow before fp16 overflows."""
        return FP16_MAX / self.fp16_max_abs if self.fp16_max_abs else float("inf")


@dataclass
class FixtureRow:
    """Per-fixture figures over its real positions (decoders)."""

    name: str
    slice: str
    tokens: int
    fp32_logits_rel_error: float
    fp16_argmax_agreement: float
    fp16_max_abs_dprob: float
    fp16_max_logit_error: float
    certified_positions: int  # top1 - top2 > 2 * max logit error: argmax provably kept


@dataclass
class ParityReport(Gated):
    """Everything a parity run measured, and the verdict."""

    gates: list[GateResult]
    layers: list[LayerRow]
    fixtures: list[FixtureRow]
    first_diverging_layer: int | None
    implementations: dict[str, str] = field(default_factory=dict)
    # Decoders: the measured ranges and the power-of-two scales chosen from them.
    stream: StreamScaling | None = None
    # The torch-fp16 level's row of the levels table: "run", or why it did not run.
    torch_fp16: str = "run"


def rel_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """``||candidate - reference|| / ||reference||`` in fp64 (inf if not finite)."""
    c, r = candidate.double(), reference.double()
    if not torch.isfinite(c).all():
        return float("inf")
    return float((c - r).norm() / r.norm().clamp_min(1e-30))


def first_diverging(
    layers: list[LayerRow], thresholds: Thresholds, fp16: bool = True
) -> int | None:
    """The first layer over the fp32 layer threshold (NaN counts), else (with ``fp16``) the
    first whose fp16 error exceeds `FP16_DIVERGENCE`; None when every layer is within."""
    for row in layers:
        if not row.fp32_rel_error <= thresholds.fp32_layer_rel_error:
            return row.layer
    for row in layers if fp16 else []:
        if not row.fp16_rel_error <= FP16_DIVERGENCE:
            return row.layer
    return None


def clean_json(value: object) -> object:
    """``value`` with every non-finite float spelt as a string (JSON has no inf / NaN),
    through dicts."""
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    return value


def rows_to_json(rows: Iterable[object]) -> list[dict[str, object]]:
    """Per-fixture (per-request) row dataclasses, JSON-ready (inf spelt out)."""
    return [{k: clean_json(v) for k, v in vars(row).items()} for row in rows]


def merge_rows(rows: Iterable[object], more: Iterable[object]) -> None:
    """Add each row of ``more``'s per-implementation figures (its dict fields) to the same
    fixture's row in ``rows`` (a later level measured on the same fixtures)."""
    for row, other in zip(rows, more, strict=True):
        for name, value in vars(other).items():
            if isinstance(value, dict):
                getattr(row, name).update(value)
