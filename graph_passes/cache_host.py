"""What a host computes for one call of a cached decoder: the position-dependent inputs.

Conventions (the manifest states them; `graph_passes.cached_decoder` is the program side):

* slot ``s`` of the cache holds the token at position ``s``; ``position`` is the number of
  slots that hold the context before a call (the next free slot);
* a call runs ``n <= T`` tokens left-padded to T: slot ``u`` of the call holds a padding token
  for ``u < T - n``, else the token at position ``position + u - (T - n)``; so the last real
  token is always in slot T - 1 (``logits: last``);
* padding tokens are written nowhere and are masked as keys; their outputs are meaningless;
* after a call ``position`` advances by n. Rejecting drafted tokens is moving ``position``
  back: the rejected slots become stale, are hidden by ``cache_valid`` and the mask, and the
  next call overwrites them;
* the cache holds S positions: a call needs ``position + n <= S``;
* the masks' key axis holds the S slots alone for a function that writes its tokens into
  their slots before attending (style ``state``): the call's own tokens are visible, causally,
  in their slots; for style ``io`` it holds the S slots, then the T new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graph_passes.masks import MASKED


@dataclass(frozen=True)
class CallShape:
    """The fixed shapes of one function and the model facts its host inputs depend on."""

    cache_length: int  # S
    tokens: int  # T
    windows: tuple[int, ...]  # the causal sliding windows of local layers
    style: str  # "state" or "io"
    # The function writes its tokens into their slots before attending (style state, from
    # manifest schema 5): its masks' keys are the S slots alone. An artifact says so by its
    # masks' shape.
    in_place: bool = False


def token_positions(position: int, n: int, tokens: int) -> np.ndarray:
    """The position of each of the T slots (-1 for padding)."""
    pad = tokens - n
    return np.array([-1] * pad + [position + u for u in range(n)], dtype=np.int64)


def call_inputs(
    shape: CallShape,
    position: int,
    n: int,
    rope: list[tuple[np.ndarray, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The host inputs (fp32) of a call of n tokens at ``position``: RoPE rows from ``rope``
    (per group, cos and sin tables (r, S) for positions 0..S-1), masks, ``cache_valid`` and,
    for the state style, ``write_slots``. Raises ValueError when the call does not fit."""
    s, t = shape.cache_length, shape.tokens
    if not 1 <= n <= t:
        raise ValueError(f"a call runs 1..{t} tokens, got {n}")
    if position < 0 or position + n > s:
        raise ValueError(
            f"position {position} + {n} tokens exceeds the cache of {s} slots "
            "(evict: shift the context on the host and prefill again)"
        )
    pos = token_positions(position, n, t)
    real = pos >= 0
    rows = np.where(real, pos, position)  # padding reads any finite row
    out: dict[str, np.ndarray] = {}
    for g, (cos, sin) in enumerate(rope):
        out[f"rope_cos_{g}"] = cos[:, rows][None, None].astype(np.float32)
        out[f"rope_sin_{g}"] = sin[:, rows][None, None].astype(np.float32)
    out["mask"] = attention_mask(pos, position, s, None, shape.in_place)
    for w in shape.windows:
        out[f"mask_window_{w}"] = attention_mask(pos, position, s, w, shape.in_place)
    out["cache_valid"] = (np.arange(s) < position).astype(np.float32).reshape(1, 1, s, 1)
    if shape.style == "state":
        slots = np.zeros((s, t), dtype=np.float32)
        for u in np.nonzero(real)[0]:
            slots[pos[u], u] = 1.0
        out["write_slots"] = slots.reshape(1, 1, s, t)
    return out


def attention_mask(
    pos: np.ndarray, position: int, cache: int, window: int | None, in_place: bool = False
) -> np.ndarray:
    """(1, S + T, 1, T) additive mask: cache slot j (j < position) and new slot u are visible
    from a real query at position q when their position k has ``q - window < k <= q``;
    ``in_place``: (1, S, 1, T), slot j holding position j (the new tokens in their slots)."""
    t = len(pos)
    slots = np.arange(cache)
    old = np.where(slots < position, slots, -1)
    keys = slots if in_place else np.concatenate([old, pos])
    q = pos[None, :]
    k = keys[:, None]
    allowed = (k >= 0) & (q >= 0) & (k <= q)
    if window is not None:
        allowed &= k > q - window
    mask = np.where(allowed, 0.0, MASKED).astype(np.float32)
    return mask.reshape(1, len(keys), 1, t)


def write_rows(cache: np.ndarray, rows: np.ndarray, position: int, n: int) -> None:
    """Style ``io``: write a call's new rows (2N, KV, T, d) into the host cache (2N, KV, S, d)
    at their slots (the last n of the T slots hold the real tokens)."""
    t = rows.shape[2]
    cache[:, :, position : position + n, :] = rows[:, :, t - n :, :]
