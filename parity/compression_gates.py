"""A compressed decoder variant's `VariantKind` (``parity.variant``): logits per held-out text.

``torch-fp16`` scores every real position of each held-out text; ``mil-fp16`` with
``mil_positions: all`` the program's all-positions copy (`all_positions`: the
same weights, the last-position slice removed) on every real position of each text, one
evaluation per text, with a number n the emitted program on each text's last n prefixes;
``mil-fp32`` is the program against the torch module with the same decoded weights. Per
position: top-1 agreement, KL, |dp| (``parity.metrics``) and the PSNR of the full logit vector.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.logits_layout import join_logits
from graph_passes.markers import MarkerError, find_markers
from parity.conversion import input_dtypes, program_feed
from parity.decoder_gates import module_inputs, run_module
from parity.fixtures import Fixture, make_batches
from parity.gate_registry import first_few
from parity.head_outputs import run_capturing_logits
from parity.memory import release_memory
from parity.metrics import PositionRow, Summary, compare_positions, summarize
from parity.mil_fp32 import Fp32Check, Pair
from parity.model_copies import float64_program_copy, in_float64, with_weights
from parity.torch_settings import TORCH_CPU
from parity.variant import (
    Advance,
    Changes,
    Compared,
    HeldOutSlice,
    Outputs,
    Score,
    VariantKind,
    Wrap,
    decoded_alike,
    evaluator_weights,
    psnr_db,
)

Logits = dict[str, torch.Tensor]  # fixture or window name -> (positions, V) fp32
# Windows the fp32 consistency check runs (the program against torch with the same weights).
FP32_WINDOWS = 2


@dataclass
class HeldOut(HeldOutSlice):
    """A decoder's held-out slice: whole texts (torch level) and the windows the program
    scores (MIL level), each window's text and last position."""

    windows: list[Fixture]
    window_source: dict[str, tuple[str, int]]  # window -> (text fixture, its last position)
    all_positions: bool = False  # MIL level through the all-positions program, a window a text

    def about(self) -> tuple[dict[str, Any], str]:
        """The texts, their scored positions (every real token of every text, per level) and
        what the MIL level evaluates."""
        texts, positions = len(self.fixtures), sum(len(f.token_ids) for f in self.fixtures)
        mil = "every position (all-positions program)" if self.all_positions else "windows"
        about = {"source": self.source, "texts": texts, "positions": positions, "mil": mil}
        line = f"held-out slice: {self.source}; {texts} texts, {positions} positions"
        return about, line + " scored at torch level"


def torch_logits(module: BC1LDecoder, decoded: dict[str, np.ndarray], held_out: HeldOut,
                 embed_table: torch.Tensor, wrap: Wrap | None = None) -> Logits:  # fmt: skip
    """Logits at every real position of each held-out text, ``module`` holding ``decoded`` run
    in fp16 (inside ``wrap(module)`` when given, e.g. activation fake-quantization hooks)."""
    run = with_weights(module, decoded, torch.float16)
    length = module.io.length
    (batch,) = make_batches(held_out.fixtures, len(held_out.fixtures), length, held_out.pad_id)
    x, mask = module_inputs(run, batch, embed_table, torch.float16)
    with wrap(run) if wrap is not None else contextlib.nullcontext():
        _, logits = run_module(run, x, mask)
    return {
        f.name: logits[r, :, 0, length - len(f.token_ids) :].T.float()
        for r, f in enumerate(batch.fixtures)
    }


def mil_logits(evaluator: Any, module: BC1LDecoder, held_out: HeldOut, embed_table: torch.Tensor,
               windows: list[Fixture] | None = None, progress: Advance = lambda: None
               ) -> Logits:  # fmt: skip
    """The program's logits on each window (one evaluation per batch): every real position the
    program returns (the last one, or all of them for an all-positions program)."""
    windows = held_out.windows if windows is None else windows
    runs = _window_runs(evaluator, module, held_out, embed_table, windows, [], progress)
    return {name: logits for name, _, logits in runs}


def _window_runs(evaluator: Any, module: BC1LDecoder, held_out: HeldOut,
                 embed_table: torch.Tensor, windows: list[Fixture], markers: list[str],
                 progress: Advance = lambda: None,
                 ) -> Iterator[tuple[str, list[np.ndarray], torch.Tensor]]:  # fmt: skip
    """Per window: its name, its outputs (D, real positions) at ``markers`` and the logits the
    program returns for it (its real positions, the last n of them)."""
    length = module.io.length
    for batch in make_batches(windows, module.io.batch, length, held_out.pad_id):
        feed, _, _ = program_feed(input_dtypes(evaluator), module, batch, embed_table)
        # an argmax / top-k program: its own logits, captured before the selection
        result = run_capturing_logits(evaluator, feed, markers)
        logits = join_logits(result.outputs)  # (B, n, V)
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            m = min(logits.shape[1], n)  # left-padded: real ones last
            layers = [np.asarray(result.captured[k][r, :, 0, length - n :]) for k in markers]
            yield fixture.name, layers, torch.from_numpy(np.ascontiguousarray(logits[r, -m:]))
        progress()


