"""A compressed variant's parity, for any model kind (SPEC section 3): one loop over the levels
scoring the variant on the recipe's held-out slice (never calibration or fixtures) against two
baselines, one builder for its gates and one report (``parity.json``, ``parity.txt``):

* the original checkpoint (transformers, fp32): the function the artifact promises - gated;
* the fp16 artifact (the uncompressed module at torch level, the fp16 program at MIL level):
  what compression alone costs - reported.

Levels: ``torch-fp16`` - the BC1L module holding the variant's decoded weights (coremltools' own
decompression), cast to fp16; ``mil-fp16`` - the emitted variant program in anec's MIL
evaluator (fp16 storage profile); ``mil-fp32`` - the program in fp32 against the same decoded
weights elsewhere: compression lives in the weights alone, so only rounding may differ.

What differs between kinds is a `VariantKind`: a decoder variant is compared per held-out
position (``parity.compression_gates``), an encoder variant per held-out sentence
(``parity.encoder_compression_gates``); both report each compared vector's PSNR
(``parity.compression_metrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from parity.compression_metrics import PsnrSummary, summarize_psnr
from parity.gate import GateResult, agreement, all_passed, gate
from parity.memory import release_memory
from parity.metrics import PositionRow, Summary, summarize
from parity.report import gate_line
from parity.result import clean_json

# The levels a variant is scored at, in order: torch with the decoded weights, then the
# emitted program in anec's MIL evaluator.
LEVELS = ("torch-fp16", "mil-fp16")
Outputs = dict[str, torch.Tensor]  # held-out text, window or sentence -> its output, fp32


@dataclass
class Compared:
    """One implementation against one baseline: per position (``rows``, decoders) or per
    sentence (``cosine`` and, for a classifier, ``argmax_kept``: encoders), and the PSNR of
    each compared vector (dB)."""

    psnr: list[float]
    finite: bool
    rows: list[PositionRow] = field(default_factory=list)
    cosine: dict[str, float] = field(default_factory=dict)  # min over real tokens per sentence
    argmax_kept: dict[str, bool] = field(default_factory=dict)  # classifiers only

    @property
    def summary(self) -> Summary:
        """Aggregates over the compared positions (decoders)."""
        return summarize(self.rows)

    @property
    def psnr_summary(self) -> PsnrSummary:
        """PSNR over the compared vectors."""
        return summarize_psnr(self.psnr)

    @property
    def min_cosine(self) -> float:
        """The worst sentence's cosine."""
        return min(self.cosine.values()) if self.cosine else float("nan")

    @property
    def mean_cosine(self) -> float:
        """The mean over sentences."""
        return float(np.mean(list(self.cosine.values()))) if self.cosine else float("nan")

    @property
    def argmax_agreement(self) -> float | None:
        """Share of sentences whose predicted label is kept (classifiers only)."""
        return agreement(self.argmax_kept)[0] if self.argmax_kept else None

    def to_json(self, per_position: bool) -> dict[str, Any]:
        """JSON-ready figures: the position summary (its uncertified list counted), or the
        sentence cosines; then the PSNR."""
        if per_position:
            s = self.summary
            data = {k: v for k, v in vars(s).items() if k != "uncertified"}
            data["uncertified_count"] = len(s.uncertified)
        else:
            data = {
                "min_cosine": self.min_cosine,
                "mean_cosine": self.mean_cosine,
                "argmax_agreement": self.argmax_agreement,
                "finite": self.finite,
                "cosine": self.cosine,
            }
        return {k: clean_json(v) for k, v in data.items()} | {
            "psnr_db": self.psnr_summary.to_json()
        }


@dataclass
class VariantLevel:
    """One implementation of a variant against both baselines."""

    implementation: str
    description: str
    vs_original: Compared
    vs_fp16: Compared


@dataclass
class VariantParity:
    """Every level of one variant, its gates and the verdict; ``output`` names what the fp32
    program check compares ("logits": decoders, per position; "output": encoders)."""

    levels: list[VariantLevel]
    gates: list[GateResult]
    mil_fp32_rel_error: float
    notes: list[str] = field(default_factory=list)
    # compress.acceptance's report section (measured, not gated), when the recipe asks for it
    acceptance: dict[str, Any] | None = None
    output: str = "logits"

    @property
    def passed(self) -> bool:
        """True when every gate passed."""
        return all_passed(self.gates)


