"""What a decoder's variants are compared on: logits on the held-out slice (``parity/
compression_gates``), top-1 agreement and mean KL against the original checkpoint.

`DecoderSubject` is the decoder side of `emit.emit`: the BC1L decoder, its host-side
embedding table and the held-out slice with the original model's logits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from converter.compression.corpus import slice_fixtures
from converter.compression.methods.base import Inspected, Scheme, VariantFields
from converter.compression.sites import WeightSite
from parity.compression_gates import DecoderKind, HeldOut
from parity.conversion import input_dtypes, program_feed
from parity.fixtures import Fixture, make_batches
from parity.model_copies import with_weights
from parity.reference import run_reference
from parity.variant import VariantParity

if TYPE_CHECKING:
    from converter.compression.calibrate import Stages


def prepare_held_out(
    texts: Any,
    tokenizer: Any,
    model: torch.nn.Module,
    length: int,
    vocab_size: int,
    mil_positions: int | str,
    pad_id: int,
    calibration: Any = None,
) -> HeldOut:
    """Tokenize the held-out texts (a list, or a ``recipe.compression.Corpus`` cut here), run the
    original model on each, and cut MIL windows (``mil_positions`` "all": each whole text)."""
    fixtures, where = slice_fixtures(texts, "held_out", tokenizer, length, vocab_size, True)
    cal, _ = slice_fixtures(calibration or [], "calibration", tokenizer, length, vocab_size, True)
    references = {f.name: run_reference(model, f.token_ids) for f in fixtures}
    windows, source = [], {}
    for f in fixtures:
        n = len(f.token_ids)
        if mil_positions == "all":
            windows.append(f)
            source[f.name] = (f.name, n - 1)
            continue
        assert isinstance(mil_positions, int)
        for p in range(max(0, n - mil_positions), n):
            name = f"{f.name}@{p}"
            windows.append(Fixture(name, f.token_ids[: p + 1], "padded"))
            source[name] = (f.name, p)
    every = mil_positions == "all"
    return HeldOut(fixtures, references, pad_id, cal, where, windows, source, every)


@dataclass
class DecoderSubject(DecoderKind):
    """A decoder and its held-out slice, measured by `DecoderKind`; ``mil_fp32_threshold``
    gates the program in fp32 against torch with the same decoded weights."""

    task: str = "text-generation"
    # head_ids.npy: a trimmed head's ids (draft_vocabulary), copied where the artifact has it
    host_files: tuple[str, ...] = ("embeddings.npy", "tokenizer.json", "head_ids.npy")
    not_compressed: str = (
        "activations, norms' parameters, RoPE tables, masks and the host-side embedding table "
        "stay as in the fp16 artifact"
    )
    # compression.acceptance (a `config.AcceptanceSpec`): each variant's speculative acceptance
    acceptance: Any = None

    @property
    def parity_steps(self) -> int:
        """Progress steps of `parity`: the levels', then the acceptance depths'."""
        depths = len(self.acceptance.depths) if self.acceptance is not None else 0
        return super().parity_steps + depths

    def calibration_stages(self) -> Stages:
        """The decoder's stages on the calibration texts, one left-padded batch."""
        from converter.compression.calibrate import decoder_stages

        h = self.held_out
        return decoder_stages(self.module, h.calibration, self.embed_table, h.pad_id)

    def calibration_feeds(self, evaluator: Any) -> list[dict[str, Any]]:
        """The program's inputs for the calibration text, in (B, L) batches."""
        io, held_out = self.module.io, self.held_out
        batches = make_batches(held_out.calibration, io.batch, io.length, held_out.pad_id)
        dtypes = input_dtypes(evaluator)
        return [program_feed(dtypes, self.module, b, self.embed_table)[0] for b in batches]

    def search(
        self, variant: VariantFields, chosen: list[WeightSite], advance: Callable[[], None]
    ) -> tuple[dict[str, Scheme], dict[str, Any]]:
        """The mixed-bit plan of ``converter.compression.search`` and its report."""
        from converter.compression.search import search_plan

        return search_plan(
            self.module, chosen, variant.search, self.held_out.calibration, self.held_out.fixtures,
            self.embed_table, self.held_out.pad_id, log=logging.getLogger("anec.compress").info,
            advance=advance,
        )  # fmt: skip

    def parity(
        self,
        variant: Any,
        program: Any,
        decoded: dict[str, np.ndarray],
        advance: Callable[[], None],
        inspected: Inspected | None,
    ) -> VariantParity:
        """The variant's acceptance when the recipe asks (first: the levels empty
        ``decoded``), then its levels and gates (`DecoderKind`)."""
        wrap = inspected.wrap if inspected is not None else None
        acceptance = self._acceptance(decoded, wrap, advance)
        result = self.measure(variant.gates, program, decoded, advance, inspected)
        result.acceptance = acceptance
        return result

    def _acceptance(
        self, decoded: dict[str, np.ndarray], wrap: Any, advance: Callable[[], None]
    ) -> dict[str, Any] | None:
        """The variant's acceptance as a draft for the fp16 model, when the recipe asks."""
        spec = self.acceptance
        if spec is None:
            return None
        from converter.compression.calibrate import fp16_copy
        from converter.compression.variant_acceptance import (
            AcceptanceSetup,
            acceptance_json,
            draft_acceptance,
        )

        long_enough = [
            f.token_ids for f in self.held_out.fixtures if len(f.token_ids) >= spec.prompt_tokens
        ]
        if len(long_enough) < spec.prompts:
            from converter.errors import InputError

            raise InputError(
                f"compression.acceptance.prompts: {spec.prompts} prompts of {spec.prompt_tokens} "
                f"tokens asked, the held-out slice has {len(long_enough)} texts that long"
            )
        prompts = [list(ids[: spec.prompt_tokens]) for ids in long_enough[: spec.prompts]]
        setup = AcceptanceSetup(list(spec.depths), prompts, spec.new_tokens)
        draft = fp16_copy(with_weights(self.module, decoded))
        target = fp16_copy(self.module)
        with wrap(draft) if wrap is not None else contextlib.nullcontext():
            rows = draft_acceptance(draft, target, self.embed_table, setup, advance)
        return acceptance_json(rows, setup)

    def report(self, parity: VariantParity) -> tuple[dict[str, Any], str]:
        """The variant's parity.json content and its parity.txt section, with the acceptance."""
        doc, text = super().report(parity)
        if parity.acceptance is not None:
            from converter.compression.variant_acceptance import acceptance_text

            text += "\n" + acceptance_text(parity.acceptance)
        return doc, text
