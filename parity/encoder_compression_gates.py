"""A compressed encoder variant's `VariantKind` (``parity.variant``): the task output per
held-out sentence (``compression.held_out``), right-padded in the artifact's (B, L) batches;
the original runs each sentence alone. Gated: min cosine of the task output (per sentence
embedding or logits, per real token for hidden states) and, for a classifier, argmax agreement.

``torch-fp16`` has the fp16 epsilon floors; ``mil-fp32`` is the program against the
uncompressed program holding the same decoded weights (against torch the fp16 conversion's own
gates already hold the program; this level isolates what compression changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from graph_passes.encoder import BC1LEncoder
from parity.encoder_gates import cosines, encoder_runner, fp16_module, real_part
from parity.encoder_mil import OUTPUT_NAMES, encoder_feed, pieces_runner
from parity.fixtures import Batch
from parity.gate_registry import Worst, agreement, worst_of
from parity.measure import decision_kept, label_probabilities, max_abs
from parity.mil_fp32 import Fp32Check, Pair
from parity.model_copies import with_weights
from parity.result import OUTPUT, Runner
from parity.torch_settings import TORCH_CPU
from parity.variant import (
    Advance,
    Changes,
    Compared,
    HeldOutSlice,
    Outputs,
    Score,
    VariantKind,
    VariantLevel,
    decoded_alike,
    evaluator_weights,
    psnr_db,
)

SentenceOutputs = dict[str, torch.Tensor]  # held-out sentence -> its task output (real part), fp32
# Batches the fp32 consistency check runs (the program against the same decoded weights).
FP32_BATCHES = 1
# What one cosine is of, by task output (a gate's detail).
_PER = {
    "sentence-embedding": "sentence embedding",
    "last-hidden-state": "real token (min over each sentence's tokens)",
    "logits": "sentence's logits",
}


@dataclass
class EncoderHeldOut(HeldOutSlice):
    """An encoder's held-out sentences and their (B, L) batches, right-padded."""

    batches: list[Batch]

    def about(self) -> tuple[dict[str, Any], str]:
        """The held-out sentences."""
        line = f"held-out slice: {self.source}; {len(self.fixtures)} sentences"
        return {"source": self.source, "sentences": len(self.fixtures)}, line


def outputs(runner: Runner, module: BC1LEncoder, held_out: EncoderHeldOut,
            advance: Advance = lambda: None) -> SentenceOutputs:  # fmt: skip
    """Each held-out sentence's task output (its real positions) from ``runner`` (``advance``
    after each batch)."""
    out: SentenceOutputs = {}
    for batch in held_out.batches:
        result = runner(batch)[1][OUTPUT]
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            out[fixture.name] = real_part(result, module.io.output, r, n).float()
        advance()
    return out


def program_runner(evaluator: Any, module: BC1LEncoder) -> Runner:
    """The emitted single program run by the MIL evaluator, as a `Runner`."""

    def feed(batch: Batch) -> dict[str, np.ndarray]:
        feeds, _ = encoder_feed(module, None, batch, "float32")  # the evaluator rounds them
        missing = set(evaluator.inputs) - set(feeds)
        if missing:
            raise ValueError(f"the program has inputs {sorted(missing)} a single encoder lacks")
        return feeds

    return pieces_runner({"main": evaluator}, feed, None, {OUTPUT: OUTPUT_NAMES[module.io.output]})


# ---- comparisons ------------------------------------------------------------------------------


@dataclass
class SentencesCompared(Compared):
    """An encoder's comparison: each sentence's cosine (min over real tokens for hidden states)
    and, for a classifier, whether its predicted label is kept."""

    cosine: dict[str, float] = field(default_factory=dict)
    argmax_kept: dict[str, bool] = field(default_factory=dict)  # classifiers only
    dprob: dict[str, float] = field(default_factory=dict)  # classifiers: max |p' - p|

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

    @property
    def max_abs_dprob(self) -> Worst:
        """The worst sentence's largest probability change, and which (classifiers only)."""
        return worst_of((d, sentence) for sentence, d in self.dprob.items())

    def figures(self) -> dict[str, Any]:
        """The cosine figures (a classifier's: and its largest |dp|), then every sentence's
        cosine."""
        found = {
            "min_cosine": self.min_cosine,
            "mean_cosine": self.mean_cosine,
            "argmax_agreement": self.argmax_agreement,
            "finite": self.finite,
            "cosine": self.cosine,
        }
        if self.dprob:
            found["max_abs_dprob"] = self.max_abs_dprob.value
        return found

    def row(self) -> str:
        """Sentences, min and mean cosine, argmax agreement and the PSNR."""
        agree = "" if self.argmax_agreement is None else f"{self.argmax_agreement:.1%}"
        p = self.psnr_summary
        return (
            f"{len(self.cosine):>9}  {self.min_cosine:>9.6f}  {self.mean_cosine:>9.6f}  "
            f"{agree:>6}  {p.min_db:6.1f} / {p.median_db:6.1f}"
        )