@dataclass(frozen=True)
class Score:
    """One measured figure of a variant, as its gate (at level "compression") checks it."""

    name: str
    value: float
    threshold: float | None = None  # None: the gate's fixed threshold
    where: str = ""
    detail: str = ""


def decoded_alike(mismatched: int, where: str = "") -> Score:
    """The ``weights_decoded_alike`` figure: weights the two decoders decode differently."""
    return Score("weights_decoded_alike", float(mismatched), where=where,
                 detail="compressed weights whose MIL-evaluator decoding, rounded to fp16, "
                 "differs from coremltools' own decoding")  # fmt: skip


class VariantKind(Protocol):
    """What differs between a decoder's and an encoder's variants."""

    output: str  # what the fp32 check compares: "logits" (per position) or "output"
    fp32_steps: int  # progress steps of `program_check`

    @property
    def descriptions(self) -> dict[str, str]:
        """What runs at each of `LEVELS`."""

    def run(self, implementation: str, program: Any, decoded: dict[str, np.ndarray],
            advance: Callable[[], None]) -> Outputs:  # fmt: skip
        """The outputs of torch holding ``decoded`` or of ``program`` (MIL fp16)."""

    def compare(self, got: Outputs, baseline: Outputs | None) -> Compared:
        """``got`` against ``baseline`` (None: the original checkpoint)."""

    def scores(self, compared: Compared, gates: Any) -> list[Score]:
        """A level's figures against the original, gated by the variant's ``gates``."""

    def program_check(self, program: Any, decoded: dict[str, np.ndarray]
                      ) -> tuple[float, list[Score]]:  # fmt: skip
        """The program in fp32 against the same weights: its relative error and figures.
        The last use of ``decoded``: a kind may empty it once compared (GBs at full size)."""


def baselines(kind: VariantKind, program: Any, advance: Callable[[], None]) -> dict[str, Outputs]:
    """The fp16 artifact's outputs at every level (``program``: the fp16 program)."""
    return {level: kind.run(level, program, {}, advance) for level in LEVELS}


def variant_parity(
    kind: VariantKind,
    gates: Any,
    program: Any,
    decoded: dict[str, np.ndarray],
    advance: Callable[[], None],
    fp16: dict[str, Outputs],
    notes: list[str] | None = None,
    acceptance: dict[str, Any] | None = None,
) -> VariantParity:
    """Every level of the variant against the original checkpoint (gated by ``gates``) and
    the fp16 artifact's ``fp16`` outputs (reported), then the program in fp32 (which may
    empty ``decoded``: its last use)."""
    levels, scores = [], []
    for implementation in LEVELS:
        got = kind.run(implementation, program, decoded, advance)
        vs_original, vs_fp16 = kind.compare(got, None), kind.compare(got, fp16[implementation])
        del got
        # Each level frees its copy of the model, and the comparisons their scratch, before
        # the next level makes one: at Qwen2.5-0.5B size each is GBs (bench compress.py
        # methods).
        release_memory()
        describe = kind.descriptions[implementation]
        levels.append(VariantLevel(implementation, describe, vs_original, vs_fp16))
        scores.append((implementation, kind.scores(vs_original, gates)))
    error, checked = kind.program_check(program, decoded)
    release_memory()
    for _ in range(kind.fp32_steps):
        advance()
    results = [
        gate("compression", s.name).check(
            s.value, s.threshold, implementation=implementation, where=s.where, detail=s.detail
        )
        for implementation, figures in [*scores, ("mil-fp32", checked)]
        for s in figures
    ]
    return VariantParity(levels, results, error, notes or [], acceptance, kind.output)


