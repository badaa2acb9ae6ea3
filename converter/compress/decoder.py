"""What a decoder's variants are compared on: logits on the held-out slice (``parity/
compression_gates``), top-1 agreement and mean KL against the original checkpoint.

`DecoderSubject` is the decoder side of `emit.emit`: the BC1L decoder, its host-side
embedding table and the held-out slice with the original model's logits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from converter.compress.corpus import slice_fixtures
from converter.compress.methods.base import Inspected, Scheme, VariantFields
from converter.compress.sites import WeightSite
from graph_passes.decoder import BC1LDecoder
from parity.compression_gates import (
    HeldOut,
    Logits,
    compare_torch,
    compare_windows,
    decoder_gates,
    mil_fp32_check,
    mil_logits,
    torch_logits,
)
from parity.conversion import input_dtypes, program_feed
from parity.fixtures import Fixture, make_batches
from parity.memory import release_memory
from parity.model_copies import with_weights
from parity.reference import run_reference
from parity.variant import VariantLevel, VariantParity, parity_json, parity_text

if TYPE_CHECKING:
    from converter.compress.calibrate import Stages

# Windows the fp32 consistency check runs (the program against torch with the same weights).
FP32_WINDOWS = 2


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
    return HeldOut(fixtures, windows, source, references, pad_id, cal, every, where)


@dataclass
class DecoderSubject:
    """A decoder and its held-out slice; ``mil_fp32_threshold`` gates the program in fp32
    against torch with the same decoded weights."""

    module: BC1LDecoder
    embed_table: torch.Tensor
    held_out: HeldOut
    mil_fp32_threshold: float
    task: str = "text-generation"
    host_files: tuple[str, ...] = ("embeddings.npy", "tokenizer.json")
    not_compressed: str = (
        "activations, norms' parameters, RoPE tables, masks and the host-side embedding table "
        "stay as in the fp16 artifact"
    )
    # compression.acceptance (a `config.AcceptanceSpec`): each variant's speculative acceptance
    acceptance: Any = None
    # The fp16 artifact's own logits, computed once for all variants by `baselines`.
    torch_fp16: Logits = field(default_factory=dict)
    mil_fp16: Logits = field(default_factory=dict)

    @property
    def baseline_steps(self) -> int:
        """Progress steps of `baselines`."""
        return len(self.held_out.windows)

    @property
    def parity_steps(self) -> int:
        """Progress steps of `parity`."""
        depths = len(self.acceptance.depths) if self.acceptance is not None else 0
        return len(self.held_out.windows) + FP32_WINDOWS + depths

    def baselines(self, program: Any, advance: Callable[[], None]) -> None:
        """The fp16 artifact's logits: the torch module in fp16 and the program (MIL fp16)."""
        from parity.mil import Evaluator

        self._positions(program)
        self.torch_fp16 = torch_logits(self.module, self.held_out, self.embed_table, torch.float16)
        self.mil_fp16 = mil_logits(
            Evaluator(program, "fp16"), self.module, self.held_out, self.embed_table,
            progress=advance,
        )  # fmt: skip

    def calibration_stages(self) -> Stages:
        """The decoder's stages on the calibration texts, one left-padded batch."""
        from converter.compress.calibrate import decoder_stages

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
        """The mixed-bit plan of ``converter.compress.search`` and its report."""
        from converter.compress.search import search_plan

        return search_plan(
            self.module, chosen, variant.search, self.held_out.calibration, self.held_out.texts,
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
        """Torch fp16 and MIL fp16 logits of the variant against the original checkpoint (gated)
        and the fp16 artifact (reported), and the program in fp32 against torch."""
        from parity.mil import Evaluator

        self._positions(program)
        module, held_out, table = self.module, self.held_out, self.embed_table
        wrap = inspected.wrap if inspected is not None else None
        torch16 = torch_logits(
            with_weights(module, decoded, torch.float16), held_out, table, torch.float16, wrap
        )
        release_memory()
        torch_level = VariantLevel(
            "torch-fp16",
            "the BC1L module with the variant's decoded weights, cast to fp16, torch on the "
            "CPU; every real position of each held-out text",
            compare_torch(torch16, held_out.references),
            compare_torch(torch16, self.torch_fp16),
        )
        acceptance = self._acceptance(decoded, wrap, advance)
        # Each level frees its copy of the model before the next makes one: at Qwen2.5-0.5B
        # size each is GBs (bench compress.py methods).
        mil16 = mil_logits(Evaluator(program, "fp16"), module, held_out, table, progress=advance)
        release_memory()
        mil_level = VariantLevel(
            "mil-fp16",
            "the emitted variant program in anec's MIL evaluator, fp16 storage profile; "
            + (
                "its all-positions copy (the same weight constants, the last-position slice "
                "removed): every real position of each held-out text, one evaluation per text"
                if held_out.all_positions
                else "the last position of each held-out prefix window"
            ),
            compare_windows(mil16, held_out, None),
            compare_windows(mil16, held_out, self.mil_fp16),
        )
        fp32_error, mismatches = mil_fp32_check(
            program, module, decoded, held_out, table, FP32_WINDOWS, wrap
        )
        release_memory()
        for _ in range(FP32_WINDOWS):
            advance()
        g = variant.gates
        assert g.min_top1_agreement is not None and g.max_mean_kl is not None  # recipe rule
        levels = [torch_level, mil_level]
        quantizers = None
        notes: list[str] = []
        if inspected is not None and inspected.check is not None:
            evaluator = Evaluator(program, "fp32")
            (batch,) = make_batches(held_out.windows[:1], 1, module.io.length, held_out.pad_id)
            feed, _, _ = program_feed(input_dtypes(evaluator), module, batch, table)
            quantizers = inspected.check(evaluator, feed)
        if inspected is not None:
            notes += inspected.notes
        gates = decoder_gates(
            levels, g.min_top1_agreement, g.max_mean_kl, g.max_abs_dprob, fp32_error,
            self.mil_fp32_threshold, mismatches, quantizers,
        )  # fmt: skip
        return VariantParity(levels, gates, fp32_error, notes, acceptance)

    def _acceptance(
        self, decoded: dict[str, np.ndarray], wrap: Any, advance: Callable[[], None]
    ) -> dict[str, Any] | None:
        """The variant's acceptance as a draft for the fp16 model, when the recipe asks."""
        spec = self.acceptance
        if spec is None:
            return None
        from converter.compress.acceptance import (
            AcceptanceSetup,
            acceptance_json,
            draft_acceptance,
        )
        from converter.compress.calibrate import fp16_copy

        long_enough = [
            f.token_ids for f in self.held_out.texts if len(f.token_ids) >= spec.prompt_tokens
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

    def _positions(self, program: Any) -> None:
        """Make ``program`` its all-positions copy in place when the slice asks for it."""
        if self.held_out.all_positions:
            from parity.compression_positions import all_positions

            all_positions(program)

    def report(self, parity: VariantParity) -> tuple[dict[str, Any], str]:
        """The variant's parity.json content and its parity.txt section."""
        h = self.held_out
        about = {
            "source": h.source,
            "texts": len(h.texts),
            "positions": h.positions,
            "mil": "every position (all-positions program)" if h.all_positions else "windows",
        }
        line = (
            f"held-out slice: {h.source}; {len(h.texts)} texts, {h.positions} positions "
            "scored at torch level"
        )
        text = line + "\n" + parity_text(parity)
        if parity.acceptance is not None:
            from converter.compress.acceptance import acceptance_text

            text += "\n" + acceptance_text(parity.acceptance)
        return parity_json(parity) | {"held_out": about}, text
