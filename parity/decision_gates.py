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

import math
from dataclasses import dataclass, field

import torch

from graph_passes.decision import OUTPUT_NAMES, DecisionEncoder, DecisionTail, tail_outputs
from graph_passes.decision_spec import DecisionHeadSpec, candidate_positions
from parity.decision_reference import DecisionReferenceResult
from parity.encoder_gates import encoder_runner, level_of, make_encoder_batches, state_rows
from parity.fixtures import Batch, Fixture
from parity.gate import GateResult, Level, Worst, first_few, gate
from parity.result import (
    FP16_DIVERGENCE,
    LayerRow,
    Outputs,
    ParityReport,
    Runner,
    Thresholds,
    clean_json,
    first_diverging,
    rel_error,
)

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
    batches = make_encoder_batches(fixtures, batch, length, pad_id)
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


def decision_runner(module: DecisionEncoder, tail: DecisionTail, dtype: torch.dtype) -> Runner:
    """The whole BC1L decision model (embedding, layers, tail) in ``dtype``."""

    def head(h: torch.Tensor, _: torch.Tensor, batch: Batch) -> Outputs:
        return tail_outputs(tail(h, batch_positions(batch, tail.spec)))

    return encoder_runner(module, dtype, head)


# ---- measuring -------------------------------------------------------------------------------


def _score(row: DecisionRow, name: str, got: Outputs, ref: DecisionReferenceResult,
           spec: DecisionHeadSpec, tolerance: float, fp16: bool) -> bool:  # fmt: skip
    """Fill ``row``'s figures for implementation ``name``; returns whether all were finite."""
    want = ref.outputs
    finite = all(bool(torch.isfinite(v).all()) for v in got.values())
    errors = {k: rel_error(got[k], getattr(want, k)) for k in OUTPUT_NAMES}
    row.rel_error[name] = errors
    row.first_diverging_output[name] = next(
        (k for k in OUTPUT_NAMES if not errors[k] <= tolerance), None
    )
    cal, act = got["calibrated_probs"], got["action_probs"]
    row.candidate_kept[name] = finite and int(cal.argmax()) == int(want.calibrated_probs.argmax())
    row.action_kept[name] = finite and int(act.argmax()) == int(want.action_probs.argmax())
    inf = float("inf")
    dcal = float((cal - want.calibrated_probs).abs().max()) if finite else inf
    row.dprob_calibrated[name] = dcal
    row.dprob_action[name] = float((act - want.action_probs).abs().max()) if finite else inf
    delta = float((got["scorer_logits"] - want.scorer_logits).abs().max()) if finite else inf
    row.logit_delta[name] = delta
    u = 2.0**-11 if fp16 else 2.0**-24
    two_t = 2 * spec.temperature
    zmax = float(got["scorer_logits"].abs().max()) if finite else inf
    bound = delta / two_t + u * zmax / two_t + u * float(cal.max()) + 1e-6
    row.bound[name] = bound
    row.certificate[name] = dcal / bound if finite else inf
    row.certified[name] = finite and row.margin > 2 * delta
    return finite


def _measure(
    name: str,
    runner: Runner,
    batches: list[Batch],
    references: dict[str, DecisionReferenceResult],
    rows: dict[str, DecisionRow],
    spec: DecisionHeadSpec,
    length: int,
    layers: list[LayerRow] | None,
    fp32: bool,
    tolerance: float,
) -> tuple[bool, bool]:
    """Run every batch twice; fill rows and layers. Returns (finite, deterministic)."""
    finite = deterministic = True
    for batch in batches:
        states, out = runner(batch)
        again_states, again = runner(batch)
        deterministic &= all(torch.equal(out[k], again[k]) for k in OUTPUT_NAMES)
        if states is not None and again_states is not None:
            deterministic &= all(
                torch.equal(a, b) for a, b in zip(states, again_states, strict=True)
            )
            finite &= all(bool(torch.isfinite(s).all()) for s in states)
        for r, fixture in enumerate(batch.fixtures):
            ref = references[reference_name(fixture.name)]
            got = {k: v[r].float() for k, v in out.items()}
            finite &= _score(rows[fixture.name], name, got, ref, spec, tolerance, not fp32)
            if states is None or layers is None:
                continue
            n = len(fixture.token_ids)
            for i, state in enumerate(states):
                err = rel_error(state_rows(state, length, r, n).float(), ref.hidden[i])
                if fp32:
                    layers[i].fp32_rel_error = max(layers[i].fp32_rel_error, err)
                else:
                    layers[i].fp16_rel_error = max(layers[i].fp16_rel_error, err)
    return finite, deterministic