@dataclass
class PositionsCompared(Compared):
    """A decoder's comparison: one row per compared position (top-1, KL, |dp|)."""

    rows: list[PositionRow] = field(default_factory=list)

    @property
    def summary(self) -> Summary:
        """Aggregates over the compared positions."""
        return summarize(self.rows)

    def figures(self) -> dict[str, Any]:
        """The position summary, its uncertified list counted."""
        s = self.summary
        data = {k: v for k, v in vars(s).items() if k != "uncertified"}
        return data | {"uncertified_count": len(s.uncertified)}

    def row(self) -> str:
        """Positions, top-1, mean and max KL, max |dp| and the PSNR."""
        s, p = self.summary, self.psnr_summary
        return (
            f"{s.positions:>9}  {s.argmax_agreement:>6.1%}  {s.mean_kl:>8.4f}  {s.max_kl:>7.3f}  "
            f"{s.max_abs_dprob:>7.4f}  {p.min_db:6.1f} / {p.median_db:6.1f} / {p.mean_db:6.1f}"
        )


@dataclass
class DecoderKind(VariantKind[PositionsCompared]):
    """The decoder kind of `parity.variant.VariantKind`: logits per held-out position; a
    method's changes beyond weights (int8 activations: ``compress.methods.base.Inspected``)
    wrap the torch module and have their quantizers checked."""

    module: BC1LDecoder
    embed_table: torch.Tensor
    held_out: HeldOut
    mil_fp32_threshold: float  # gates.mil_fp32_layer_rel_error
    fp16: dict[str, Outputs] = field(default_factory=dict)
    output: ClassVar[str] = "logits"
    fp32_steps: ClassVar[int] = FP32_WINDOWS
    table_head: ClassVar[str] = (
        "level       against         positions  top-1    mean KL   max KL  max|dp|  "
        "PSNR dB min / median / mean"
    )
    psnr_text: ClassVar[str] = (
        "PSNR: 20 log10(max|z_ref| / RMS(z - z_ref)) over each position's full logit vector"
    )

    @property
    def descriptions(self) -> dict[str, str]:
        """What runs at each level."""
        mil = (
            "its all-positions copy (the same weight constants, the last-position slice "
            "removed): every real position of each held-out text, one evaluation per text"
            if self.held_out.all_positions
            else "the last position of each held-out prefix window"
        )
        return {
            "torch-fp16": "the BC1L module with the variant's decoded weights, cast to fp16, "
            f"{TORCH_CPU}; every real position of each held-out text",
            "mil-fp16": f"the emitted variant program in anec's MIL evaluator, fp16 storage "
            f"profile; {mil}",
        }

    @property
    def baseline_steps(self) -> int:
        """One step per MIL window."""
        return len(self.held_out.windows)

    def run(self, implementation: str, program: Any, decoded: dict[str, np.ndarray],
            advance: Advance, changes: Changes | None) -> Logits:  # fmt: skip
        """Logits of every held-out text (torch) or window (the program, MIL fp16)."""
        from parity.mil import Evaluator

        held_out, table = self.held_out, self.embed_table
        if implementation == "torch-fp16":
            wrap = changes.wrap if changes is not None else None
            return torch_logits(self.module, decoded, held_out, table, wrap)
        if held_out.all_positions:  # the program becomes its all-positions copy, in place
            all_positions(program)
        evaluator = Evaluator(program, "fp16")
        return mil_logits(evaluator, self.module, held_out, table, progress=advance)

    def compare(self, got: Logits, baseline: Logits | None) -> PositionsCompared:
        """Rows and PSNR for every position of every text (torch level) or MIL window of
        ``got``: against the reference (``baseline`` None) or ``baseline`` logits (the same
        texts or windows). Finite when every compared logit was."""
        rows: list[PositionRow] = []
        psnr: list[float] = []
        source, references = self.held_out.window_source, self.held_out.references
        for name, logits in got.items():
            # a whole text ends at its last position; a window as `prepare_held_out` cut it
            text, last = source.get(name, (name, logits.shape[0] - 1))
            first = last - logits.shape[0] + 1
            want = references[text].logits[first : last + 1] if baseline is None else baseline[name]
            positions = list(range(first, last + 1))
            rows += compare_positions(text, "held-out", last + 1, positions, logits, want)
            psnr += psnr_db(logits, want)
        return PositionsCompared(psnr, all(np.isfinite(r.logit_error) for r in rows), rows)

    def scores(self, compared: PositionsCompared, gates: Any) -> list[Score]:
        """Top-1 agreement, mean KL, finiteness and (when the variant sets it) max |dp|."""
        s = compared.summary
        # No held-out position measured: nothing is shown, so the value is NaN and fails.
        top1 = s.argmax_agreement if s.positions else math.nan
        kl = s.mean_kl if s.positions else math.nan
        found = [
            Score("min_top1_agreement", top1, gates.min_top1_agreement,
                  detail=f"{s.positions} held-out positions, against the original checkpoint"),
            Score("max_mean_kl", kl, gates.max_mean_kl,
                  detail="KL(p_original || p_variant), nats, mean over held-out positions"),
            Score("finite_outputs", float(compared.finite)),
        ]  # fmt: skip
        if gates.max_abs_dprob is not None:
            found.append(Score("max_abs_dprob", s.max_abs_dprob, gates.max_abs_dprob,
                               detail="softmax at T=1, held-out positions"))  # fmt: skip
        return found

    def program_check(self, program: Any, decoded: dict[str, np.ndarray],
                      changes: Changes | None) -> tuple[float, list[Score]]:  # fmt: skip
        """The program in fp32 against torch with the same weights (`mil_fp32_check`, which
        empties ``decoded``) and, with int8 activations, each quantizer on the program's own
        input: end-to-end agreement is then reported, each quantizer gated."""
        from parity.mil import Evaluator

        module, held_out, table = self.module, self.held_out, self.embed_table
        wrap = changes.wrap if changes is not None else None
        fp32, mismatched = mil_fp32_check(
            program, module, decoded, held_out, table, FP32_WINDOWS, wrap
        )
        error = fp32.overall.value
        if changes is None or changes.check is None:
            check = Score("mil_fp32_layer_rel_error", error, self.mil_fp32_threshold,
                          fp32.overall.where, "each layer's output and the logits of the variant "
                          "program in fp32 against the torch module with the same decoded "
                          "weights: compression is in the weights only")  # fmt: skip
        else:
            evaluator = Evaluator(program, "fp32")
            (batch,) = make_batches(held_out.windows[:1], 1, module.io.length, held_out.pad_id)
            feed, _, _ = program_feed(input_dtypes(evaluator), module, batch, table)
            check = Score("activation_quantizers_alike", float(changes.check(evaluator, feed)),
                          detail="int8 quantize/dequantize pairs whose torch fake-quantization of "
                          "the program's own input differs from the program's output in any "
                          "bit")  # fmt: skip
        return error, [check, decoded_alike(len(mismatched), first_few(mismatched))]


