"""The layout of a decoder's LM-head outputs: the vocabulary on the last axis.

Inside the program the head is BC1L: each chunk's 1x1 conv writes ``(B, V_k, 1, n)``, the
vocabulary on the channel axis. Returned that way, every logit sits alone in a 64-byte NE row
(the last axis is the n positions, usually 1): plan-inspect counted 3 MiB of output copies per
call for 96 KiB of SmolLM2 logits. So each chunk is returned as ``(B, n, 1, V_k)``: one
``transpose`` swapping axes 1 and 3 after the conv.

Why ``(B, n, 1, V_k)`` and not ``(B, 1, n, V_k)``: swapping the channel and width axes is one
transpose (perm ``[0, 3, 2, 1]``) that keeps axis 2 the BC1L singleton, so the tensor stays
rank 4 with the same three leading axes as every other BC1L tensor, and for n = 1 (decode, the
window's last logit) it moves no data at all (the NE sees a reshape). The conv itself is
unchanged and stays on the NE; `anec plan-inspect` predicts the transpose on the NE as well.

Version history of the I/O contract (``converter.manifest.IO_CONTRACT_CHANGES``):
manifest schema 2 returned ``(B, V_k, 1, n)``; schema 3 returns ``(B, n, 1, V_k)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

# How a runtime indexes one chunk output, as the manifest states it.
LAYOUT = "[batch, position, 0, token]"
PREFIX = "logits_"


def vocab_last(chunk: torch.Tensor) -> torch.Tensor:
    """A head chunk (B, V_k, 1, n) as the program returns it: (B, n, 1, V_k)."""
    return chunk.transpose(1, 3)


def chunk_names(outputs: Mapping[str, object]) -> list[str]:
    """The ``logits_<k>`` outputs in vocabulary order (k ascending, not name order)."""
    names = [k for k in outputs if k.startswith(PREFIX) and k[len(PREFIX) :].isdigit()]
    return sorted(names, key=lambda k: int(k[len(PREFIX) :]))


def join_logits(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The program's logit chunks joined on the vocabulary: (B, n, V), float32.

    Raises ValueError naming the output when a chunk is not rank 4 with axis 2 of size 1 or
    the chunks disagree on (B, n): an old-layout (B, V_k, 1, n) output with n > 1 is refused
    here rather than read as garbage.
    """
    names = chunk_names(outputs)
    if not names:
        raise ValueError("no logits_<k> output among " + ", ".join(sorted(outputs)))
    parts = [np.asarray(outputs[k], dtype=np.float32) for k in names]
    lead = parts[0].shape[:2]
    for name, part in zip(names, parts, strict=True):
        if part.ndim != 4 or part.shape[2] != 1 or part.shape[:2] != lead:
            raise ValueError(
                f"output {name}: shape {tuple(part.shape)}, expected (B, n, 1, V_k) with "
                f"(B, n) = {tuple(lead)} (the vocabulary-last layout, manifest schema 3)"
            )
    return np.concatenate(parts, axis=3)[:, :, 0, :]
