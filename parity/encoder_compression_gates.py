"""A compressed encoder variant's `VariantKind` (``parity.variant``): the task output per
held-out sentence (``compression.held_out``), right-padded in the artifact's (B, L) batches;
the original runs each sentence alone. Gated: min cosine of the task output (per sentence
embedding or logits, per real token for hidden states) and, for a classifier, argmax agreement.

``torch-fp16`` has the fp16 epsilon floors; ``mil-fp32`` is the program against the
uncompressed program holding the same decoded weights (against torch the fp16 conversion's own
gates already hold the program; this level isolates what compression changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from graph_passes.encoder import BC1LEncoder
from parity.compression_metrics import psnr_db
from parity.encoder_gates import (
    EncoderReference,
    cosines,
    encoder_runner,
    fp16_module,
    real_part,
)
from parity.encoder_mil import OUTPUT_NAMES, encoder_feed, pieces_runner
from parity.fixtures import Batch, Fixture
from parity.gate import worst_of
from parity.model_copies import with_weights
from parity.result import OUTPUT, Runner, rel_error
from parity.torch_settings import TORCH_CPU
from parity.variant import Compared, Score, decoded_alike, evaluator_weights

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
class EncoderHeldOut:
    """The held-out sentences, their (B, L) batches and the original model's outputs; and the
    calibration sentences (read by calibrated methods only, never scored)."""

    fixtures: list[Fixture]
    batches: list[Batch]
    references: dict[str, EncoderReference]
    source: str = "the recipe's own texts"
    calibration: list[Fixture] = field(default_factory=list)
    pad_id: int = 0


def outputs(runner: Runner, module: BC1LEncoder, held_out: EncoderHeldOut,
            advance: Callable[[], None] = lambda: None) -> SentenceOutputs:  # fmt: skip
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


def compare_outputs(candidate: SentenceOutputs, baseline: dict[str, Any], logits: bool
                    ) -> Compared:  # fmt: skip
    """Cosines (and argmax agreement for logits) of ``candidate`` against ``baseline`` outputs
    (tensors or `EncoderReference`)."""
    cos, kept, finite, psnr = {}, {}, True, []
    for name, got in candidate.items():
        ref = baseline[name]
        want = (ref.output if isinstance(ref, EncoderReference) else ref).double()
        ok = bool(torch.isfinite(got).all())
        finite &= ok
        cos[name] = float(cosines(got, want).min()) if ok else float("-inf")
        psnr.append(min(psnr_db(got, want)))  # per output vector (a token's for hidden states)
        if logits:
            kept[name] = ok and int(got.argmax()) == int(want.argmax())
    return Compared(psnr, finite, cosine=cos, argmax_kept=kept)


@dataclass
class EncoderKind:
    """The encoder side of `parity.variant.variant_parity`: the task output per held-out
    sentence; ``fp16_program`` is the uncompressed program the fp32 check compares with."""

    module: BC1LEncoder
    held_out: EncoderHeldOut
    threshold: float  # gates.mil_fp32_layer_rel_error
    fp16_program: Any = None
    output: str = "output"
    fp32_steps: int = FP32_BATCHES

    descriptions: ClassVar[dict[str, str]] = {
        "torch-fp16": "the BC1L encoder with the variant's decoded weights and the fp16 epsilon "
        "floors, cast to fp16, " + TORCH_CPU + "; right-padded (B, L) batches",
        "mil-fp16": "the emitted variant program in anec's MIL evaluator, fp16 storage profile",
    }

    def run(self, implementation: str, program: Any, decoded: dict[str, np.ndarray],
            advance: Callable[[], None]) -> SentenceOutputs:  # fmt: skip
        """Each held-out sentence's task output from torch or the program (MIL fp16)."""
        from parity.mil import Evaluator

        module, held_out = self.module, self.held_out
        if implementation == "torch-fp16":
            # as the fp16 program stores it: epsilon floors, every value fp16
            half = fp16_module(with_weights(module, decoded))
            return outputs(encoder_runner(half, torch.float16), module, held_out)
        run = program_runner(Evaluator(program, "fp16"), module)
        return outputs(run, module, held_out, advance)

    def compare(self, got: SentenceOutputs, baseline: SentenceOutputs | None) -> Compared:
        """Each sentence of ``got`` against the original checkpoint's or ``baseline``."""
        base = self.held_out.references if baseline is None else baseline
        return compare_outputs(got, base, self.module.io.output == "logits")

    def scores(self, compared: Compared, gates: Any) -> list[Score]:
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
                               "held-out sentence, against the original checkpoint"))  # fmt: skip
        return found + [Score("finite_outputs", float(c.finite))]

    def program_check(self, program: Any, decoded: dict[str, np.ndarray]
                      ) -> tuple[float, list[Score]]:  # fmt: skip
        """The program against the uncompressed one holding the same decoded weights."""
        batches = self.held_out.batches[:FP32_BATCHES]
        error, mismatched = mil_fp32_against_program(
            program, self.fp16_program, self.module, decoded, batches
        )
        check = Score(
            "mil_fp32_layer_rel_error",
            error,
            self.threshold,
            "task output",
            "the variant program against the uncompressed program holding the same "
            "decoded weights, both MIL fp32: compression is in the weights only",
        )
        return error, [check, decoded_alike(mismatched)]


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


def mil_fp32_against_program(
    program: Any,
    fp16_program: Any,
    module: BC1LEncoder,
    decoded: dict[str, np.ndarray],
    batches: list[Batch],
) -> tuple[float, int]:
    """The variant program against the uncompressed program holding the same decoded weights,
    both in the MIL evaluator's fp32 profile: the worst relative error of the task output over
    ``batches`` (compression is in the weights only, so 0 up to rounding); and the weights the
    evaluator and coremltools decode differently."""
    from parity.mil import Evaluator

    evaluator = Evaluator(program, "fp32")
    weights, mismatched = evaluator_weights(evaluator, decoded)
    base = with_constants(Evaluator(fp16_program, "fp32"), weights)
    got, want = program_runner(evaluator, module), program_runner(base, module)
    worst = 0.0
    for batch in batches:
        worst = max(
            worst, rel_error(got(batch)[1][OUTPUT].double(), want(batch)[1][OUTPUT].double())
        )
    return worst, len(mismatched)
