"""A cached decoder's layers run over a whole continuation at once, with no cache at all.

The reference of the fp32 cache level (`parity.kv_fp32`) and the torch-fp16 figure beside the
fp16 cache gates' logit error (`parity.kv_gates`). The window module's own blocks run the
sequence of n tokens at positions 0..n-1 in one call: RoPE tables computed here from each
layer's spec, each layer's causal (or causal sliding-window) mask from `graph_passes.masks`,
the keys of the sequence itself (`graph_passes.attention.WindowKeys`). Nothing of the cache -
host-built masks, write slots, RoPE rows, ``cache_valid``, the slot blend, a chunk's hand-off -
is on this path, so a fault in any of them cannot hide in the reference.

Built one layer (one LM-head chunk) at a time: at most one piece of the model exists in the
run's dtype beside the (D, n) stream, so an fp64 reference of Gemma 3 270M costs one layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from graph_passes.attention import WindowKeys
from graph_passes.decoder import BC1LDecoder
from graph_passes.masks import causal_window_mask
from graph_passes.rope import Positions, inverse_frequencies, rope_tables
from parity.decoder_fp32 import fp64_head
from parity.model_copies import cast_copy
from parity.reference import Continuation, SpilledRows

HEAD_POSITIONS = 64  # the LM head over this many positions at a time (V x 64 logits)
# A piece of the window module (a layer, the embedding, the final norm, an LM-head chunk) as
# the run computes it: an fp64 copy holding the program's constants, or an fp16 copy.
Piece = Callable[[torch.nn.Module], torch.nn.Module]


class SequenceKeys(WindowKeys):
    """The keys of the whole sequence at explicit positions (`WindowKeys` holds the module's
    own window positions)."""

    def __init__(self, positions: Positions) -> None:
        self.positions = positions


@dataclass
class SequenceRun:
    """Each layer's output (D, n) over the whole sequence and the logits of every position
    (rows 0..n-1, fp32 on disk)."""

    layers: list[np.ndarray]
    logits: SpilledRows


def sequence_positions(window: BC1LDecoder, n: int) -> list[Positions]:
    """Each layer's RoPE at positions 0..n-1, from its own spec (rotated channels, theta,
    scaling), in fp32 as `graph_passes.rope.rope_tables` makes them."""
    out = []
    at = torch.arange(n)
    for layer in window.decoder_layers():
        s = layer.attention.spec
        inv = inverse_frequencies(s.rotary_channels, s.rope_theta, s.rope_scaling)
        cos, sin = rope_tables(s.rotary_channels, 0.0, at, inv)
        out.append(Positions(cos, sin, n))
    return out


@torch.no_grad()
def run_sequence(
    window: BC1LDecoder, stream: torch.Tensor, piece: Piece, dtype: torch.dtype,
    keep_layers: bool = True,
) -> SequenceRun:  # fmt: skip
    """The window module's layers and head on ``stream`` (1, D, 1, n), the embedded tokens,
    each piece as ``piece`` makes it, in ``dtype``."""
    n = int(stream.shape[-1])
    h = stream.to(dtype)
    layers: list[np.ndarray] = []
    for layer, at in zip(window.decoder_layers(), sequence_positions(window, n), strict=True):
        mask = causal_window_mask(n, layer.window).to(dtype)
        keys = SequenceKeys(Positions(at.cos.to(dtype), at.sin.to(dtype), n))
        h = piece(layer)(h, mask, keys)
        if keep_layers:
            layers.append(h[0, :, 0, :].double().numpy())
    logits = SpilledRows()
    for start in range(0, n, HEAD_POSITIONS):
        (part,) = fp64_head(window, [h[:, :, :, start : start + HEAD_POSITIONS]], piece)
        for row in part[0, :, 0, :].T.float().numpy():
            logits.append(row)
    return SequenceRun(layers, logits)


def embedded(
    window: BC1LDecoder, ids: list[int], table: np.ndarray, piece: Piece, dtype: torch.dtype
) -> torch.Tensor:
    """The stream (1, D, 1, n) into the first layer in ``dtype``: the host table's rows (the
    program's ``inputs_embeds``), or the program's own embedding of the token ids."""
    if window.embed is not None:
        x = piece(window.embed)(torch.tensor([ids]))
    else:
        x = torch.from_numpy(table[ids])[None]
    return x.to(dtype).transpose(1, 2).unsqueeze(2)


def torch_fp16_errors(
    window: BC1LDecoder, table: np.ndarray, c: Continuation, positions: list[int]
) -> list[float]:
    """The BC1L module's largest |logit error| in torch fp16 with no cache, against the
    continuation's fp32 reference, at each of ``positions``: how far fp16 arithmetic itself
    moves the model there (one valid order of roundings among many; torch on the CPU)."""

    def piece(part: torch.nn.Module) -> torch.nn.Module:
        return cast_copy(part, torch.float16)

    stream = embedded(window, list(c.ids), table, piece, torch.float16)
    run = run_sequence(window, stream, piece, torch.float16, keep_layers=False)
    return [
        float(np.abs(run.logits[p].astype(np.float64) - c.reference(p)).max()) for p in positions
    ]
