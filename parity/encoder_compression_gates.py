"""Quality of a compressed encoder variant, at torch and MIL level, and its own gates.

The encoder counterpart of ``parity.compression_gates``. Every figure is measured on the
recipe's held-out sentences (``compression.held_out``, not the conversion fixtures), right-
padded in the artifact's (B, L) batches, against two baselines:

* the original checkpoint (transformers, fp32, each sentence alone): the function the
  artifact promises - gated: min cosine of the task output (per sentence for a sentence
  embedding or logits, per real token for hidden states) and, for a classifier, argmax
  agreement;
* the fp16 artifact (the uncompressed module in fp16 at torch level, the fp16 program at MIL
  level): what compression alone costs - reported.

Levels: ``torch-fp16`` - the BC1L encoder holding the variant's decoded weights (coremltools'
own decompression) with the fp16 epsilon floors, cast to fp16; ``mil-fp16`` - the emitted
variant program in anec's MIL evaluator (fp16 storage profile); ``mil-fp32`` - the program in
fp32 against the uncompressed program holding the same decoded weights: compression lives in
the weights alone, so nothing else may differ. (Against torch the fp16 conversion's own gates
already hold the program; this level isolates what compression changed.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
from parity.gate import GateResult, gate, worst_of
from parity.model_copies import with_weights
from parity.result import OUTPUT, Runner, rel_error
from parity.variant import Compared, VariantLevel, evaluator_weights

SentenceOutputs = dict[str, torch.Tensor]  # held-out sentence -> its task output (real part), fp32


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


def outputs(runner: Runner, module: BC1LEncoder, held_out: EncoderHeldOut) -> SentenceOutputs:
    """Each held-out sentence's task output (its real positions) from ``runner``."""
    out: SentenceOutputs = {}
    for batch in held_out.batches:
        result = runner(batch)[1][OUTPUT]
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            out[fixture.name] = real_part(result, module.io.output, r, n).float()
    return out


def fp16_runner(module: BC1LEncoder, weights: dict[str, np.ndarray] | None = None) -> Runner:
    """The torch fp16 level: ``module`` (with ``weights`` when given) as the fp16 program
    stores it - epsilon floors, every value fp16."""
    return encoder_runner(fp16_module(with_weights(module, weights or {})), torch.float16)


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


def compare(candidate: SentenceOutputs, baseline: dict[str, Any], logits: bool) -> Compared:
    """Cosines (and argmax agreement for logits) of ``candidate`` against ``baseline`` outputs
    (tensors or `EncoderReference`)."""
    cos, kept, finite, psnr = {}, {}, True, []
    for name, got in candidate.items():
        ref = baseline[name]
        want = (ref.output if isinstance(ref, EncoderReference) else ref).double()
        ok = bool(torch.isfinite(got).all())
        finite &= ok
        cos[name] = float(cosines(got, want).min()) if ok else float("-inf")
        g, w = (got.double()[None], want[None]) if got.dim() == 1 else (got.double(), want)
        psnr.append(min(psnr_db(g, w)))  # per output vector (a token's for hidden states)
        if logits:
            kept[name] = ok and int(got.argmax()) == int(want.argmax())
    return Compared(psnr, finite, cosine=cos, argmax_kept=kept)


def encoder_gates(
    levels: list[VariantLevel],
    min_cosine: float,
    min_top1: float | None,
    mil_fp32_error: float,
    mil_fp32_threshold: float,
    decode_mismatches: int,
    what: str,
) -> list[GateResult]:
    """The variant's own gates: each level against the original checkpoint, then the program
    in fp32 against torch with the same weights, and the two decoders of its weights."""
    gates = []
    for level in levels:
        s, impl = level.vs_original, level.implementation
        worst = worst_of(((cosine, sentence) for sentence, cosine in s.cosine.items()), True)
        gates.append(
            gate("compression", "min_cosine").check(
                s.min_cosine if s.cosine else math.nan, min_cosine, implementation=impl,
                where=worst.where,
                detail=f"per {what}, {len(s.cosine)} held-out sentences, against the original "
                f"checkpoint; mean {s.mean_cosine:.6f}",
            )
        )  # fmt: skip
        agreement = s.argmax_agreement
        if agreement is not None and min_top1 is not None:
            gates.append(
                gate("compression", "min_top1_agreement").check(
                    agreement, min_top1, implementation=impl,
                    detail="predicted label of each held-out sentence, against the original "
                    "checkpoint",
                )
            )  # fmt: skip
        gates.append(
            gate("compression", "finite_outputs").check(float(s.finite), implementation=impl)
        )
    gates.append(
        gate("compression", "mil_fp32_layer_rel_error").check(
            mil_fp32_error, mil_fp32_threshold, implementation="mil-fp32", where="task output",
            detail="the variant program against the uncompressed program holding the same "
            "decoded weights, both MIL fp32: compression is in the weights only",
        )
    )  # fmt: skip
    gates.append(
        gate("compression", "weights_decoded_alike").check(
            float(decode_mismatches), implementation="mil-fp32",
            detail="compressed weights whose MIL-evaluator decoding, rounded to fp16, differs "
            "from coremltools' own decoding",
        )
    )  # fmt: skip
    return gates


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
