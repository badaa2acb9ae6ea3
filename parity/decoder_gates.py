"""Parity gates for a BC1L decoder against the original transformers model (SPEC section 4).

Two implementations are checked against the reference, the checkpoint run by transformers in
fp32 on each fixture without padding:

* ``torch-fp32``: the BC1L module in fp32 - the rewrite itself, gated per layer and on logits;
* ``torch-fp16``: the same module cast to fp16 and run by torch on the CPU - storage and
  arithmetic in fp16 between ops, as the emitted fp16 program stores them. Gated on argmax
  agreement, max |dp|, finiteness and bitwise determinism; the argmax certificate and the
  per-layer max |h| are reported. It catches nothing the emitted program's own fp16 level
  does not (the program is what ships), so a conversion runs it on demand: when an fp16 gate
  of the program fails, to say whether the rewrite's fp16 arithmetic already fails or only
  the program does (``gates.torch_fp16: always`` runs it every time; `ON_DEMAND`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.masks import key_mask_from_padding
from parity.fixtures import Batch, Fixture
from parity.gate_registry import GateResult, first_few, gate, stability_gates, worst_of
from parity.measure import Measured, measure, worst_gate
from parity.model_copies import cast_copy
from parity.reference import ReferenceRun
from parity.result import (
    FixtureRow,
    LayerRow,
    Outputs,
    ParityReport,
    Runner,
    Thresholds,
    first_diverging,
    rel_error,
)
from parity.torch_settings import TORCH_CPU

ON_DEMAND = (
    "not run: on demand, when an fp16 gate of the emitted program fails (it judges the "
    "fp16 arithmetic of the program that ships; gates.torch_fp16: always runs this level too)"
)


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


# The decoder runner's one output: logits at every position (B, V, 1, L).
LOGITS = "logits"


def decoder_runner(module: BC1LDecoder, embed_table: torch.Tensor, dtype: torch.dtype) -> Runner:
    """Run the window module on a left-padded batch in ``dtype``: per-layer states and
    `LOGITS` (`run_module`)."""

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        states, logits = run_module(module, *module_inputs(module, batch, embed_table, dtype))
        return states, {LOGITS: logits}

    return run


def check_decoder(
    module: BC1LDecoder,
    batches: list[Batch],
    references: dict[str, ReferenceRun],
    embed_table: torch.Tensor,
    thresholds: Thresholds,
    progress: Callable[[], None] = lambda: None,
    fp16: bool = True,
) -> ParityReport:
    """Run every gate of SPEC section 4 for a decoder; ``progress`` is called per batch and
    level (twice per batch; once without ``fp16``, which leaves the torch-fp16 level out:
    its layer columns NaN, no fixture rows)."""
    length = module.io.length
    layers = [LayerRow(i) for i in range(len(module.layers))]
    logit_errors: list[float] = []  # torch fp32, per fixture in batch order
    named: list[tuple[float, str]] = []  # the same, with each fixture's name
    fixtures: list[FixtureRow] = []

    def rows(state: torch.Tensor, r: int, n: int) -> torch.Tensor:  # `StateRows`
        # The module carries the stream times its (power-of-two) stream scale.
        return state[r, :, 0, length - n : length].T.float() / module.spec.stream_scale

    def logits_of(fixture: Fixture, r: int, out: Outputs) -> torch.Tensor:
        return out[LOGITS][r, :, 0, length - len(fixture.token_ids) : length].T.float()

    def score32(fixture: Fixture, r: int, out: Outputs) -> list[torch.Tensor]:
        ref = references[fixture.name]
        logit_errors.append(rel_error(logits_of(fixture, r, out), ref.logits))
        named.append((logit_errors[-1], fixture.name))
        return ref.hidden

    def score16(fixture: Fixture, r: int, out: Outputs) -> list[torch.Tensor]:
        ref = references[fixture.name]
        error32 = logit_errors[len(fixtures)]
        fixtures.append(_fixture_row(fixture, ref, error32, logits_of(fixture, r, out)))
        return ref.hidden

    runner32 = decoder_runner(module, embed_table, torch.float32)
    m32 = measure(runner32, batches, score32, rows, layers, True, progress)
    implementations = {
        "reference": "transformers, fp32, each fixture unpadded at positions 0..n-1",
        "torch-fp32": "anec BC1L module, torch fp32 on the CPU, left-padded window",
        "torch-fp16": "anec BC1L module cast to fp16 (fp16 storage between ops), " + TORCH_CPU,
    }
    if not fp16:
        for row in layers:
            row.fp16_rel_error = row.fp16_max_abs = math.nan
        return ParityReport(
            gates=_gates(m32, None, fixtures, thresholds, named), layers=layers, fixtures=[],
            first_diverging_layer=first_diverging(layers, thresholds, fp16=False),
            implementations=implementations, torch_fp16=ON_DEMAND,
        )  # fmt: skip
    runner16 = decoder_runner(cast_copy(module, torch.float16), embed_table, torch.float16)
    m16 = measure(runner16, batches, score16, rows, layers, False, progress)
    return ParityReport(
        gates=_gates(m32, m16, fixtures, thresholds, named),
        layers=layers,
        fixtures=fixtures,
        first_diverging_layer=first_diverging(layers, thresholds),
        implementations=implementations,
    )


def _gates(m32: Measured, m16: Measured | None, rows: list[FixtureRow], thresholds: Thresholds,
           logit_errors: list[tuple[float, str]]) -> list[GateResult]:  # fmt: skip
    """The torch-fp32 and (``m16`` given) torch-fp16 gates on what the levels measured
    (``logit_errors``: torch fp32's per fixture, with its name)."""
    fp32 = [
        worst_gate("torch-fp32", "fp32_layer_rel_error", thresholds, m32.worst_layer,
                   detail="max over layers and fixtures of ||h'-h||/||h|| at real positions"),
        worst_gate("torch-fp32", "fp32_logits_rel_error", thresholds, worst_of(logit_errors)),
    ]  # fmt: skip
    if m16 is None:
        return fp32
    kept = [round(row.fp16_argmax_agreement * row.tokens) for row in rows]
    agree, total = sum(kept), sum(row.tokens for row in rows)
    flipped = [row.name for row, k in zip(rows, kept, strict=True) if k < row.tokens]
    dprob = worst_of((row.fp16_max_abs_dprob, row.name) for row in rows)
    return fp32 + [
        gate("torch-fp16", "fp16_argmax_agreement").check(
            agree / total if total else math.nan,
            thresholds.fp16_argmax_agreement,
            where=first_few(flipped),
            detail=f"{agree}/{total} real positions",
        ),
        worst_gate("torch-fp16", "fp16_max_abs_dprob", thresholds, dprob,
                   detail="softmax at T=1 over the whole vocabulary, real positions"),
        *stability_gates("torch-fp16", "torch-fp16", m16.finite, m16.deterministic,
                         "every layer and logit, padded positions included"),
    ]  # fmt: skip


def _fixture_row(
    fixture: Fixture, ref: ReferenceRun, fp32_logits_rel_error: float, logits16: torch.Tensor
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
        fp32_logits_rel_error=fp32_logits_rel_error,
        fp16_argmax_agreement=float((logits16.argmax(-1) == ref.logits.argmax(-1)).float().mean()),
        fp16_max_abs_dprob=float(dprob) if finite else float("inf"),
        fp16_max_logit_error=float(delta.max()) if finite else float("inf"),
        certified_positions=int((margin > 2 * delta).sum()) if finite else 0,
    )
