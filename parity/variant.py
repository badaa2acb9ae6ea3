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

`VariantKind` is that core; a model kind is a small subclass saying how a level runs, what it
compares and how a comparison reads: a decoder variant per held-out position
(``parity.compression_gates``), an encoder variant per held-out sentence
(``parity.encoder_compression_gates``); both report each compared vector's PSNR (`psnr_db`).
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import torch

from parity.fixtures import Fixture
from parity.gate_registry import Gated, GateResult, gate
from parity.memory import release_memory
from parity.report import gate_line
from parity.result import Outputs, clean_json  # held-out text, window or sentence -> output

# The levels a variant is scored at, in order: torch with the decoded weights, then the
# emitted program in anec's MIL evaluator.
LEVELS = ("torch-fp16", "mil-fp16")
Advance = Callable[[], None]
Wrap = Callable[[torch.nn.Module], Any]  # a module -> a context manager changing how it runs


class Changes(Protocol):
    """A method's changes beyond weights (``compress.methods.base.Inspected``): ``wrap`` makes
    torch run as the program does, ``check`` counts what torch does not reproduce exactly."""

    @property
    def wrap(self) -> Wrap: ...
    @property
    def check(self) -> Callable[[Any, dict[str, Any]], int] | None: ...
    @property
    def notes(self) -> list[str]: ...


@dataclass
class HeldOutSlice:
    """The held-out slice every level scores (never calibration or fixtures) with the original
    model's outputs on it, and the calibration fixtures (read by calibrated methods only, never
    scored); a kind adds how its levels feed the slice to the program."""

    fixtures: list[Fixture]
    references: dict[str, Any]  # fixture name -> the original model's outputs
    pad_id: int
    calibration: list[Fixture]
    source: str  # where the slice comes from, in words

    def about(self) -> tuple[dict[str, Any], str]:
        """The slice for parity.json, and in words (parity.txt's first line)."""
        raise NotImplementedError


# ---- PSNR: the figure Apple's Core AI export gates 4-bit weights on (PSNR >= 35 dB) ---------
# ``psnr_db = 20 log10(max|z_ref| / RMS(z - z_ref))`` over one position's full logit vector (a
# decoder) or one sentence's task output (an encoder): the error's RMS against the reference's
# peak. Identical outputs give +inf; a non-finite candidate gives -inf.


