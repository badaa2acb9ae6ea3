"""Parity gates for a BC1L decoder against the original transformers model (SPEC section 4).

Two implementations are checked against the reference, the checkpoint run by transformers in
fp32 on each fixture without padding:

* ``torch-fp32``: the BC1L module in fp32 - the rewrite itself, gated per layer and on logits;
* ``torch-fp16``: the same module cast to fp16 and run by torch on the CPU - storage and
  arithmetic in fp16 between ops, as the emitted fp16 program stores them. Gated on argmax
  agreement, max |dp|, finiteness and bitwise determinism; the argmax certificate and the
  per-layer max |h| are reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.masks import key_mask_from_padding
from parity.fixtures import Batch, Fixture
from parity.gate import GateResult, Worst, first_few, gate
from parity.model_copies import cast_copy
from parity.reference import ReferenceRun
from parity.result import FixtureRow, LayerRow, ParityReport, Thresholds, first_diverging, rel_error


def module_inputs(
    module: BC1LDecoder, batch: Batch, embed_table: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's inputs for a batch: ids or host-gathered embedding rows, and the key mask."""
    key_mask = key_mask_from_padding(batch.attention_mask).to(dtype)
    if module.io.inputs == "token-ids":
        return batch.input_ids, key_mask
    return embed_table[batch.input_ids].to(dtype), key_mask


