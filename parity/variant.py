"""What a compressed variant's parity run produces, for any model kind: each level against
the original checkpoint (gated) and the fp16 artifact (reported), the variant's gates, and
its report (``parity.json``, ``parity.txt``).

A decoder variant is compared per held-out position (top-1, KL, |dp|: ``parity.metrics``), an
encoder variant per held-out sentence (cosine, and argmax for a classifier); both report the
PSNR of each compared vector (``parity.compression_metrics``). The kind-specific measuring is
in ``parity.compression_gates`` (decoders) and ``parity.encoder_compression_gates``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.compression_metrics import PsnrSummary, summarize_psnr
from parity.gate import GateResult, all_passed
from parity.metrics import PositionRow, Summary, summarize
from parity.report import gate_line
from parity.result import clean_json


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
        if not self.argmax_kept:
            return None
        return sum(self.argmax_kept.values()) / len(self.argmax_kept)

    def to_json(self, per_position: bool) -> dict[str, Any]:
        """JSON-ready figures: the position summary, or the sentence cosines."""
        if per_position:
            return summary_json(self.summary) | {"psnr_db": self.psnr_summary.to_json()}
        data = {
            "min_cosine": self.min_cosine,
            "mean_cosine": self.mean_cosine,
            "argmax_agreement": self.argmax_agreement,
            "finite": self.finite,
            "cosine": self.cosine,
            "psnr_db": self.psnr_summary.to_json(),
        }
        return {k: clean_json(v) for k, v in data.items()}


@dataclass
class VariantLevel:
    """One implementation of a variant against both baselines."""

    implementation: str
    description: str
    vs_original: Compared
    vs_fp16: Compared

    @property
    def finite(self) -> bool:
        """Every output compared with the original was finite."""
        return self.vs_original.finite


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

    @property
    def per_position(self) -> bool:
        """Compared per position (decoders), else per sentence."""
        return self.output == "logits"


def summary_json(s: Summary) -> dict[str, Any]:
    """A Summary as JSON-ready data (the uncertified list shortened)."""
    data = {k: v for k, v in vars(s).items() if k != "uncertified"}
    data["uncertified_count"] = len(s.uncertified)
    return {
        k: (v if not isinstance(v, float) or np.isfinite(v) else str(v)) for k, v in data.items()
    }


def evaluator_weights(
    evaluator: Any, decoded: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The evaluator's own decoding of every compressed weight (by torch name), and the
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
                weights[name] = np.asarray(value, np.float32)
                same = np.array_equal(round_fp16(weights[name]).astype(np.float16), decoded[name])
                if not same:
                    mismatched.append(name)
    return weights, mismatched + [name for name in decoded if name not in weights]


def parity_json(result: VariantParity) -> dict[str, Any]:
    """The variant's parity report as JSON-ready data."""
    per_position = result.per_position
    return {
        "passed": result.passed,
        "gates": [g.to_json() for g in result.gates],
        "levels": [
            {
                "implementation": level.implementation,
                "description": level.description,
                "finite": level.finite,
                "against_original": level.vs_original.to_json(per_position),
                "against_fp16_artifact": level.vs_fp16.to_json(per_position),
            }
            for level in result.levels
        ],
        f"mil_fp32_{result.output}_rel_error": clean_json(result.mil_fp32_rel_error),
        "notes": result.notes,
    } | ({"acceptance": result.acceptance} if result.acceptance is not None else {})


def parity_text(result: VariantParity) -> str:
    """A readable summary: gates, then each level against both baselines (and, for
    encoders, per sentence)."""
    lines = ["Variant gates (fixed in the recipe; against the original checkpoint):"]
    lines += [gate_line(g) for g in result.gates]
    lines.append("")
    lines += _position_table(result) if result.per_position else _sentence_table(result)
    lines += result.notes
    return "\n".join(lines)


def _position_table(result: VariantParity) -> list[str]:
    lines = [
        "level       against         positions  top-1    mean KL   max KL  max|dp|  "
        "PSNR dB min / median / mean"
    ]
    for level in result.levels:
        for label, c in (("original", level.vs_original), ("fp16 artifact", level.vs_fp16)):
            s, p = c.summary, c.psnr_summary
            lines.append(
                f"{level.implementation:<11} {label:<15} {s.positions:>9}  "
                f"{s.argmax_agreement:>6.1%}  {s.mean_kl:>8.4f}  {s.max_kl:>7.3f}  "
                f"{s.max_abs_dprob:>7.4f}  {p.min_db:6.1f} / {p.median_db:6.1f} / "
                f"{p.mean_db:6.1f}"
            )
    lines.append(
        "PSNR: 20 log10(max|z_ref| / RMS(z - z_ref)) over each position's full logit vector"
    )
    lines.append(f"mil-fp32 logits relative error: {result.mil_fp32_rel_error:.3g}")
    return lines


def _sentence_table(result: VariantParity) -> list[str]:
    lines = [
        "level       against         sentences  min cos     mean cos   argmax  PSNR dB min / median"
    ]
    for level in result.levels:
        for label, c in (("original", level.vs_original), ("fp16 artifact", level.vs_fp16)):
            agree = "" if c.argmax_agreement is None else f"{c.argmax_agreement:.1%}"
            p = c.psnr_summary
            lines.append(
                f"{level.implementation:<11} {label:<15} {len(c.cosine):>9}  "
                f"{c.min_cosine:>9.6f}  {c.mean_cosine:>9.6f}  {agree:>6}  "
                f"{p.min_db:6.1f} / {p.median_db:6.1f}"
            )
    lines.append("PSNR: 20 log10(max|y_ref| / RMS(y - y_ref)) over each output vector")
    lines.append(f"mil-fp32 output relative error: {result.mil_fp32_rel_error:.3g}")
    lines.append("")
    names = [level.implementation for level in result.levels]
    lines.append("sentence        " + "".join(f"{n + ' cos':>18}" for n in names))
    for sentence in result.levels[0].vs_original.cosine if result.levels else []:
        cells = "".join(f"{lv.vs_original.cosine[sentence]:>18.6f}" for lv in result.levels)
        lines.append(f"{sentence:<16}{cells}")
    return lines
