"""Parity gates for decision models (SPEC section 4) against the reference
(`parity.decision_reference`): every output, every layer, every slice.

Candidates run the fixtures right-padded in fixed (B, L) batches; each returns the per-layer
folded states (or None) and the tail's outputs by name (`graph_passes.decision.OUTPUT_NAMES`).

* ``torch-fp32`` (the rewrite): relative error per layer, encoder and head layers
  (``fp32_layer_rel_error``), of the gathered marker rows (``fp32_marker_rows_rel_error``) and
  of every later output (``fp32_logits_rel_error``: scorer logits, raw, calibrated and action
  probabilities); the first output over its threshold is named;
* fp16 candidates (``torch-fp16``, ``partitioned-fp16``, the MIL program as ``mil-fp16``):
  candidate and action argmax agreement, max |dp| of calibrated and of action probabilities,
  finite, deterministic, and the temperature certificate. Softmax moves by at most half the
  largest change of its inputs, so with ``delta`` the largest scorer-logit error,
  ``||softmax(z'/T) - p||_inf <= delta / (2T)``. The program stores ``z' / T`` and the output
  in its float type (unit roundoff ``u``: 2^-11 in fp16, 2^-24 in fp32), which adds at most
  ``u max|z'| / (2T)`` (the rounded softmax input) and ``u max p'`` (the rounded output):
  ``bound = delta / (2T) + u max|z'| / (2T) + u max p' + 1e-6``. The gate is the largest
  ratio ``||p' - p||_inf / bound`` over requests (<= 1): above 1, the calibrated output is not
  softmax(z' / T) of the program's own logits (a wrong temperature, other logits). Where the
  bound itself is below ``max_abs_dprob_calibrated``, it proves that gate from the logit
  error alone (the detail counts those requests).

Slices (each gate's detail gives the worst value per slice): ``padded`` / ``full-window``,
``narrow-margin`` (reference top1 - top2 scorer logit below the recipe's margin) and
``adversarial-mask`` (the padded slots hold marker tokens: they must stay invisible).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from graph_passes.decision import OUTPUT_NAMES, DecisionEncoder, DecisionTail, tail_outputs
from graph_passes.decision_spec import DecisionHeadSpec, candidate_positions
from parity.decision_reference import DecisionOutputs, DecisionReferenceResult
from parity.encoder_gates import encoder_runner, fp16_module, level_of
from parity.fixtures import Batch, Fixture, make_batches
from parity.gate_registry import GateResult, Level, agreement, gate, stability_gates, worst_of
from parity.measure import Measured, folded_rows, max_abs, measure_levels, top2_margin, worst_gate
from parity.result import (
    FP16_DIVERGENCE,
    LayerRow,
    Outputs,
    ParityReport,
    Runner,
    Thresholds,
    first_diverging,
    rel_error,
)
from parity.torch_settings import TORCH_CPU

ADVERSARIAL = "adversarial-mask"
NARROW = "narrow-margin"


@dataclass
class DecisionRow:
    """One request's figures per implementation."""

    name: str
    slices: list[str]
    tokens: int
    margin: float  # reference scorer logits, top1 - top2
    rel_error: dict[str, dict[str, float]] = field(default_factory=dict)  # impl -> output
    candidate_kept: dict[str, bool] = field(default_factory=dict)
    action_kept: dict[str, bool] = field(default_factory=dict)
    dprob_calibrated: dict[str, float] = field(default_factory=dict)
    dprob_action: dict[str, float] = field(default_factory=dict)
    logit_delta: dict[str, float] = field(default_factory=dict)
    certificate: dict[str, float] = field(default_factory=dict)  # ||dp||_inf / bound
    bound: dict[str, float] = field(default_factory=dict)  # the certified |dp| bound
    certified: dict[str, bool] = field(default_factory=dict)  # margin > 2 delta
    first_diverging_output: dict[str, str | None] = field(default_factory=dict)


# ---- batches ---------------------------------------------------------------------------------