@dataclass
class EncoderKind(VariantKind[SentencesCompared]):
    """The encoder kind of `parity.variant.VariantKind`: the task output per held-out
    sentence; ``fp16_program`` (kept by `baselines`) is the uncompressed program the fp32
    check compares with."""

    module: BC1LEncoder
    held_out: EncoderHeldOut
    mil_fp32_threshold: float  # gates.mil_fp32_layer_rel_error
    fp16: dict[str, Outputs] = field(default_factory=dict)
    fp16_program: Any = None
    output: ClassVar[str] = "output"
    fp32_steps: ClassVar[int] = FP32_BATCHES
    table_head: ClassVar[str] = (
        "level       against         sentences  min cos     mean cos   argmax  PSNR dB min / median"
    )
    psnr_text: ClassVar[str] = "PSNR: 20 log10(max|y_ref| / RMS(y - y_ref)) over each output vector"
    descriptions: ClassVar[dict[str, str]] = {
        "torch-fp16": "the BC1L encoder with the variant's decoded weights and the fp16 epsilon "
        "floors, cast to fp16, " + TORCH_CPU + "; right-padded (B, L) batches",
        "mil-fp16": "the emitted variant program in anec's MIL evaluator, fp16 storage profile",
    }

    @property
    def baseline_steps(self) -> int:
        """One step per (B, L) batch."""
        return len(self.held_out.batches)

    def baselines(self, program: Any, advance: Advance) -> None:
        """The fp16 artifact's outputs, keeping its program for the fp32 check."""
        super().baselines(program, advance)
        self.fp16_program = program

    def run(self, implementation: str, program: Any, decoded: dict[str, np.ndarray],
            advance: Advance, changes: Changes | None) -> SentenceOutputs:  # fmt: skip
        """Each held-out sentence's task output from torch or the program (MIL fp16)."""
        from parity.mil import Evaluator

        module, held_out = self.module, self.held_out
        if implementation == "torch-fp16":
            # as the fp16 program stores it: epsilon floors, every value fp16
            half = fp16_module(with_weights(module, decoded))
            return outputs(encoder_runner(half, torch.float16), module, held_out)
        run = program_runner(Evaluator(program, "fp16"), module)
        return outputs(run, module, held_out, advance)

    def compare(self, got: SentenceOutputs, baseline: SentenceOutputs | None
                ) -> SentencesCompared:  # fmt: skip
        """Cosines (and argmax agreement for logits) of each sentence of ``got`` against the
        original checkpoint's outputs (``baseline`` None) or ``baseline``."""
        logits = self.module.io.output == "logits"
        cos, kept, dprob, finite, psnr = {}, {}, {}, True, []
        for name, output in got.items():
            ref = self.held_out.references[name].output if baseline is None else baseline[name]
            want = ref.double()
            ok = bool(torch.isfinite(output).all())
            finite &= ok
            cos[name] = float(cosines(output, want).min()) if ok else float("-inf")
            psnr.append(min(psnr_db(output, want)))  # per output vector (a token's: hidden states)
            if logits:
                kept[name] = ok and decision_kept(output, want)
                dprob[name] = max_abs(label_probabilities(output.double()),
                                      label_probabilities(want), ok)  # fmt: skip
        return SentencesCompared(psnr, finite, cosine=cos, argmax_kept=kept, dprob=dprob)

    def scores(self, compared: SentencesCompared, gates: Any) -> list[Score]:
        """Min cosine, argmax agreement (a classifier, when the variant sets it), finiteness."""
        c = compared
        worst = worst_of(((cosine, sentence) for sentence, cosine in c.cosine.items()), True)
        found = [
            Score("min_cosine", c.min_cosine, gates.min_cosine, worst.where,
                  f"per {_PER[self.module.io.output]}, {len(c.cosine)} held-out sentences, "
                  f"against the original checkpoint; mean {c.mean_cosine:.6f}"),
        ]  # fmt: skip
        if c.argmax_agreement is not None and gates.min_top1_agreement is not None:
            found.append(Score("min_top1_agreement", c.argmax_agreement,
                               gates.min_top1_agreement, detail="predicted label of each "
                               "held-out sentence (one label: the score's sign), against the "
                               "original checkpoint"))  # fmt: skip
        if c.dprob and gates.max_abs_dprob is not None:
            found.append(Score("max_abs_dprob", c.max_abs_dprob.value, gates.max_abs_dprob,
                               c.max_abs_dprob.where, "softmax over the labels (one label: "
                               "its sigmoid), held-out sentences"))  # fmt: skip
        return found + [Score("finite_outputs", float(c.finite))]

    def program_check(self, program: Any, decoded: dict[str, np.ndarray],
                      changes: Changes | None) -> tuple[float, list[Score]]:  # fmt: skip
        """The program against the uncompressed one holding the same decoded weights."""
        batches = self.held_out.batches[:FP32_BATCHES]
        error, mismatched = mil_fp32_against_program(
            program, self.fp16_program, self.module, decoded, batches
        )
        check = Score(
            "mil_fp32_layer_rel_error",
            error,
            self.mil_fp32_threshold,
            "task output",
            "the variant program against the uncompressed program holding the same "
            "decoded weights, both MIL fp32: compression is in the weights only",
        )
        return error, [check, decoded_alike(mismatched)]

    def details(self, levels: list[VariantLevel]) -> list[str]:
        """Each sentence's cosine at each level."""
        names = [level.implementation for level in levels]
        compared = [level.vs_original for level in levels]
        per_level = [c.cosine for c in compared if isinstance(c, SentencesCompared)]
        lines = ["", "sentence        " + "".join(f"{n + ' cos':>18}" for n in names)]
        for sentence in per_level[0] if per_level else []:
            cells = "".join(f"{cosine[sentence]:>18.6f}" for cosine in per_level)
            lines.append(f"{sentence:<16}{cells}")
        return lines


