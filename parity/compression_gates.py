"""Quality of a compressed decoder variant, at torch and MIL level, and its own gates.

Every figure is measured on the recipe's held-out text slice (never used for calibration or
sensitivity) against two baselines:

* the original checkpoint (transformers, fp32): the function the artifact promises - gated;
* the fp16 artifact (the uncompressed BC1L module at torch level, the fp16 program at MIL
  level): what compression alone costs - reported.

Levels: ``torch-fp16`` - the BC1L module holding the variant's decoded weights (coremltools'
own decompression), cast to fp16, every real position of each held-out text; ``mil-fp16`` - the
emitted variant program in anec's MIL evaluator (fp16 storage profile): with ``mil_positions:
all`` its all-positions copy (``parity.compression_positions``: the same weights, the last-
position slice removed) on every real position of each text, one evaluation per text; with a
number n, the emitted program as it is on each text's last n prefixes; ``mil-fp32`` - the
program in fp32 against the torch module with the same decoded weights in fp32: compression
lives in the weights alone, so only rounding may differ.

Per position: top-1 agreement, KL, |dp| (``parity.metrics``) and the logit PSNR in dB,
``20 log10(max|z_ref| / RMS(z - z_ref))`` over the full logit vector
(``parity.compression_metrics``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.logits_layout import join_logits
from parity.compression_metrics import psnr_db
from parity.conversion import input_dtypes, program_feed
from parity.decoder_gates import module_inputs, run_module
from parity.fixtures import Fixture, make_batches
from parity.gate import Gate, GateResult, first_few, gate
from parity.head_outputs import run_capturing_logits
from parity.memory import release_memory
from parity.metrics import PositionRow, compare_positions
from parity.model_copies import cast_copy, in_float64, program_constants, set_weights
from parity.reference import ReferenceRun
from parity.result import rel_error
from parity.variant import Compared, VariantLevel, evaluator_weights

Logits = dict[str, torch.Tensor]  # fixture or window name -> (positions, V) fp32
Wrap = Callable[[torch.nn.Module], contextlib.AbstractContextManager[Any]]


@dataclass
class HeldOut:
    """The held-out slice: whole texts (torch level) and prefix windows (MIL level)."""

    texts: list[Fixture]
    windows: list[Fixture]
    window_source: dict[str, tuple[str, int]]  # window -> (text fixture, its last position)
    references: dict[str, ReferenceRun]
    pad_id: int
    calibration: list[Fixture] = field(default_factory=list)  # sensitivity only, never scored
    all_positions: bool = False  # MIL level through the all-positions program, a window a text
    source: str = "the recipe's own texts"

    @property
    def positions(self) -> int:
        """Scored positions per level: every real token of every text."""
        return sum(len(f.token_ids) for f in self.texts)


def torch_logits(
    module: BC1LDecoder,
    held_out: HeldOut,
    embed_table: torch.Tensor,
    dtype: torch.dtype,
    wrap: Wrap | None = None,
) -> Logits:
    """Logits at every real position of each held-out text, the module run in ``dtype``
    (inside ``wrap(module)`` when given, e.g. activation fake-quantization hooks)."""
    run = module if next(module.parameters()).dtype == dtype else cast_copy(module, dtype)
    length = module.io.length
    out: Logits = {}
    (batch,) = make_batches(held_out.texts, len(held_out.texts), length, held_out.pad_id)
    x, mask = module_inputs(run, batch, embed_table, dtype)
    with wrap(run) if wrap is not None else contextlib.nullcontext():
        _, logits = run_module(run, x, mask)
    for r, fixture in enumerate(batch.fixtures):
        n = len(fixture.token_ids)
        out[fixture.name] = logits[r, :, 0, length - n :].T.float()
    return out


def mil_logits(
    evaluator: Any,
    module: BC1LDecoder,
    held_out: HeldOut,
    embed_table: torch.Tensor,
    windows: list[Fixture] | None = None,
    progress: Callable[[], None] = lambda: None,
) -> Logits:
    """The program's logits on each window (one evaluation per batch): every real position the
    program returns (the last one, or all of them for an all-positions program)."""
    windows = held_out.windows if windows is None else windows
    out: Logits = {}
    for batch in make_batches(windows, module.io.batch, module.io.length, held_out.pad_id):
        feed, _, _ = program_feed(input_dtypes(evaluator), module, batch, embed_table)
        # an argmax / top-k program: its own logits, captured before the selection
        logits = join_logits(run_capturing_logits(evaluator, feed).outputs)  # (B, n, V)
        for r, fixture in enumerate(batch.fixtures):
            m = min(logits.shape[1], len(fixture.token_ids))  # left-padded: real ones last
            out[fixture.name] = torch.from_numpy(np.ascontiguousarray(logits[r, -m:]))
        progress()
    return out


def _compared(rows: list[PositionRow], psnr: list[float]) -> Compared:
    """Finite when every compared logit was."""
    return Compared(psnr, all(np.isfinite(r.logit_error) for r in rows), rows)


def compare_torch(cand: Logits, base: Logits | dict[str, ReferenceRun]) -> Compared:
    """Rows and PSNR for every real position of every held-out text."""
    rows: list[PositionRow] = []
    psnr: list[float] = []
    for name, logits in cand.items():
        ref = base[name]
        want = ref.logits if isinstance(ref, ReferenceRun) else ref
        n = logits.shape[0]
        rows += compare_positions(name, "held-out", n, list(range(n)), logits, want)
        psnr += psnr_db(logits, want)
    return _compared(rows, psnr)


def compare_windows(cand: Logits, held_out: HeldOut, base: Logits | None) -> Compared:
    """Rows and PSNR for every position of every MIL window: against the reference (``base``
    None) or ``base`` logits (the same windows)."""
    rows: list[PositionRow] = []
    psnr: list[float] = []
    for name, logits in cand.items():
        text, last = held_out.window_source[name]
        first = last - logits.shape[0] + 1
        want = held_out.references[text].logits[first : last + 1] if base is None else base[name]
        positions = list(range(first, last + 1))
        rows += compare_positions(text, "held-out", last + 1, positions, logits, want)
        psnr += psnr_db(logits, want)
    return _compared(rows, psnr)


def decoder_gates(
    levels: list[VariantLevel],
    min_top1: float,
    max_mean_kl: float,
    max_abs_dprob: float | None,
    mil_fp32_error: float,
    mil_fp32_threshold: float,
    decode_mismatches: list[str],
    quantizer_mismatches: int | None = None,
) -> list[GateResult]:
    """The variant's own gates: each level against the original checkpoint.

    ``decode_mismatches`` names the weights whose decodings differ (the gate's ``where``).
    """
    gates = []
    for level in levels:
        s, impl = level.vs_original.summary, level.implementation
        # No held-out position measured: nothing is shown, so the value is NaN and fails.
        top1 = s.argmax_agreement if s.positions else math.nan
        kl = s.mean_kl if s.positions else math.nan
        gates += [
            _variant("min_top1_agreement").check(
                top1, min_top1, implementation=impl,
                detail=f"{s.positions} held-out positions, against the original checkpoint",
            ),
            _variant("max_mean_kl").check(
                kl, max_mean_kl, implementation=impl,
                detail="KL(p_original || p_variant), nats, mean over held-out positions",
            ),
            _variant("finite_outputs").check(float(level.finite), implementation=impl),
        ]  # fmt: skip
        if max_abs_dprob is not None:
            gates.append(
                _variant("max_abs_dprob").check(
                    s.max_abs_dprob, max_abs_dprob, implementation=impl,
                    detail="softmax at T=1, held-out positions",
                )
            )  # fmt: skip
    if quantizer_mismatches is None:
        gates.append(
            _variant("mil_fp32_layer_rel_error").check(
                mil_fp32_error,
                mil_fp32_threshold,
                implementation="mil-fp32",
                where="logits",
                detail="the variant program in fp32 against the torch module with the same "
                "decoded weights: compression is in the weights only",
            )
        )
    else:  # int8 activations: end-to-end agreement is reported, each quantizer is gated
        gates.append(
            _variant("activation_quantizers_alike").check(
                float(quantizer_mismatches),
                implementation="mil-fp32",
                detail="int8 quantize/dequantize pairs whose torch fake-quantization of the "
                "program's own input differs from the program's output in any bit",
            )
        )
    gates.append(
        _variant("weights_decoded_alike").check(
            float(len(decode_mismatches)),
            implementation="mil-fp32",
            where=first_few(decode_mismatches),
            detail="compressed weights whose MIL-evaluator decoding, rounded to fp16, differs "
            "from coremltools' own decoding",
        )
    )
    return gates


def _variant(name: str) -> Gate:
    return gate("compression", name)


def mil_fp32_check(
    program: Any,
    module: BC1LDecoder,
    decoded: dict[str, np.ndarray],
    held_out: HeldOut,
    embed_table: torch.Tensor,
    windows: int,
    wrap: Wrap | None = None,
) -> tuple[float, list[str]]:
    """The program in fp32 against torch fp32 with the same weights, and decoder agreement.

    The fp32 profile keeps a decompressed weight in fp32 where the program declares fp16 (an
    int8 weight's ``scale * (q - z)``), so torch gets the evaluator's own decoded values;
    that these are coremltools' decoded weights up to fp16 rounding is counted separately:
    the second result names the weights whose evaluator decoding, rounded to fp16, differs
    from coremltools' decoding in any value, or that the evaluator did not decode (none
    expected).
    """
    from parity.mil import Evaluator

    evaluator = Evaluator(program, "fp32")
    # The evaluator decodes constexpr ops once, when it prepares the program.
    weights, mismatched = evaluator_weights(evaluator, decoded)
    chosen = held_out.windows[:windows]
    got = mil_logits(evaluator, module, held_out, embed_table, chosen)  # feeds: fp32 inputs
    # One more copy of the model, made only once the evaluator's constants are freed, and
    # fp64 one piece at a time: at Qwen2.5-0.5B size a whole fp64 copy is 4 GB, the
    # evaluator's constants 2 GB (bench/README.md).
    del evaluator
    release_memory()
    baseline = set_weights(program_constants(module), weights)
    del weights
    worst = 0.0
    length = module.io.length
    for batch in make_batches(chosen, 1, length, held_out.pad_id):
        x, mask = module_inputs(baseline, batch, embed_table, torch.float32)
        # the program's inputs are fp16: feed torch the same rounded values; fp64 so torch's
        # own fp32 rounding does not count against the program
        with (
            in_float64(baseline),
            wrap(baseline) if wrap is not None else contextlib.nullcontext(),
        ):
            _, logits = run_module(baseline, x.half().double(), mask.half().double())
        have = got[batch.fixtures[0].name]
        want = logits[0, :, 0, logits.shape[-1] - have.shape[0] :].T
        worst = max(worst, rel_error(have, want))
    return worst, mismatched