def make_decision_batches(
    fixtures: list[Fixture], batch: int, length: int, pad_id: int, spec: DecisionHeadSpec
) -> tuple[list[Batch], dict[str, list[str]]]:
    """Right-padded (B, L) batches, then the adversarial-mask copy of every batch with
    padding: its padded slots hold a marker token (CLS heads: the first real token), which the
    key mask and the run-time positions must keep invisible. Returns the batches and each
    request's slices. A fixture with another number of markers than K is an error naming it."""
    for f in fixtures:
        candidate_positions(f.token_ids, spec, f.name)
    batches = make_batches(fixtures, batch, length, pad_id, right=True)
    slices: dict[str, list[str]] = {f.name: [str(f.slice)] for f in fixtures}
    out = list(batches)
    for b in batches:
        pad = b.attention_mask == 0
        if not bool(pad.any()):
            continue
        ids = b.input_ids.clone()
        markers = spec.candidates.marker_token_ids
        ids[pad] = markers[0] if markers else int(b.input_ids[0, 0])
        renamed = tuple(
            Fixture(f"{f.name}+{ADVERSARIAL}", f.token_ids, f.slice) for f in b.fixtures
        )
        for f, r in zip(b.fixtures, renamed, strict=True):
            slices[r.name] = [str(f.slice), ADVERSARIAL]
        out.append(Batch(renamed, ids, b.attention_mask))
    return out, slices


def reference_name(name: str) -> str:
    """The reference a (possibly adversarial) request is compared with: its unpadded self."""
    return name.removesuffix(f"+{ADVERSARIAL}")


def batch_positions(batch: Batch, spec: DecisionHeadSpec) -> torch.Tensor | None:
    """(B, K) int32 candidate positions (rows beyond the fixtures repeat the first); None for
    a CLS head."""
    if spec.candidates.kind == "cls":
        return None
    rows = [candidate_positions(f.token_ids, spec, f.name) for f in batch.fixtures]
    rows += [rows[0]] * (batch.input_ids.shape[0] - len(rows))
    return torch.tensor(rows, dtype=torch.int32)


def fp16_pieces(module: DecisionEncoder, tail: DecisionTail
                ) -> tuple[DecisionEncoder, DecisionTail]:  # fmt: skip
    """The stack with fp16 epsilon floors and the tail, cast to fp16 (what the program stores)."""
    half = fp16_module(module)
    assert isinstance(half, DecisionEncoder)
    return half, copy.deepcopy(tail).half().eval()


def decision_runner(module: DecisionEncoder, tail: DecisionTail, dtype: torch.dtype) -> Runner:
    """The whole BC1L decision model (embedding, layers, tail) in ``dtype``."""

    def head(h: torch.Tensor, _: torch.Tensor, batch: Batch) -> Outputs:
        return tail_outputs(tail(h, batch_positions(batch, tail.spec)))

    return encoder_runner(module, dtype, head)


def _score(row: DecisionRow, name: str, got: Outputs, want: DecisionOutputs,
           spec: DecisionHeadSpec, t: Thresholds) -> None:  # fmt: skip
    """Fill ``row``'s figures for implementation ``name``: the first output past the fp32
    threshold (fp16: `FP16_DIVERGENCE`) is where it diverges."""
    fp16 = name != "torch-fp32"
    tolerance = FP16_DIVERGENCE if fp16 else t.fp32_logits_rel_error
    finite = all(bool(torch.isfinite(v).all()) for v in got.values())
    errors = {k: rel_error(got[k], getattr(want, k)) for k in OUTPUT_NAMES}
    row.rel_error[name] = errors
    row.first_diverging_output[name] = next(
        (k for k in OUTPUT_NAMES if not errors[k] <= tolerance), None
    )
    cal, act = got["calibrated_probs"], got["action_probs"]
    row.candidate_kept[name] = finite and int(cal.argmax()) == int(want.calibrated_probs.argmax())
    row.action_kept[name] = finite and int(act.argmax()) == int(want.action_probs.argmax())
    row.dprob_calibrated[name] = dcal = max_abs(cal, want.calibrated_probs, finite)
    row.dprob_action[name] = max_abs(act, want.action_probs, finite)
    row.logit_delta[name] = delta = max_abs(got["scorer_logits"], want.scorer_logits, finite)
    u = 2.0**-11 if fp16 else 2.0**-24
    two_t = 2 * spec.temperature
    zmax = float(got["scorer_logits"].abs().max()) if finite else math.inf
    bound = delta / two_t + u * zmax / two_t + u * float(cal.max()) + 1e-6
    row.bound[name] = bound
    row.certificate[name] = dcal / bound if finite else math.inf
    row.certified[name] = finite and row.margin > 2 * delta