# ---- the program in fp32 ----------------------------------------------------------------------


def with_constants(evaluator: Any, weights: dict[str, np.ndarray]) -> Any:
    """``evaluator`` (of an uncompressed program) with the weight constant of each torch name
    in ``weights`` replaced by the given values (fp32): the constant named after the traced
    parameter, ``<mangled>_to_fp16`` or ``<mangled>``."""
    constants: dict[str, Any] = evaluator._constants  # the values every run starts from
    for name, value in weights.items():
        mangled = name.replace(".", "_")
        const = next((c for c in (mangled + "_to_fp16", mangled) if c in constants), None)
        if const is None:
            raise KeyError(f"{name}: no constant {mangled}_to_fp16 in the uncompressed program")
        held = np.asarray(constants[const])
        if held.shape != value.shape:
            raise ValueError(f"{name}: the program holds {held.shape}, the variant {value.shape}")
        constants[const] = np.asarray(value, np.float32)
    return evaluator


def mil_fp32_against_program(program: Any, fp16_program: Any, module: BC1LEncoder,
                             decoded: dict[str, np.ndarray], batches: list[Batch]
                             ) -> tuple[float, int]:  # fmt: skip
    """The variant program against the uncompressed program holding the same decoded weights,
    both in the MIL evaluator's fp32 profile: the worst relative error of the task output over
    ``batches`` (compression is in the weights only, so 0 up to rounding); and the weights the
    evaluator and coremltools decode differently."""
    from parity.mil import Evaluator

    evaluator = Evaluator(program, "fp32")
    weights, mismatched = evaluator_weights(evaluator, decoded)
    base = with_constants(Evaluator(fp16_program, "fp32"), weights)
    got, want = program_runner(evaluator, module), program_runner(base, module)
    check = Fp32Check([])
    for batch in batches:
        check.see(Pair(got(batch)[1][OUTPUT], want(batch)[1][OUTPUT], "task output"))
    return check.output.value, len(mismatched)
