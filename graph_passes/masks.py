"""Attention masks in the BC1L score layout ``score[b, key, 0, query]``.

Exclusion is a finite negative number, not -inf: a fully masked row (a left-padded query)
must stay finite, and two -65504 masks added together would be -inf in fp16. With
``MASKED = -1e4`` the sum of the causal and key masks is at worst -2e4, and
``exp(-1e4 + s)`` is exactly 0 in fp16 and fp32 for any realistic score ``s``.

Local (sliding-window) attention comes in two conventions, both kept and named after them
(`graph_passes.spec.WindowRule`): `folded_band_mask` is the symmetric inclusive band
``abs(q - k) <= window`` of bidirectional encoders (ModernBERT), `causal_window_mask` the
causal exclusive window ``q - window < k <= q`` of transformers' sliding-window decoders
(Gemma 3: a window of 512 sees the query and the 511 keys before it).
"""

from __future__ import annotations

import torch

MASKED = -1.0e4


def causal_mask(length: int) -> torch.Tensor:
    """(1, L, 1, L): 0 where key <= query, ``MASKED`` where the key lies in the future."""
    return causal_window_mask(length, None)


def causal_window_mask(length: int, window: int | None) -> torch.Tensor:
    """(1, L, 1, L): 0 where ``query - window < key <= query`` (``key <= query`` for a global
    layer, ``window`` None), ``MASKED`` elsewhere.

    The window is exclusive at distance ``window``: transformers' ``sliding_window_overlay``
    keeps ``kv_idx > q_idx - sliding_window``. Slots are positions shifted by the left padding,
    which leaves every difference ``q - k`` unchanged.
    """
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    key = torch.arange(length)[:, None]
    query = torch.arange(length)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    mask = torch.where(allowed, 0.0, MASKED)
    return mask.reshape(1, length, 1, length).to(torch.float32)


def key_mask_from_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """The model input ``key_mask`` (B, L) from a 0/1 attention mask: 0 real, ``MASKED`` padding."""
    return torch.where(attention_mask.bool(), 0.0, MASKED).to(torch.float32)


def folded_band_mask(batch: int, length: int, window: int | None) -> torch.Tensor:
    """(1, B*L, 1, B*L) structural mask for ``batch`` samples folded into one sequence.

    Key slot ``k`` is visible from query slot ``q`` iff both belong to the same sample
    (block-diagonal) and, for a local layer, ``abs(q - k) <= window`` (the symmetric inclusive
    band). One ``MASKED`` marks every exclusion, so adding the key mask gives at worst
    ``2 * MASKED``.
    """
    slots = torch.arange(batch * length)
    sample, pos = slots // length, slots % length
    allowed = sample[:, None] == sample[None, :]
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]).abs() <= window
    mask = torch.where(allowed, 0.0, MASKED)  # [key, query]; symmetric, so the order is moot
    return mask.reshape(1, batch * length, 1, batch * length).to(torch.float32)