def psnr_db(candidate: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """PSNR in dB of each row (the last axis is one output vector) of ``candidate``."""
    cand, ref = candidate.double(), reference.double()
    if cand.dim() == 1:
        cand, ref = cand[None], ref[None]
    cand, ref = cand.reshape(-1, cand.shape[-1]), ref.reshape(-1, ref.shape[-1])
    peak = ref.abs().amax(-1)
    rms = (cand - ref).pow(2).mean(-1).sqrt()
    out = []
    finite = torch.isfinite(cand).all(-1).tolist()
    for p, r, ok in zip(peak.tolist(), rms.tolist(), finite, strict=True):
        if not ok:
            out.append(-math.inf)
        elif r == 0.0:
            out.append(math.inf)
        else:
            out.append(20.0 * math.log10(p / r) if p > 0 else -math.inf)
    return out


@dataclass(frozen=True)
class PsnrSummary:
    """PSNR over a set of positions or sentences: the worst, the median and the mean (dB)."""

    count: int
    min_db: float
    median_db: float
    mean_db: float

    def to_json(self) -> dict[str, object]:
        """JSON-ready data (infinities as strings)."""
        return {k: clean_json(v) for k, v in vars(self).items()} | {
            "definition": "20 log10(max|z_ref| / RMS(z - z_ref)) per output vector, dB"
        }


def summarize_psnr(values: list[float]) -> PsnrSummary:
    """The summary of ``values`` (NaN figures when there are none)."""
    if not values:
        return PsnrSummary(0, math.nan, math.nan, math.nan)
    ordered = sorted(values)
    # The mean skips identical outputs (+inf); a non-finite output (-inf) makes it -inf.
    finite = [v for v in ordered if math.isfinite(v)]
    if ordered[0] == -math.inf:
        mean = -math.inf
    else:
        mean = sum(finite) / len(finite) if finite else math.inf
    return PsnrSummary(len(ordered), ordered[0], statistics.median(ordered), mean)


@dataclass
class Compared(ABC):
    """One implementation against one baseline: the PSNR of each compared vector (dB) and
    whether every compared value was finite. A kind subclasses it with its own figures."""

    psnr: list[float]
    finite: bool

    @property
    def psnr_summary(self) -> PsnrSummary:
        """PSNR over the compared vectors."""
        return summarize_psnr(self.psnr)

    @abstractmethod
    def figures(self) -> dict[str, Any]:
        """The kind's own figures, in JSON order."""

    @abstractmethod
    def row(self) -> str:
        """The kind's row of the report's level table."""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready figures: the kind's, then the PSNR."""
        figures = {k: clean_json(v) for k, v in self.figures().items()}
        return figures | {"psnr_db": self.psnr_summary.to_json()}


C = TypeVar("C", bound=Compared)  # a kind's comparison


@dataclass
class VariantLevel:
    """One implementation of a variant against both baselines."""

    implementation: str
    description: str
    vs_original: Compared
    vs_fp16: Compared


@dataclass
class VariantParity(Gated):
    """Every level of one variant, its gates and the verdict."""

    levels: list[VariantLevel]
    gates: list[GateResult]
    mil_fp32_rel_error: float
    notes: list[str] = field(default_factory=list)
    # compress.acceptance's report section (measured, not gated), when the recipe asks for it
    acceptance: dict[str, Any] | None = None


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


class VariantKind(ABC, Generic[C]):
    """The measurement core of every model kind's variants. A kind (a dataclass subclass with
    ``module``, ``held_out``, ``mil_fp32_threshold`` and ``fp16`` fields) fills in the
    adapter methods below; measuring, gating and reporting are written here once."""

    module: Any
    held_out: HeldOutSlice
    mil_fp32_threshold: float
    # The fp16 artifact's own outputs at each level, computed once for all variants.
    fp16: dict[str, Outputs]
    output: ClassVar[str]  # what the fp32 check compares: "logits" (per position) or "output"
    fp32_steps: ClassVar[int]  # progress steps of `program_check`
    table_head: ClassVar[str]  # the level table's header
    psnr_text: ClassVar[str]  # what the PSNR is of, in words

    # ---- the kind's adapter ----------------------------------------------------------------

    @property
    @abstractmethod
    def descriptions(self) -> dict[str, str]:
        """What runs at each of `LEVELS`."""

    @property
    @abstractmethod
    def baseline_steps(self) -> int:
        """Progress steps of `baselines` (one level's outputs)."""

    @abstractmethod
    def run(self, implementation: str, program: Any, decoded: dict[str, np.ndarray],
            advance: Advance, changes: Changes | None) -> Outputs:  # fmt: skip
        """The outputs of torch holding ``decoded`` or of ``program`` (MIL fp16)."""

    @abstractmethod
    def compare(self, got: Outputs, baseline: Outputs | None) -> C:
        """``got`` against ``baseline`` (None: the original checkpoint)."""

    @abstractmethod
    def scores(self, compared: C, gates: Any) -> list[Score]:
        """A level's figures against the original, gated by the variant's ``gates``."""

    @abstractmethod
    def program_check(self, program: Any, decoded: dict[str, np.ndarray],
                      changes: Changes | None) -> tuple[float, list[Score]]:  # fmt: skip
        """The program in fp32 against the same weights: its relative error and figures.
        The last use of ``decoded``: a kind may empty it once compared (GBs at full size)."""

    def details(self, levels: list[VariantLevel]) -> list[str]:
        """parity.txt lines after the level table (none unless a kind has some)."""
        return []

    # ---- the core ------------------------------------------------------------------------

    @property
    def parity_steps(self) -> int:
        """Progress steps of `parity`."""
        return self.baseline_steps + self.fp32_steps

    def baselines(self, program: Any, advance: Advance) -> None:
        """The fp16 artifact's outputs at every level (``program``: the fp16 program)."""
        self.fp16 = {level: self.run(level, program, {}, advance, None) for level in LEVELS}

    def measure(self, gates: Any, program: Any, decoded: dict[str, np.ndarray], advance: Advance,
                changes: Changes | None = None) -> VariantParity:  # fmt: skip
        """Every level of the variant against the original checkpoint (gated by ``gates``)
        and the fp16 artifact's outputs (reported), then the program in fp32 (which may
        empty ``decoded``: its last use)."""
        levels, scores = [], []
        for implementation in LEVELS:
            got = self.run(implementation, program, decoded, advance, changes)
            vs_original = self.compare(got, None)
            vs_fp16 = self.compare(got, self.fp16[implementation])
            del got
            # Each level frees its copy of the model, and the comparisons their scratch, before
            # the next level makes one: at Qwen2.5-0.5B size each is GBs (bench compress.py
            # methods).
            release_memory()
            describe = self.descriptions[implementation]
            levels.append(VariantLevel(implementation, describe, vs_original, vs_fp16))
            scores.append((implementation, self.scores(vs_original, gates)))
        error, checked = self.program_check(program, decoded, changes)
        release_memory()
        for _ in range(self.fp32_steps):
            advance()
        results = [
            gate("compression", s.name).check(
                s.value, s.threshold, implementation=implementation, where=s.where, detail=s.detail
            )
            for implementation, figures in [*scores, ("mil-fp32", checked)]
            for s in figures
        ]
        notes = list(changes.notes) if changes is not None else []
        return VariantParity(levels, results, error, notes)

    def report(self, result: VariantParity) -> tuple[dict[str, Any], str]:
        """The variant's parity.json content and its parity.txt section."""
        about, line = self.held_out.about()
        doc = {
            "passed": result.passed,
            "gates": [g.to_json() for g in result.gates],
            "levels": [
                {
                    "implementation": level.implementation,
                    "description": level.description,
                    "finite": level.vs_original.finite,
                    "against_original": level.vs_original.to_json(),
                    "against_fp16_artifact": level.vs_fp16.to_json(),
                }
                for level in result.levels
            ],
            f"mil_fp32_{self.output}_rel_error": clean_json(result.mil_fp32_rel_error),
            "notes": result.notes,
        } | ({"acceptance": result.acceptance} if result.acceptance is not None else {})
        return doc | {"held_out": about}, line + "\n" + self._text(result)

    def _text(self, result: VariantParity) -> str:
        """A readable summary: gates, then each level against both baselines, then the kind's
        details."""
        lines = ["Variant gates (fixed in the recipe; against the original checkpoint):"]
        lines += [gate_line(g) for g in result.gates]
        lines += ["", self.table_head]
        for level in result.levels:
            for label, c in (("original", level.vs_original), ("fp16 artifact", level.vs_fp16)):
                lines.append(f"{level.implementation:<11} {label:<15} {c.row()}")
        lines.append(self.psnr_text)
        lines.append(f"mil-fp32 {self.output} relative error: {result.mil_fp32_rel_error:.3g}")
        return "\n".join(lines + self.details(result.levels) + result.notes)


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