def mil_fp32_check(program: Any, module: BC1LDecoder, decoded: dict[str, np.ndarray],
                   held_out: HeldOut, embed_table: torch.Tensor, windows: int,
                   wrap: Wrap | None = None) -> tuple[Fp32Check, list[str]]:  # fmt: skip
    """The program in fp32 against torch in fp64 with the same weights, per layer (its layer
    markers) and on the logits, and decoder agreement.

    The fp32 profile keeps a decompressed weight in fp32 where the program declares fp16 (an
    int8 weight's ``scale * (q - z)``), so torch gets the evaluator's own decoded values;
    that these are coremltools' decoded weights up to fp16 rounding is counted separately:
    the second result names the weights whose evaluator decoding, rounded to fp16, differs
    from coremltools' decoding in any value, or that the evaluator did not decode (none
    expected). ``decoded`` is emptied once compared: the caller's last use of it.
    """
    from parity.mil import Evaluator

    evaluator = Evaluator(program, "fp32")
    # The evaluator decodes constexpr ops once, when it prepares the program; its own arrays
    # (fp16 where exact: a palette's values) are torch's weights below, widened in fp64.
    weights, mismatched = evaluator_weights(evaluator, decoded, widen=False)
    # decoded's last use (the caller's too): its fp16 arrays, 0.6 GiB at Qwen2.5-0.5B size,
    # go before the evaluator runs and the torch copy is made (bench/README.md).
    decoded.clear()
    release_memory()
    n_layers, length = len(module.layers), module.io.length
    lost = ""
    try:
        markers = find_markers(program.functions["main"], n_layers)
    except MarkerError as e:  # no layer to compare: each layer's error is inf
        markers, lost = [], f"layer markers lost: {e}"
    chosen = held_out.windows[:windows]
    runs = _window_runs(evaluator, module, held_out, embed_table, chosen, markers)
    got = {name: (layers, logits) for name, layers, logits in runs}
    # One more copy of the model, made only once the evaluator's other constants are freed,
    # holding the evaluator's decoded weights themselves, and fp64 one piece at a time: at
    # Qwen2.5-0.5B size a whole fp64 copy is 4 GB, the evaluator's constants 2 GB
    # (bench/README.md). A wrap scales tensors in place: those stay fp32, as fp16 could
    # overflow where fp32 does not.
    del evaluator
    release_memory()
    baseline = float64_program_copy(module, weights, others_in_fp16=wrap is None)
    del weights

    def pairs() -> Iterator[Pair]:
        for batch in make_batches(chosen, 1, length, held_out.pad_id):
            x, mask = module_inputs(baseline, batch, embed_table, torch.float32)
            # the program's inputs are fp16: feed torch the same rounded values; fp64 so
            # torch's own fp32 rounding does not count against the program
            with (
                in_float64(baseline),
                wrap(baseline) if wrap is not None else contextlib.nullcontext(),
            ):
                states, logits = run_module(baseline, x.half().double(), mask.half().double())
            fixture = batch.fixtures[0]
            layers, have = got[fixture.name]
            real = slice(length - len(fixture.token_ids), length)
            for i, layer in enumerate(layers):
                yield Pair(layer, states[i][0, :, 0, real].numpy(), f"{fixture.name}, layer {i}", i)
            want = logits[0, :, 0, logits.shape[-1] - have.shape[0] :].T
            yield Pair(have, want, f"{fixture.name}, logits")

    check = Fp32Check.of(n_layers, pairs(), layers_lost=bool(lost))
    check.overall.where = lost or check.overall.where
    return check, mismatched


