"""The window decoder's MIL fp32 subject: its baseline, the BC1L module with the program's
constants computed in float64 one piece at a time, and the `Pair`s of the fp32 profile's run
against it (`parity.mil_fp32`). `parity.conversion` runs the profiles."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.logits_layout import join_logits
from parity.fixtures import Batch
from parity.mil import Evaluation
from parity.mil_fp32 import Fp32Check, Pair
from parity.model_copies import program_constants
from parity.profile_run import ProfileRun

# What mil-fp32 is compared with: the same function, computed more exactly than fp32.
MODULE_BASELINE = (
    "the BC1L torch module with the program's constants (fp16-rounded when the program "
    "stores fp16), run in fp64 on the same inputs"
)


def _program_constant(precision: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A module constant as the program stores it (fp16-rounded when it stores fp16), in
    float64."""
    if precision == "float16":
        return lambda t: t.half().double()
    return lambda t: t.double()


def fp64_piece(part: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A float64 copy of ``part`` holding the values the program stores (``precision``: the
    program's, "float16" or "float32")."""
    return program_constants(part, precision).double()


def fp64_baseline(
    module: BC1LDecoder, precision: str, inputs: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """The BC1L module's function with the program's constants, computed in float64.

    For each (x, key_mask): the per-layer states (B, D, 1, L) and the logits (B, V, 1, n) at
    the last n window positions. In fp32, torch's own rounding reached 1.1e-5 relative at
    SmolLM2's last layer (measured against fp64), which would be charged to the program.
    Built one layer (one LM-head chunk) at a time, so at most one piece exists in fp64:
    a whole fp64 copy would need 8 bytes a parameter.
    """
    n = module.io.logit_positions
    with torch.no_grad():
        embed = fp64_piece(module.embed, precision) if module.embed is not None else None
        hs, masks = [], []
        for x, key_mask in inputs:
            x = embed(x) if embed is not None else x.double()
            hs.append(x.transpose(1, 2).unsqueeze(2))  # as BC1LDecoder.embed_bc1l
            # Each layer's own mask (a local layer's window), as the program stores it.
            masks.append(module.layer_masks(key_mask.double(), _program_constant(precision)))
        del embed
        states: list[list[torch.Tensor]] = [[] for _ in inputs]
        for i, layer in enumerate(module.decoder_layers()):
            piece = fp64_piece(layer, precision)
            for b in range(len(inputs)):
                hs[b] = piece(hs[b], masks[b][i])
                states[b].append(hs[b])
        last = [h[:, :, :, module.io.length - n :] for h in hs]
        logits = fp64_head(module, last, lambda part: fp64_piece(part, precision))
    return list(zip(states, logits, strict=True))


def fp64_head(
    module: BC1LDecoder, hs: list[torch.Tensor], piece: Callable[[torch.nn.Module], Any]
) -> list[torch.Tensor]:
    """The head as `BC1LDecoder.forward` computes it on each stream (1 or B, D, 1, n) of
    ``hs``: the final norm, then each LM-head chunk's conv, one fp64 ``piece`` of ``module``
    at a time; the logits (1 or B, V, 1, n)."""
    norm = piece(module.final_norm)
    normed = [norm(h) for h in hs]
    chunks: list[list[torch.Tensor]] = [[] for _ in hs]
    for conv in module.lm_head:
        head = piece(conv)
        for b, h in enumerate(normed):
            chunks[b].append(head(h))
    return [torch.cat(c, dim=1) for c in chunks]


def logit_slots(tokens: int, length: int, n_logits: int) -> tuple[list[int], slice]:
    """Fixture positions whose logits the program returns, and their index in its output."""
    first = max(0, tokens - n_logits)
    positions = list(range(first, tokens))
    start = n_logits - (tokens - first)
    return positions, slice(start, n_logits)


def fp32_run(
    implementation: str,
    description: str,
    module: BC1LDecoder,
    batches: list[Batch],
    results: list[Evaluation],
    markers: list[str],
    baseline: list[tuple[list[torch.Tensor], torch.Tensor]],
    progress: Callable[[], None],
) -> ProfileRun:
    """The fp32 profile's run: `Fp32Check` of each fixture's layer states and returned logits,
    at real positions, against `fp64_baseline`'s; ``progress`` after each batch."""
    run = ProfileRun(implementation, MODULE_BASELINE, description, [], 0.0, True)
    length, n_logits = module.io.length, module.io.logit_positions

    def pairs() -> Iterator[Pair]:
        for (states, want_logits), batch, result in zip(baseline, batches, results, strict=True):
            logits = join_logits(result.outputs)  # (B, n, V)
            run.see(result, logits, markers)
            for r, fixture in enumerate(batch.fixtures):
                n = len(fixture.token_ids)
                real = slice(length - n, length)
                for i, marker in enumerate(markers):
                    want = states[i][r, :, 0, real].numpy()
                    at = f"{fixture.name}, layer {i}"
                    yield Pair(result.captured[marker][r, :, 0, real], want, at, i)
                cut = logit_slots(n, length, n_logits)[1]
                want = want_logits[r, :, 0, cut].T.numpy()
                yield Pair(logits[r, cut], want, f"{fixture.name}, logits")
            progress()

    run.fp32 = Fp32Check.of(len(module.layers), pairs(), layers_lost=not markers)
    run.layer_rel_error, run.logits_rel_error = run.fp32.layer_rel_error, run.fp32.output.value
    return run
