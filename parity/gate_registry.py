"""One gate type, one result type, and the registry of every gate anec runs.

A `Gate` is declared once, here: its name, the level it gates, its comparison, the recipe key
that sets its threshold (or the fixed threshold when none does) and what it means. Every gate
site measures a value and calls `Gate.check`; the verdict and the comparison's text both come
from the gate's `Comparison`, so what a report prints is what was computed.

Names: a gate whose threshold the recipe sets is named by its recipe key's last component
(``gates.fp32_layer_rel_error`` sets ``fp32_layer_rel_error``), so the recipe's ``gates:`` is
keyed by gate name. One name may be registered at several levels (``fp16_argmax_agreement``
gates torch fp16 and the MIL fp16 program alike), and they share the threshold.

Adding a gate: register it in `_REGISTRY` below, check it where the value is measured, and
list it in docs/parity.md's gate table (a test compares the table with this registry).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

Level = Literal[
    "torch-fp32",
    "torch-fp16",
    "mil-fp32",
    "mil-fp16",
    "mil-device-margin",
    "acceptance",
    "kv-cache",
    "compression",
    "plan",
    "recheck",
]


class Comparison(str, Enum):
    """How a measured value must relate to its threshold; the value is its text."""

    AT_MOST = "<="
    AT_LEAST = ">="
    EQUALS = "=="

    def holds(self, value: float, threshold: float) -> bool:
        """True when ``value`` satisfies the comparison (never for NaN)."""
        return {"<=": operator.le, ">=": operator.ge, "==": operator.eq}[self.value](
            value, threshold
        )


@dataclass(frozen=True)
class Gate:
    """One registered gate."""

    name: str
    level: Level
    comparison: Comparison
    meaning: str
    # The dotted path of the recipe field that sets the threshold ("[]" steps into a list's
    # items), or None when the threshold is fixed.
    recipe_key: str | None = None
    fixed: float | None = None  # the threshold when no recipe key sets it

    def check(
        self,
        value: float,
        threshold: float | None = None,
        *,
        implementation: str | None = None,
        where: str = "",
        detail: str = "",
    ) -> GateResult:
        """The result of this gate on ``value``.

        ``threshold`` comes from the recipe key (required then, refused otherwise: a fixed
        gate cannot be moved); ``implementation`` names what was run when it is not the level
        itself (a partitioned torch run, a compressed variant's MIL program, a plan's
        evidence); ``where`` says where the value was worst (layer, fixture, tensor, chip).
        """
        if self.recipe_key is not None:
            if threshold is None:
                raise ValueError(f"gate {self.key}: needs the threshold {self.recipe_key}")
        elif threshold is not None:
            raise ValueError(f"gate {self.key}: its threshold is fixed at {self.fixed}")
        else:
            threshold = self.fixed
        assert threshold is not None  # a fixed gate is registered with its threshold
        return GateResult(
            self, implementation or self.level, float(value), float(threshold), where, detail
        )

    @property
    def key(self) -> str:
        """``level/name``: unique in the registry."""
        return f"{self.level}/{self.name}"


@dataclass(frozen=True)
class GateResult:
    """One checked gate: the measured value against its threshold, and where it was worst."""

    gate: Gate
    implementation: str  # what was run: usually the level itself
    value: float
    threshold: float
    where: str = ""  # layer / fixture / tensor / chip where the value was worst
    detail: str = ""

    @property
    def passed(self) -> bool:
        """The comparison applied to value and threshold."""
        return self.gate.comparison.holds(self.value, self.threshold)

    @property
    def name(self) -> str:
        """The gate's name."""
        return self.gate.name

    @property
    def level(self) -> Level:
        """The gate's level."""
        return self.gate.level

    @property
    def comparison(self) -> str:
        """The comparison's text."""
        return self.gate.comparison.value

    def relation(self, digits: int = 3) -> str:
        """``value <= threshold``, both to ``digits`` significant digits."""
        return f"{self.value:.{digits}g} {self.comparison} {self.threshold:.{digits}g}"

    def text(self) -> str:
        """One line: name, what ran and where, the relation, the verdict."""
        where = f" at {self.where}" if self.where else ""
        verdict = "pass" if self.passed else "FAIL"
        return f"{self.name} ({self.implementation}{where}): {self.relation(6)}: {verdict}"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (inf and NaN spelt as strings: JSON has neither)."""
        return {
            "name": self.name,
            "level": self.level,
            "implementation": self.implementation,
            "value": json_number(self.value),
            "comparison": self.comparison,
            "threshold": json_number(self.threshold),
            "passed": self.passed,
            "where": self.where,
            "detail": self.detail,
            "recipe_key": self.gate.recipe_key,
            "meaning": self.gate.meaning,
        }


def json_number(value: float) -> float | str:
    """``value``, or its text when it is inf or NaN (JSON has neither)."""
    return value if math.isfinite(value) else str(value)


class Gated:
    """A result holding its checked ``gates``: passed when every gate passed (and for none)."""

    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        """True when every gate passed."""
        return all(g.passed for g in self.gates)


def first_few(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` names and how many more: a ``where`` listing every offender."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


@dataclass
class Worst:
    """The worst value seen so far and where it was seen, for a gate's ``where``.

    Largest by default, smallest with ``lowest``; NaN counts as worst of all, so a NaN is
    never hidden behind a finite maximum.
    """

    value: float
    lowest: bool = False
    where: str = ""

    def see(self, value: float, where: str) -> None:
        """Keep ``value`` (and ``where``) when it is worse than the worst so far."""
        if math.isnan(self.value):
            return
        worse = value < self.value if self.lowest else value > self.value
        if worse or math.isnan(value):
            self.value, self.where = value, where

    def then(self, later: Worst) -> Worst:
        """The worst of this one's values and then ``later``'s, as one `Worst` seeing them
        all in that order would hold (both started from the same value)."""
        if math.isnan(self.value):
            return self
        worse = later.value < self.value if self.lowest else later.value > self.value
        return later if worse or math.isnan(later.value) else self


def worst_of(pairs: Iterable[tuple[float, str]], lowest: bool = False) -> Worst:
    """The worst of ``(value, where)`` pairs: the largest (from 0), or with ``lowest`` the
    smallest (from inf); NaN counts as worst, as in `Worst`."""
    worst = Worst(math.inf if lowest else 0.0, lowest)
    for value, where in pairs:
        worst.see(value, where)
    return worst


def agreement(kept: dict[str, bool]) -> tuple[float, str]:
    """The share of names kept, and the first few that were not: a gate's value and where."""
    return sum(kept.values()) / len(kept), first_few([k for k, ok in kept.items() if not ok])