# ---- gates -----------------------------------------------------------------------------------


def _per_slice(rows: list[DecisionRow], values: dict[str, float]) -> str:
    worst: dict[str, float] = {}
    for row in rows:
        for s in row.slices:
            worst[s] = max(worst.get(s, 0.0), values[row.name])
    return "; ".join(f"{s} {v:.3g}" for s, v in sorted(worst.items()))


def _fp32_gates(
    rows: list[DecisionRow], layers: list[LayerRow], module: DecisionEncoder,
    t: Thresholds,
) -> list[GateResult]:  # fmt: skip
    worst_layer = Worst(0.0)
    for layer in layers:
        worst_layer.see(layer.fp32_rel_error, module.layer_name(layer.layer))
    first = first_diverging(layers, t, fp16=False)
    gates = [
        gate("torch-fp32", "fp32_layer_rel_error").check(
            worst_layer.value,
            t.fp32_layer_rel_error,
            where=worst_layer.where,
            detail="max over encoder and head layers and requests of ||h'-h||/||h|| at real "
            "positions; first diverging layer: "
            + ("none" if first is None else module.layer_name(first)),
        )
    ]
    marker, output = Worst(0.0), Worst(0.0)
    for row in rows:
        errors = row.rel_error["torch-fp32"]
        marker.see(errors["marker_rows"], f"marker_rows, {row.name}")
        for k in OUTPUT_NAMES[1:]:
            output.see(errors[k], f"{k}, {row.name}")
    firsts = sorted({str(r.first_diverging_output["torch-fp32"]) for r in rows} - {"None"})
    gates.append(
        gate("torch-fp32", "fp32_marker_rows_rel_error").check(
            marker.value, t.fp32_marker_rows_rel_error, where=marker.where,
            detail="||r'-r||/||r|| of the gathered candidate rows (K x D) per request",
        )
    )  # fmt: skip
    gates.append(
        gate("torch-fp32", "fp32_logits_rel_error").check(
            output.value, t.fp32_logits_rel_error, where=output.where,
            detail="worst ||y'-y||/||y|| over scorer logits, raw, calibrated and action "
            f"probabilities; first diverging output: {', '.join(firsts) or 'none'}",
        )
    )  # fmt: skip
    return gates


def _fp16_gates(name: str, rows: list[DecisionRow], finite: bool, deterministic: bool,
                t: Thresholds) -> list[GateResult]:  # fmt: skip
    level: Level = level_of(name)
    n = len(rows)
    certified = sum(r.certified[name] for r in rows)
    firsts = sorted({str(r.first_diverging_output[name]) for r in rows} - {"None"})
    diverging = f"; first diverging output (rel error > {FP16_DIVERGENCE:g}): " + (
        ", ".join(firsts) or "none"
    )
    gates = [
        gate(level, "candidate_argmax_agreement").check(
            sum(r.candidate_kept[name] for r in rows) / n, t.candidate_argmax_agreement,
            implementation=name,
            where=first_few([r.name for r in rows if not r.candidate_kept[name]]),
            detail=f"{certified}/{n} certified (top1 - top2 > 2 max|dz|){diverging}",
        ),
        gate(level, "action_argmax_agreement").check(
            sum(r.action_kept[name] for r in rows) / n, t.action_argmax_agreement,
            implementation=name,
            where=first_few([r.name for r in rows if not r.action_kept[name]]),
        ),
    ]  # fmt: skip
    for key, values, threshold in (
        ("max_abs_dprob_calibrated", {r.name: r.dprob_calibrated[name] for r in rows},
         t.max_abs_dprob_calibrated),
        ("max_abs_dprob_action", {r.name: r.dprob_action[name] for r in rows},
         t.max_abs_dprob_action),
    ):  # fmt: skip
        worst = Worst(0.0)
        for row_name, value in values.items():
            worst.see(value, row_name)
        gates.append(
            gate(level, key).check(
                worst.value, threshold, implementation=name, where=worst.where,
                detail="per slice: " + _per_slice(rows, values) + diverging,
            )
        )  # fmt: skip
    cert = Worst(0.0)
    for row in rows:
        cert.see(row.certificate[name], row.name)
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
    gates.append(gate(level, "finite_outputs").check(float(finite), implementation=name))
    gates.append(
        gate(level, "deterministic").check(
            float(deterministic), implementation=name, detail="two runs, identical bits"
        )
    )
    return gates