# ---- gates -----------------------------------------------------------------------------------


def _per_slice(rows: list[DecisionRow], values: dict[str, float]) -> str:
    """The worst of ``values`` (by request) in each slice, for a gate's detail."""
    worst: dict[str, float] = {}
    for row in rows:
        for s in row.slices:
            worst[s] = max(worst.get(s, 0.0), values[row.name])
    return "; ".join(f"{s} {v:.3g}" for s, v in sorted(worst.items()))


def _firsts(rows: list[DecisionRow], name: str) -> str:
    """The outputs where requests first diverged, or none."""
    return ", ".join(sorted({str(r.first_diverging_output[name]) for r in rows} - {"None"}))


def _fp32_gates(rows: list[DecisionRow], layers: list[LayerRow], module: DecisionEncoder,
                t: Thresholds) -> list[GateResult]:  # fmt: skip
    """Torch fp32: every layer (encoder and head), the gathered rows and every later output;
    the first layer and the first output over threshold are named."""
    first = first_diverging(layers, t, fp16=False)
    errors = [(row.name, row.rel_error["torch-fp32"]) for row in rows]
    return [
        worst_gate(
            "torch-fp32", "fp32_layer_rel_error", t,
            worst_of((layer.fp32_rel_error, module.layer_name(layer.layer)) for layer in layers),
            detail="max over encoder and head layers and requests of ||h'-h||/||h|| at real "
            "positions; first diverging layer: "
            + ("none" if first is None else module.layer_name(first)),
        ),
        worst_gate(
            "torch-fp32", "fp32_marker_rows_rel_error", t,
            worst_of((e["marker_rows"], f"marker_rows, {name}") for name, e in errors),
            detail="||r'-r||/||r|| of the gathered candidate rows (K x D) per request",
        ),
        worst_gate(
            "torch-fp32", "fp32_logits_rel_error", t,
            worst_of((e[k], f"{k}, {name}") for name, e in errors for k in OUTPUT_NAMES[1:]),
            detail="worst ||y'-y||/||y|| over scorer logits, raw, calibrated and action "
            f"probabilities; first diverging output: {_firsts(rows, 'torch-fp32') or 'none'}",
        ),
    ]  # fmt: skip


def _fp16_gates(name: str, rows: list[DecisionRow], m: Measured, t: Thresholds
                ) -> list[GateResult]:  # fmt: skip
    """An fp16 candidate: candidate and action argmax, |dp| of calibrated and action
    probabilities (worst per slice), the temperature certificate, finite and deterministic."""
    level: Level = level_of(name)
    n = len(rows)
    certified = sum(r.certified[name] for r in rows)
    diverging = f"; first diverging output (rel error > {FP16_DIVERGENCE:g}): " + (
        _firsts(rows, name) or "none"
    )
    candidate, candidate_where = agreement({r.name: r.candidate_kept[name] for r in rows})
    action, action_where = agreement({r.name: r.action_kept[name] for r in rows})
    gates = [
        gate(level, "candidate_argmax_agreement").check(
            candidate, t.candidate_argmax_agreement, implementation=name, where=candidate_where,
            detail=f"{certified}/{n} certified (top1 - top2 > 2 max|dz|){diverging}",
        ),
        gate(level, "action_argmax_agreement").check(
            action, t.action_argmax_agreement, implementation=name, where=action_where,
        ),
    ]  # fmt: skip
    for key, values in (
        ("max_abs_dprob_calibrated", {r.name: r.dprob_calibrated[name] for r in rows}),
        ("max_abs_dprob_action", {r.name: r.dprob_action[name] for r in rows}),
    ):
        worst = worst_of((value, row_name) for row_name, value in values.items())
        detail = "per slice: " + _per_slice(rows, values) + diverging
        gates.append(worst_gate(level, key, t, worst, name, detail))
    cert = worst_of((row.certificate[name], row.name) for row in rows)
    proven = sum(r.bound[name] <= t.max_abs_dprob_calibrated for r in rows)
    gates.append(
        gate(level, "temperature_certificate").check(
            cert.value, implementation=name, where=cert.where,
            detail="max over requests of ||p'-p||_inf / (delta/(2T) + fp16 rounding terms), "
            f"delta = max |dz| of the scorer logits; largest bound "
            f"{max(r.bound[name] for r in rows):.3g}; the bound alone proves "
            f"max_abs_dprob_calibrated for {proven}/{n} requests",
        )
    )  # fmt: skip
    return gates + stability_gates(level, name, m.finite, m.deterministic)


