"""One measuring loop for every model kind's torch-level candidates (SPEC section 4).

A candidate is a `Runner`: a batch in, its per-layer states and its outputs by name out.
`measure` runs it over every batch (an fp16 candidate twice, for bitwise determinism), checks
that every output and state is finite, hands each fixture's row of the outputs to the model
kind's `Score` and, given the per-layer rows, folds each layer's relative error at the
fixture's real positions (and its largest |h|) into the fp32 or fp16 columns. Decoders,
encoders and decision models differ only in their runners, their scores and where a sample's
real positions sit in a state (`StateRows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from parity.fixtures import Batch, Fixture
from parity.gate_registry import GateResult, Level, Worst, gate
from parity.result import LayerRow, Outputs, Runner, rel_error
from parity.thresholds import Thresholds


@dataclass
class Measured:
    """What running a candidate over every batch showed, besides its per-fixture figures."""

    finite: bool = True  # every output and state, padded slots included (fp16 only)
    deterministic: bool = True  # two runs, identical bits (fp16 only)
    worst_layer: Worst = field(default_factory=lambda: Worst(0.0))  # fp32 only


# Scores one fixture (its row ``r`` of the batch's outputs) and returns its reference's
# per-layer states (n, D), for the per-layer comparison.
Score = Callable[[Fixture, int, Outputs], list[torch.Tensor]]
# (state, row, n) -> (n, D): sample ``row``'s ``n`` real positions of one layer's state, as
# the checkpoint's own hidden state (any stream scale divided out).
StateRows = Callable[[torch.Tensor, int, int], torch.Tensor]


def folded_rows(length: int) -> StateRows:
    """Real slots of right-padded (B, L) batches folded into (1, D, 1, B*L) states (encoders
    and decision models)."""

    def rows(state: torch.Tensor, row: int, n: int) -> torch.Tensor:
        start = row * length
        return state[0, :, 0, start : start + n].T

    return rows


def measure(runner: Runner, batches: list[Batch], score: Score, rows: StateRows,
            layers: list[LayerRow] | None, fp32: bool,
            progress: Callable[[], None] = lambda: None) -> Measured:  # fmt: skip
    """Run every batch (an fp16 candidate twice: determinism and finiteness of every output
    and state), score every fixture and, with ``layers``, fold each layer's relative error at
    real slots (and its largest |h|) into the fp32 or fp16 columns; ``progress`` is called
    per batch. The fp32 level's determinism and finiteness are not gated, so it runs once."""
    m = Measured()
    for batch in batches:
        states, out = runner(batch)
        if not fp32:
            again_states, again = runner(batch)
            m.deterministic &= all(torch.equal(v, again[k]) for k, v in out.items())
            m.finite &= all(bool(torch.isfinite(v).all()) for v in out.values())
            if states is not None and again_states is not None:
                m.deterministic &= all(
                    torch.equal(a, b) for a, b in zip(states, again_states, strict=True)
                )
                m.finite &= all(bool(torch.isfinite(s).all()) for s in states)
        for r, fixture in enumerate(batch.fixtures):
            hidden = score(fixture, r, out)
            if states is None or layers is None:
                continue
            for i, state in enumerate(states):
                h = rows(state, r, len(fixture.token_ids)).float()
                err, row = rel_error(h, hidden[i]), layers[i]
                if fp32:
                    m.worst_layer.see(err, f"layer {i}, {fixture.name}")
                    row.fp32_rel_error = max(row.fp32_rel_error, err)
                    row.fp32_max_abs = max(row.fp32_max_abs, float(h.abs().max()))
                else:
                    row.fp16_rel_error = max(row.fp16_rel_error, err)
        if states is not None and layers is not None and not fp32:
            for i, state in enumerate(states):  # every slot, padding included
                layers[i].fp16_max_abs = max(layers[i].fp16_max_abs, float(state.abs().max()))
        progress()
    return m


# ---- what every model kind measures ----------------------------------------------------------


def max_abs(got: torch.Tensor, want: torch.Tensor, finite: bool) -> float:
    """``max |got - want|``; inf when ``got`` is not ``finite``."""
    return float((got - want).abs().max()) if finite else math.inf


def top2_margin(want: torch.Tensor) -> float:
    """``want``'s top1 - top2 (inf with one value): a larger change of the values than half
    of it cannot move the argmax."""
    top = want.topk(2).values if want.numel() > 1 else torch.tensor([math.inf, 0.0])
    return float(top[0] - top[1])


def label_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities over the last axis: the softmax at T=1; for one label (a
    cross-encoder's score) its sigmoid, as sentence-transformers' CrossEncoder reads it."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)


def decision_kept(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` makes ``want``'s decision over the last axis: the argmax; for one value
    (a cross-encoder's score, where an argmax never changes) its sign, p > 0.5 under the
    sigmoid."""
    if want.shape[-1] == 1:
        return bool(((got > 0) == (want > 0)).all())
    return int(got.argmax()) == int(want.argmax())


# A model kind's score of one implementation (named first) on one fixture, as `Score`.
KindScore = Callable[[str, Fixture, int, Outputs], list[torch.Tensor]]
# A model kind's gates on one implementation (named first) once it is measured.
KindGates = Callable[[str, Measured], list[GateResult]]


def measure_levels(torch_runners: dict[str, Runner], extra: dict[str, Runner] | None,
                   batches: list[Batch], rows: StateRows, layers: list[LayerRow],
                   score: KindScore, gates: KindGates) -> list[GateResult]:  # fmt: skip
    """Measure and gate every candidate in turn: the torch levels (``torch-fp32`` gated as
    fp32), each also per layer into ``layers``, then each ``extra`` candidate, whose states
    are not the module's (outputs only, gated like torch fp16)."""
    results: list[GateResult] = []
    for name, runner in {**torch_runners, **(extra or {})}.items():
        per_layer = layers if name in torch_runners else None
        m = measure(runner, batches, partial(score, name), rows, per_layer, name == "torch-fp32")
        results += gates(name, m)
    return results


def worst_gate(level: Level, key: str, t: Thresholds, worst: Worst,
               implementation: str | None = None, detail: str = "") -> GateResult:  # fmt: skip
    """Gate ``key`` at ``level`` on ``worst`` (value and where), against the recipe's
    threshold of the same name."""
    return gate(level, key).check(
        worst.value, getattr(t, key), implementation=implementation, where=worst.where,
        detail=detail,
    )  # fmt: skip