def run_module(
    module: BC1LDecoder, x: torch.Tensor, key_mask: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer states (B, D, 1, L) and logits at every position (B, V, 1, L)."""
    with torch.no_grad():
        states = module.run_layers(x, key_mask)
        logits = torch.cat(module.head(states[-1]), dim=1)
    return states, logits


@dataclass
class _Tally:
    """What the torch levels measured over every batch, for the gates."""

    finite: bool = True
    deterministic: bool = True
    agree: int = 0
    total: int = 0
    worst_layer: Worst = field(default_factory=lambda: Worst(0.0))
    worst_logits: Worst = field(default_factory=lambda: Worst(0.0))
    worst_dprob: Worst = field(default_factory=lambda: Worst(0.0))
    flipped: list[str] = field(default_factory=list)  # fixtures where the fp16 argmax moved

    def gates(self, thresholds: Thresholds) -> list[GateResult]:
        """The torch-fp32 and torch-fp16 gates on what was measured."""
        agreement = self.agree / self.total if self.total else math.nan
        return [
            gate("torch-fp32", "fp32_layer_rel_error").check(
                self.worst_layer.value,
                thresholds.fp32_layer_rel_error,
                where=self.worst_layer.where,
                detail="max over layers and fixtures of ||h'-h||/||h|| at real positions",
            ),
            gate("torch-fp32", "fp32_logits_rel_error").check(
                self.worst_logits.value,
                thresholds.fp32_logits_rel_error,
                where=self.worst_logits.where,
            ),
            gate("torch-fp16", "fp16_argmax_agreement").check(
                agreement,
                thresholds.fp16_argmax_agreement,
                where=first_few(self.flipped),
                detail=f"{self.agree}/{self.total} real positions",
            ),
            gate("torch-fp16", "fp16_max_abs_dprob").check(
                self.worst_dprob.value,
                thresholds.fp16_max_abs_dprob,
                where=self.worst_dprob.where,
                detail="softmax at T=1 over the whole vocabulary, real positions",
            ),
            gate("torch-fp16", "finite_outputs").check(
                float(self.finite), detail="every layer and logit, padded positions included"
            ),
            gate("torch-fp16", "deterministic").check(
                float(self.deterministic), detail="two runs, identical bits"
            ),
        ]


def check_decoder(
    module: BC1LDecoder,
    batches: list[Batch],
    references: dict[str, ReferenceRun],
    embed_table: torch.Tensor,
    thresholds: Thresholds,
    progress: Callable[[], None] = lambda: None,
) -> ParityReport:
    """Run every gate of SPEC section 4 for a decoder; ``progress`` is called per batch."""
    n_layers = len(module.layers)
    layers = [LayerRow(i) for i in range(n_layers)]
    rows: list[FixtureRow] = []
    fp16 = cast_copy(module, torch.float16)
    t = _Tally()
    length = module.io.length
    stream_scale = module.spec.stream_scale

    for batch in batches:
        x32, m32 = module_inputs(module, batch, embed_table, torch.float32)
        x16, m16 = module_inputs(fp16, batch, embed_table, torch.float16)
        states32, logits32 = run_module(module, x32, m32)
        states16, logits16 = run_module(fp16, x16, m16)
        again16, again_logits16 = run_module(fp16, x16, m16)
        t.deterministic &= torch.equal(logits16, again_logits16) and all(
            torch.equal(a, b) for a, b in zip(states16, again16, strict=True)
        )
        t.finite &= bool(torch.isfinite(logits16).all()) and all(
            bool(torch.isfinite(s).all()) for s in states16
        )
        for i in range(n_layers):
            layers[i].fp16_max_abs = max(
                layers[i].fp16_max_abs, float(states16[i].float().abs().max())
            )

        for r, fixture in enumerate(batch.fixtures):
            ref = references[fixture.name]
            n = len(fixture.token_ids)
            real = slice(length - n, length)
            for i in range(n_layers):
                ref_h = ref.hidden[i]
                # The module carries the stream times its (power-of-two) stream scale.
                h32 = states32[i][r, :, 0, real].T / stream_scale
                h16 = states16[i][r, :, 0, real].T.float() / stream_scale
                row = layers[i]
                err32 = rel_error(h32, ref_h)
                t.worst_layer.see(err32, f"layer {i}, {fixture.name}")
                row.fp32_rel_error = max(row.fp32_rel_error, err32)
                row.fp16_rel_error = max(row.fp16_rel_error, rel_error(h16, ref_h))
                row.fp32_max_abs = max(row.fp32_max_abs, float(h32.abs().max()))
            fixture_row = _fixture_row(
                fixture, ref, logits32[r, :, 0, real].T, logits16[r, :, 0, real].T.float()
            )
            rows.append(fixture_row)
            kept = round(fixture_row.fp16_argmax_agreement * n)
            t.agree += kept
            t.total += n
            if kept < n:
                t.flipped.append(fixture.name)
            t.worst_logits.see(fixture_row.fp32_logits_rel_error, fixture.name)
            t.worst_dprob.see(fixture_row.fp16_max_abs_dprob, fixture.name)
        progress()

    return ParityReport(
        gates=t.gates(thresholds),
        layers=layers,
        fixtures=rows,
        first_diverging_layer=first_diverging(layers, thresholds),
        implementations={
            "reference": "transformers, fp32, each fixture unpadded at positions 0..n-1",
            "torch-fp32": "anec BC1L module, torch fp32 on the CPU, left-padded window",
            "torch-fp16": "anec BC1L module cast to fp16, torch on the CPU "
            "(fp16 storage between ops)",
        },
    )


def _fixture_row(
    fixture: Fixture, ref: ReferenceRun, logits32: torch.Tensor, logits16: torch.Tensor
) -> FixtureRow:
    top2 = ref.logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    delta = (logits16 - ref.logits).abs().max(dim=-1).values
    dprob = (logits16.softmax(-1) - ref.logits.softmax(-1)).abs().max()
    finite = bool(torch.isfinite(logits16).all())
    return FixtureRow(
        name=fixture.name,
        slice=fixture.slice,
        tokens=len(fixture.token_ids),
        fp32_logits_rel_error=rel_error(logits32, ref.logits),
        fp16_argmax_agreement=float((logits16.argmax(-1) == ref.logits.argmax(-1)).float().mean()),
        fp16_max_abs_dprob=float(dprob) if finite else float("inf"),
        fp16_max_logit_error=float(delta.max()) if finite else float("inf"),
        certified_positions=int((margin > 2 * delta).sum()) if finite else 0,
    )