# ---- the all-positions copy of a decoder program, for scoring a variant at MIL level ----------
# A draft program returns logits at its last ``n`` window positions only (``io.logits: last``):
# the last layer's output is cut by one ``slice_by_index`` on the position axis before the final
# norm and the LM head. Scoring 1,000 held-out positions through it would take 1,000
# evaluations, one per prefix. Instead the same program - the same constant and ``constexpr_*``
# ops, so byte-identical weights - has that one slice removed and every later op's output type
# re-inferred: one evaluation then scores every position of a window. Nothing else changes: the
# final norm and the LM head act per position, so each position's logits are the ones the
# emitted program computes when that position is the last.

POSITION_AXIS = 3  # BC1L: (batch, channels, 1, length)
# The logit outputs: (batch, positions, 1, V_k), the vocabulary last (graph_passes.logits_layout).
OUTPUT_POSITION_AXIS = 1


class NotALastPositionProgram(ValueError):
    """The program has no single position slice before its head."""


def position_slice(function: Any) -> Any | None:
    """The op cutting the last layer's output to the last window positions, or None when the
    function already returns every position. Raises when more than one op could be it."""
    found = []
    for op in function.operations:
        if op.op_type != "slice_by_index":
            continue
        x = op.inputs["x"]
        if x.rank != 4 or op.outputs[0].shape[POSITION_AXIS] == x.shape[POSITION_AXIS]:
            continue
        begin = np.asarray(op.inputs["begin"].val)
        if not np.all(begin[:POSITION_AXIS] == 0):
            continue
        if op.outputs[0].shape[:POSITION_AXIS] != x.shape[:POSITION_AXIS]:
            continue
        found.append(op)
    if len(found) > 1:
        names = ", ".join(op.name for op in found)
        raise NotALastPositionProgram(f"{len(found)} position slices ({names}); expected one")
    return found[0] if found else None


def all_positions(program: Any, function: str = "main") -> int:
    """Remove ``function``'s last-position slice in place and re-infer every later op's output
    type; returns how many positions the outputs now hold. Constants are not touched."""
    f = program.functions[function]
    op = position_slice(f)
    if op is None:
        return int(f.outputs[0].shape[OUTPUT_POSITION_AXIS])
    source, cut = op.inputs["x"], op.outputs[0]
    ops = list(f.operations)
    later = ops[ops.index(op) + 1 :]
    f.replace_uses_of_var_after_op(
        anchor_op=op, old_var=cut, new_var=source, no_check_var_types=True
    )
    f.remove_ops([op])
    with f:  # coremltools' type inference may build helper values inside the function
        for child in later:
            if child.op_type != "const":
                child.type_value_inference(overwrite_output=True)
    positions = {int(v.shape[OUTPUT_POSITION_AXIS]) for v in f.outputs}
    if positions != {int(source.shape[POSITION_AXIS])}:
        raise NotALastPositionProgram(f"outputs hold {sorted(positions)} positions after the cut")
    return positions.pop()