def check_decision(
    module: DecisionEncoder,
    tail: DecisionTail,
    batches: list[Batch],
    slices: dict[str, list[str]],
    references: dict[str, DecisionReferenceResult],
    thresholds: Thresholds,
    extra: dict[str, Runner] | None = None,
    torch_levels: bool = True,
    fp16: tuple[DecisionEncoder, DecisionTail] | None = None,
) -> tuple[ParityReport, list[DecisionRow]]:
    """Every decision gate: torch fp32 and fp16 (``fp16``: the fp16 module and tail to run,
    else ``module`` and ``tail`` cast to fp16 by the caller), then each ``extra`` candidate
    gated like torch fp16. ``torch_levels=False`` runs only the extra candidates."""
    spec, length = tail.spec, module.io.length
    layers = [LayerRow(i) for i in range(len(module.layers))]
    rows: dict[str, DecisionRow] = {}
    for b in batches:
        for f in b.fixtures:
            ref = references[reference_name(f.name)].outputs.scorer_logits
            top = ref.topk(2).values if ref.numel() > 1 else torch.tensor([math.inf, 0.0])
            margin = float(top[0] - top[1])
            tags = list(slices.get(f.name, [f.slice]))
            if margin < thresholds.narrow_margin:
                tags.append(NARROW)
            rows[f.name] = DecisionRow(f.name, tags, len(f.token_ids), margin)
    row_list = list(rows.values())
    gates: list[GateResult] = []
    runners: dict[str, Runner] = {}
    if torch_levels:
        _measure("torch-fp32", decision_runner(module, tail, torch.float32), batches, references,
                 rows, spec, length, layers, True, thresholds.fp32_logits_rel_error)  # fmt: skip
        gates += _fp32_gates(row_list, layers, module, thresholds)
        if fp16 is not None:
            runners["torch-fp16"] = decision_runner(fp16[0], fp16[1], torch.float16)
    runners.update(extra or {})
    for name, runner in runners.items():
        states_layers = layers if name == "torch-fp16" else None
        finite, deterministic = _measure(name, runner, batches, references, rows, spec, length,
                                         states_layers, False, FP16_DIVERGENCE)  # fmt: skip
        gates += _fp16_gates(name, row_list, finite, deterministic, thresholds)
    first = first_diverging(layers, thresholds, fp16=False)
    report = ParityReport(gates, layers, [], first, {
        "reference": "transformers ModernBertModel + ModernBertEncoderLayer head layers + "
        "nn.Linear scorer / action head, fp32, each request alone, unpadded",
        "torch-fp32": "anec BC1L encoder + head stack and tail, torch fp32, right-padded batches",
        "torch-fp16": "the same with fp16 epsilon floors, cast to fp16, torch on the CPU",
    })  # fmt: skip
    return report, row_list


def rows_to_json(rows: list[DecisionRow]) -> list[dict[str, object]]:
    """Per-request figures, JSON-ready (inf spelt out)."""
    return [{k: clean_json(v) for k, v in vars(row).items()} for row in rows]