def evaluator_weights(
    evaluator: Any, decoded: dict[str, np.ndarray], widen: bool = True
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The evaluator's own decoding of every compressed weight (by torch name), in fp32
    (``widen``) or as the evaluator holds it (fp16 where exact: no fp32 copy), and the
    weights whose decoding differs from ``decoded`` (coremltools' decoding) once rounded to
    fp16, or that the evaluator did not decode at all (none expected)."""
    from parity.mil.numerics import round_fp16

    constants: dict[str, np.ndarray] = evaluator._constants  # decoded once, when prepared
    # the constexpr output is named "<mangled torch name>_to_fp16_<palettized|quantized>"
    mangled = {name.replace(".", "_"): name for name in decoded}
    weights: dict[str, np.ndarray] = {}
    mismatched: list[str] = []
    for out_name, value in constants.items():
        if not out_name.endswith(("_palettized", "_quantized")):
            continue
        for prefix, name in mangled.items():
            if out_name.startswith(prefix + "_"):
                wide = np.asarray(value, np.float32)
                weights[name] = wide if widen else value
                same = np.array_equal(round_fp16(wide).astype(np.float16), decoded[name])
                if not same:
                    mismatched.append(name)
    return weights, mismatched + [name for name in decoded if name not in weights]


def variant_report(
    result: VariantParity, about: dict[str, Any], line: str
) -> tuple[dict[str, Any], str]:
    """The variant's parity.json content (``about``: the held-out slice) and its parity.txt
    section (``line`` first: the held-out slice in words)."""
    per_position = result.output == "logits"
    doc = {
        "passed": result.passed,
        "gates": [g.to_json() for g in result.gates],
        "levels": [
            {
                "implementation": level.implementation,
                "description": level.description,
                "finite": level.vs_original.finite,
                "against_original": level.vs_original.to_json(per_position),
                "against_fp16_artifact": level.vs_fp16.to_json(per_position),
            }
            for level in result.levels
        ],
        f"mil_fp32_{result.output}_rel_error": clean_json(result.mil_fp32_rel_error),
        "notes": result.notes,
    } | ({"acceptance": result.acceptance} if result.acceptance is not None else {})
    return doc | {"held_out": about}, line + "\n" + _text(result)


def _text(result: VariantParity) -> str:
    """A readable summary: gates, then each level against both baselines (and, for
    encoders, per sentence)."""
    lines = ["Variant gates (fixed in the recipe; against the original checkpoint):"]
    lines += [gate_line(g) for g in result.gates]
    head, row, psnr = _TABLES[result.output]
    lines += ["", head]
    for level in result.levels:
        for label, c in (("original", level.vs_original), ("fp16 artifact", level.vs_fp16)):
            lines.append(f"{level.implementation:<11} {label:<15} {row(c)}")
    lines += [psnr, f"mil-fp32 {result.output} relative error: {result.mil_fp32_rel_error:.3g}"]
    if result.output != "logits":  # encoders: each sentence's cosine at each level
        names = [level.implementation for level in result.levels]
        lines += ["", "sentence        " + "".join(f"{n + ' cos':>18}" for n in names)]
        for sentence in result.levels[0].vs_original.cosine if result.levels else []:
            cells = "".join(f"{lv.vs_original.cosine[sentence]:>18.6f}" for lv in result.levels)
            lines.append(f"{sentence:<16}{cells}")
    return "\n".join(lines + result.notes)


def _position_row(c: Compared) -> str:
    s, p = c.summary, c.psnr_summary
    return (
        f"{s.positions:>9}  {s.argmax_agreement:>6.1%}  {s.mean_kl:>8.4f}  {s.max_kl:>7.3f}  "
        f"{s.max_abs_dprob:>7.4f}  {p.min_db:6.1f} / {p.median_db:6.1f} / {p.mean_db:6.1f}"
    )


def _sentence_row(c: Compared) -> str:
    agree = "" if c.argmax_agreement is None else f"{c.argmax_agreement:.1%}"
    p = c.psnr_summary
    return (
        f"{len(c.cosine):>9}  {c.min_cosine:>9.6f}  {c.mean_cosine:>9.6f}  {agree:>6}  "
        f"{p.min_db:6.1f} / {p.median_db:6.1f}"
    )


# The level table by `VariantParity.output`: its header, a compared baseline's row, and what
# its PSNR is of.
_TABLES: dict[str, tuple[str, Callable[[Compared], str], str]] = {
    "logits": (
        "level       against         positions  top-1    mean KL   max KL  max|dp|  "
        "PSNR dB min / median / mean",
        _position_row,
        "PSNR: 20 log10(max|z_ref| / RMS(z - z_ref)) over each position's full logit vector",
    ),
    "output": (
        "level       against         sentences  min cos     mean cos   argmax  "
        "PSNR dB min / median",
        _sentence_row,
        "PSNR: 20 log10(max|y_ref| / RMS(y - y_ref)) over each output vector",
    ),
}
