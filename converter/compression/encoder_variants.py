"""Compressed variants of an encoder artifact (BERT, ModernBERT): what they are compared on.

`EncoderSubject` is the encoder side of `emit.emit`: the BC1L encoder and the held-out
sentences with the original model's task outputs (``parity.encoder_compression_gates``); a
variant is gated on the cosine of its task output (sentence embedding, hidden states or
logits) against the original checkpoint, and on argmax agreement for a classifier, at torch
and MIL level. `emit_encoder_variants` is what an encoder conversion with a ``compression:``
section calls once its fp16 artifact is published; `prepare_encoder_held_out` runs the
original model on the held-out sentences and must be called while the model is loaded.

``gptq`` calibrates on the recipe's calibration sentences (``calibration_stages``); methods
that need a decoder (``w8a8`` calibration feeds, the ``mixed`` search, ``skm``'s next-token
loss) are refused for encoder tasks by the recipe schema (each method's ``tasks``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from converter.compression.corpus import slice_fixtures
from converter.compression.emit import emit
from converter.compression.methods.base import Inspected, Scheme, VariantFields
from converter.compression.sites import WeightSite
from converter.compression.variant_steps import VariantResult
from converter.errors import InputError
from converter.pipeline.progress import Steps
from converter.recipe.compression_section import Compression
from graph_passes.encoder import BC1LEncoder
from parity.encoder_compression_gates import EncoderHeldOut, EncoderKind
from parity.encoder_gates import run_encoder_reference
from parity.fixtures import make_batches
from parity.variant import VariantParity

if TYPE_CHECKING:
    from converter.compression.calibrate import Stages

__all__ = ["EncoderSubject", "emit_encoder_variants", "prepare_encoder_held_out"]


def prepare_encoder_held_out(
    texts: Any,
    tokenizer: Any,
    model: torch.nn.Module,
    module: BC1LEncoder,
    pad_id: int,
    calibration: Any = None,
) -> EncoderHeldOut:
    """Tokenize the held-out texts (a list, or a ``recipe.compression.Corpus`` cut here) and run
    the original model on each, alone and unpadded; tokenize the calibration sentences (a
    list, or the corpus's other part: disjoint from the held-out one by construction)."""
    io, vocab = module.io, module.spec.embedding.vocab_size
    types = module.spec.embedding.type_vocab_size
    fixtures, where = slice_fixtures(texts, "held_out", tokenizer, io.length, vocab, False, types)
    cal, _ = slice_fixtures(calibration or [], "calibration", tokenizer, io.length, vocab, False,
                            types)  # fmt: skip
    references = {f.name: run_encoder_reference(model, f, io.output) for f in fixtures}
    batches = make_batches(fixtures, io.batch, io.length, pad_id, right=True)
    return EncoderHeldOut(fixtures, references, pad_id, cal, where, batches)


@dataclass
class EncoderSubject(EncoderKind):
    """An encoder and its held-out sentences, measured by `EncoderKind`;
    ``mil_fp32_threshold`` gates the program in fp32 against the uncompressed program
    holding the same decoded weights."""

    task: str = "sentence-similarity"
    host_files: tuple[str, ...] = ("tokenizer.json",)
    not_compressed: str = (
        "activations, embedding tables, norms' parameters, biases and masks stay as in the "
        "fp16 artifact"
    )

    def parity(
        self,
        variant: Any,
        program: Any,
        decoded: dict[str, np.ndarray],
        advance: Callable[[], None],
        inspected: Inspected | None,
    ) -> VariantParity:
        """The variant's levels and gates (`EncoderKind`): weights only."""
        if inspected is not None:
            raise InputError(f"{variant.method}: changes beyond weights are not implemented for "
                             "encoders")  # fmt: skip
        return self.measure(variant.gates, program, decoded, advance)

    def calibration_stages(self) -> Stages:
        """The encoder's stages on the calibration sentences, in the program's batches."""
        from converter.compression.calibrate import encoder_stages

        return encoder_stages(self.module, self.held_out.calibration, self.held_out.pad_id)

    def calibration_feeds(self, evaluator: Any) -> list[dict[str, Any]]:
        """Not implemented for encoders (the recipe schema refuses w8a8 for them)."""
        raise InputError("int8 activations (w8a8) are implemented for text-generation only")

    def search(
        self, variant: VariantFields, chosen: list[WeightSite], advance: Callable[[], None]
    ) -> tuple[dict[str, Scheme], dict[str, Any]]:
        """Not implemented for encoders (the recipe schema refuses mixed for them)."""
        raise InputError("the mixed-bit search is implemented for text-generation only")


def emit_encoder_variants(
    compression: Compression,
    name: str,
    fp16_dir: Path,
    module: BC1LEncoder,
    held_out: EncoderHeldOut,
    out_dir: Path,
    mil_fp32_threshold: float,
    task: str,
    force: bool = False,
    steps: Steps | None = None,
) -> list[VariantResult]:
    """Build, measure and publish every variant of an encoder's single-program artifact
    ``fp16_dir`` (``<name>.mlpackage``), in recipe order; a failing variant blocks only
    itself (its reports stay in ``OUT/<name>-<suffix>.failed/``)."""
    if not (fp16_dir / f"{name}.mlpackage").is_dir():
        raise InputError(
            "compression: variants of a partitioned encoder (encoder.partition: "
            "host-embedding) are not implemented; use partition: single"
        )
    subject = EncoderSubject(module, held_out, mil_fp32_threshold, task=task)
    return emit(compression, name, fp16_dir, subject, out_dir, force, steps)