def stability_gates(level: Level, implementation: str, finite: bool, deterministic: bool,
                    finite_detail: str = "") -> list[GateResult]:  # fmt: skip
    """``finite_outputs`` and ``deterministic`` (two runs, identical bits) of a candidate."""
    return [
        gate(level, "finite_outputs").check(
            float(finite), implementation=implementation, detail=finite_detail
        ),
        gate(level, "deterministic").check(
            float(deterministic), implementation=implementation, detail="two runs, identical bits"
        ),
    ]


# ---- the registry -----------------------------------------------------------------------------

_LE, _GE, _EQ = Comparison.AT_MOST, Comparison.AT_LEAST, Comparison.EQUALS
_FINITE = "every output (and, where captured, every layer state), padded positions included"
_ARGMAX = (
    "share of real positions (encoder logits: fixtures) whose argmax (one label: the score's "
    "sign) matches the original"
)
_DPROB = (
    "largest |p' - p|, softmax at T=1 over the vocabulary or labels (one label: its sigmoid), "
    "real positions"
)
_COSINE = "worst cosine to the original's output, per sentence embedding or real token"
_COSINE32 = "encoders (sentence embeddings): worst cosine to the original's, in fp32"
_VARIANT = "compression.variants[].gates."

_REGISTRY: tuple[Gate, ...] = (
    # torch fp32: the rewrite itself
    Gate("fp32_layer_rel_error", "torch-fp32", _LE,
         "worst ||h' - h|| / ||h|| over layers and fixtures, real positions, against the "
         "original model", "gates.fp32_layer_rel_error"),
    Gate("fp32_logits_rel_error", "torch-fp32", _LE,
         "worst ||y' - y|| / ||y|| of the task output per fixture (logits; an encoder's "
         "hidden state or logits), real positions", "gates.fp32_logits_rel_error"),
    Gate("fp32_min_cosine", "torch-fp32", _GE, _COSINE32, "gates.fp32_min_cosine"),
    # torch fp16: fp16 storage between ops (a partitioned encoder's pieces too)
    Gate("fp16_argmax_agreement", "torch-fp16", _GE, _ARGMAX, "gates.fp16_argmax_agreement"),
    Gate("fp16_max_abs_dprob", "torch-fp16", _LE, _DPROB, "gates.fp16_max_abs_dprob"),
    Gate("fp16_min_cosine", "torch-fp16", _GE, "encoders: " + _COSINE,
         "gates.fp16_min_cosine"),
    Gate("finite_outputs", "torch-fp16", _EQ, _FINITE, fixed=1.0),
    Gate("deterministic", "torch-fp16", _EQ, "two runs give identical bits", fixed=1.0),
    # decision models (task decision): the gathered candidate rows, then every output
    Gate("fp32_marker_rows_rel_error", "torch-fp32", _LE,
         "decision: worst ||r' - r|| / ||r|| of the gathered candidate rows per request",
         "decision.fp32_marker_rows_rel_error"),
    Gate("fp32_marker_rows_rel_error", "mil-fp32", _LE,
         "decision: the tail program (fp32 profile) on the island program's output, its "
         "gathered rows against the rows at the requests' positions",
         "decision.fp32_marker_rows_rel_error"),
    # the emitted program in the MIL evaluator
    Gate("layer_markers_present", "mil-fp32", _EQ,
         "the MIL evaluator prepares the emitted program(s) (every piece, every cached "
         "function) and finds each layer's output, layer_<i>_out, so layers can be compared",
         fixed=1.0),
    Gate("mil_fp32_layer_rel_error", "mil-fp32", _LE,
         "worst ||h' - h|| / ||h|| over layers (decoders: and logits) and fixtures, real "
         "positions, the program in fp32 against the BC1L module with the program's constants "
         "in fp64 (cached functions: per call, written key / value rows too, reading the "
         "cache the program held)", "gates.mil_fp32_layer_rel_error"),
    Gate("fp16_argmax_agreement", "mil-fp16", _GE, _ARGMAX, "gates.fp16_argmax_agreement"),
    Gate("fp16_max_abs_dprob", "mil-fp16", _LE, _DPROB, "gates.fp16_max_abs_dprob"),
    Gate("fp16_min_cosine", "mil-fp16", _GE, "encoders: " + _COSINE,
         "gates.fp16_min_cosine"),
    Gate("finite_outputs", "mil-fp16", _EQ, _FINITE, fixed=1.0),
    Gate("finite_values", "mil-fp16", _EQ,
         "decoders: values of the program (every op's output, not only the outputs) that "
         "hold an inf or NaN, padded positions included", fixed=0.0),
    Gate("deterministic", "mil-fp16", _EQ, "encoders: two runs give identical bits", fixed=1.0),
    Gate("head_choice_mismatches", "mil-fp16", _EQ,
         "io.output argmax / topk: positions where the ids the host combines from the "
         "in-model argmax / top-k outputs (or their values) differ from the top ids of the "
         "program's own logits, captured before the selection", fixed=0.0),
    # opt-in: the program under the errors others report for the NE (parity/mil/deviations.py)
    Gate("device_margin_argmax_agreement", "mil-device-margin", _GE,
         "decoders, opt-in: share of real positions whose argmax matches the original under "
         "the device-margin profile (fp16-acc plus the reported per-op deviations with seeded "
         "signs), the worst seed per position; runs only when the recipe sets it",
         "gates.device_margin_argmax_agreement"),
    # a trimmed draft vocabulary (recipe vocabulary:), judged as a draft of its checkpoint
    Gate("acceptance_loss", "acceptance", _LE,
         "decoders with a trimmed head: relative drop of mean accepted drafts per cycle at "
         "K = 4, the trimmed fp16 draft against the untrimmed one, greedy, the checkpoint in "
         "fp32 as target, on the judging text's prompts", "vocabulary.acceptance_loss"),
    # a decision model, at torch fp16 and in the MIL evaluator alike
    *(
        gate_
        for level in ("torch-fp16", "mil-fp16")
        for gate_ in (
            Gate("candidate_argmax_agreement", level, _GE,
                 "decision: share of requests whose chosen candidate matches the original",
                 "decision.candidate_argmax_agreement"),
            Gate("action_argmax_agreement", level, _GE,
                 "decision: share of requests whose chosen action matches the original",
                 "decision.action_argmax_agreement"),
            Gate("max_abs_dprob_calibrated", level, _LE,
                 "decision: largest |p' - p| of the calibrated candidate probabilities "
                 "softmax(z / T)",
                 "decision.max_abs_dprob_calibrated"),
            Gate("max_abs_dprob_action", level, _LE,
                 "decision: largest |p' - p| of the action probabilities",
                 "decision.max_abs_dprob_action"),
            Gate("temperature_certificate", level, _LE,
                 "decision: max over requests of ||p' - p||_inf / (delta / (2T) + rounding), "
                 "delta the largest scorer-logit error; above 1 the calibrated output is not "
                 "softmax(z' / T)",
                 fixed=1.0),
        )
    ),
    # a cached decoder's package (cache style state / io) through the host loop (SPEC 4,
    # "Cached decoders"): the conversion's cache logic in the MIL evaluator's fp32 profile,
    # strictly, against the window module with the program's constants in fp64 over the
    # whole sequence (no cache; parity/kv_fp32.py)
    Gate("fp32_layer_rel_error", "kv-cache", _LE,
         "every call of every cached function over each fixture's whole continuation, in "
         "fp32: worst ||h' - h|| / ||h|| of each layer's output per real position",
         "gates.fp32_layer_rel_error"),
    Gate("fp32_logits_rel_error", "kv-cache", _LE,
         "the same calls: worst ||y' - y|| / ||y|| of the logits per returned position",
         "gates.fp32_logits_rel_error"),
    Gate("kv_fp32_max_abs_logit_error", "kv-cache", _LE,
         "the same calls: largest |logit error| (an exact computation gives about 1e-3)",
         fixed=0.01),
    Gate("kv_fp32_extend_max_abs_diff", "kv-cache", _LE,
         "fp32: K-token extend against the single-token decode steps, largest |logit "
         "difference|", fixed=0.01),
    Gate("kv_fp32_stale_max_abs_diff", "kv-cache", _EQ,
         "fp32: decode steps after a rejected draft and 3e4 written into every slot beyond "
         "the position, against the clean run: largest |difference| (bits)", fixed=0.0),
    # ... and fp16 by what a draft's user sees (parity/kv_gates.py); the fp16 logit error is
    # reported in kv_parity.json, not gated
    Gate("kv_max_abs_dprob", "kv-cache", _LE,
         "prefill then the greedy continuation decoded through the cache in fp16: largest "
         "|p' - p|, softmax at T=1, against the original model's full recompute in fp32 (at "
         "most 0.03)", "gates.kv_max_abs_dprob"),
    Gate("kv_finite_outputs", "kv-cache", _EQ,
         "every logit of every call (prefill, decode, extend) is finite", fixed=1.0),
    Gate("kv_argmax_flips", "kv-cache", _EQ,
         "positions whose argmax differs from the reference's where its top1 - top2 > 0.5 "
         "(listed in kv_parity.json)", fixed=0.0),
    Gate("kv_extend_argmax_flips", "kv-cache", _EQ,
         "extend positions whose argmax differs from the decode step's where the reference's "
         "margin > 0.5 (on a device: the decode step's)", fixed=0.0),
    Gate("kv_stale_max_abs_diff", "kv-cache", _EQ,
         "decode steps after a rejected draft and 3e4 written into every slot beyond the "
         "position, against the clean run: largest |difference| (bits)", fixed=0.0),
    Gate("kv_head_choice_mismatches", "kv-cache", _EQ,
         "io.output argmax / topk: calls of the host loop whose combined argmax / top-k ids "
         "(or values) differ from the top ids of the function's own logits", fixed=0.0),
    Gate("kv_weights_stored_once", "kv-cache", _LE,
         "weight bytes of the multifunction package / of its largest single-function "
         "package", fixed=1.05),
    Gate("kv_weights_identical", "kv-cache", _EQ,
         "a compressed variant: weights whose stored bytes differ between the package's "
         "functions or from the window program its quality is scored on", fixed=0.0),
    # a compressed variant, each gate at torch fp16 and in the MIL evaluator
    Gate("min_top1_agreement", "compression", _GE,
         "share of held-out positions (an encoder classifier's: sentences) whose argmax "
         "matches the original checkpoint", _VARIANT + "min_top1_agreement"),
    Gate("max_mean_kl", "compression", _LE,
         "mean KL(p_original || p_variant) over held-out positions, nats",
         _VARIANT + "max_mean_kl"),
    Gate("max_abs_dprob", "compression", _LE,
         "largest |p' - p| at T=1 over held-out positions (checked when the variant sets it)",
         _VARIANT + "max_abs_dprob"),
    Gate("min_cosine", "compression", _GE,
         "encoders: worst cosine of the variant's output to the original's over held-out "
         "sentences (per real token for hidden states)", _VARIANT + "min_cosine"),
    Gate("finite_outputs", "compression", _EQ, "every held-out output of the variant",
         fixed=1.0),
    Gate("mil_fp32_layer_rel_error", "compression", _LE,
         "worst ||y' - y|| / ||y||, the variant program in fp32 against the same decoded weights: "
         "each layer's output and the logits against the torch module in fp64 (decoders; not "
         "for int8 activations), the output against the uncompressed program (encoders)",
         "gates.mil_fp32_layer_rel_error"),
    Gate("activation_quantizers_alike", "compression", _EQ,
         "int8 activations: quantizers whose torch fake-quantization of the program's own "
         "input differs from the program's output in any bit", fixed=0.0),
    Gate("weights_decoded_alike", "compression", _EQ,
         "compressed weights whose MIL-evaluator decoding, rounded to fp16, differs from "
         "coremltools' own", fixed=0.0),
    # placement (SPEC 5): on every chip of the platform, with the evidence it was checked on
    Gate("plan_min_ne_flop_share", "plan", _GE, "share of the program's FLOPs placed on the NE",
         "gates.plan_min_ne_flop_share"),
    Gate("plan_max_ne_segments", "plan", _LE, "NE segments in any one function of the package",
         "gates.plan_max_ne_segments"),
    # anec parity: the re-run against the artifact as published
    Gate("same_gate_set", "recheck", _EQ,
         "gates published but not re-run plus gates re-run but never published (MIL profiles "
         "left out with --profile excepted)", fixed=0.0),
)  # fmt: skip

REGISTRY: dict[str, Gate] = {g.key: g for g in _REGISTRY}
# Names a published artifact may carry that a gate has since replaced (old -> new): until
# 2026-12-08 an encoder's fp32 level named its markers gate evaluator_runs_program.
RENAMED = {"evaluator_runs_program": "layer_markers_present"}
if len(REGISTRY) != len(_REGISTRY):  # pragma: no cover - a registration mistake
    raise RuntimeError("parity.gate_registry: a level/name is registered twice")


def gate(level: str, name: str) -> Gate:
    """The registered gate ``name`` at ``level``."""
    try:
        return REGISTRY[f"{level}/{name}"]
    except KeyError:
        raise KeyError(f"no gate {name!r} is registered at level {level!r}") from None


def registered() -> list[Gate]:
    """Every registered gate, in registry order."""
    return list(_REGISTRY)