def _rows(batches: list[Batch], slices: dict[str, list[str]],
          references: dict[str, DecisionReferenceResult], narrow: float
          ) -> dict[str, DecisionRow]:  # fmt: skip
    """Each request's row, tagged with its slices (narrow-margin when the reference's top1 -
    top2 scorer logit is below ``narrow``)."""
    rows: dict[str, DecisionRow] = {}
    for f in (f for b in batches for f in b.fixtures):
        margin = top2_margin(references[reference_name(f.name)].outputs.scorer_logits)
        tags = list(slices.get(f.name, [f.slice]))
        if margin < narrow:
            tags.append(NARROW)
        rows[f.name] = DecisionRow(f.name, tags, len(f.token_ids), margin)
    return rows


def check_decision(
    module: DecisionEncoder,
    tail: DecisionTail,
    batches: list[Batch],
    slices: dict[str, list[str]],
    references: dict[str, DecisionReferenceResult],
    thresholds: Thresholds,
    extra: dict[str, Runner] | None = None,
    torch_levels: bool = True,
) -> tuple[ParityReport, list[DecisionRow]]:
    """Every decision gate: torch fp32 and fp16 (`fp16_pieces`), then each ``extra``
    candidate gated like torch fp16. ``torch_levels=False`` runs only the extra candidates."""
    layers = [LayerRow(i) for i in range(len(module.layers))]
    rows = _rows(batches, slices, references, thresholds.narrow_margin)
    runners = {
        "torch-fp32": decision_runner(module, tail, torch.float32),
        "torch-fp16": decision_runner(*fp16_pieces(module, tail), torch.float16),
    } if torch_levels else {}  # fmt: skip

    def score(name: str, fixture: Fixture, r: int, out: Outputs) -> list[torch.Tensor]:
        ref = references[reference_name(fixture.name)]
        got = {k: v[r].float() for k, v in out.items()}
        _score(rows[fixture.name], name, got, ref.outputs, tail.spec, thresholds)
        return ref.hidden

    def gates(name: str, m: Measured) -> list[GateResult]:
        if name == "torch-fp32":
            return _fp32_gates(list(rows.values()), layers, module, thresholds)
        return _fp16_gates(name, list(rows.values()), m, thresholds)

    measured = measure_levels(runners, extra, batches, folded_rows(module.io.length), layers,
                              score, gates)  # fmt: skip
    first = first_diverging(layers, thresholds, fp16=False)
    report = ParityReport(measured, layers, [], first, {
        "reference": "transformers ModernBertModel + ModernBertEncoderLayer head layers + "
        "nn.Linear scorer / action head, fp32, each request alone, unpadded",
        "torch-fp32": "anec BC1L encoder + head stack and tail, torch fp32, right-padded batches",
        "torch-fp16": "the same with fp16 epsilon floors, cast to fp16, " + TORCH_CPU,
    })  # fmt: skip
    return report, list(rows.values())
