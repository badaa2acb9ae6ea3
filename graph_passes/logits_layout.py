"""The layout of a decoder's LM-head outputs: the vocabulary on the last axis.

Inside the program the head is BC1L: each chunk's 1x1 conv writes ``(B, V_k, 1, n)``, the
vocabulary on the channel axis. Returned that way, every logit sits alone in a 64-byte NE row
(the last axis is the n positions, usually 1): plan-inspect counted 3 MiB of output copies per
call for 96 KiB of SmolLM2 logits. So each chunk is returned as ``(B, n, 1, V_k)``: one
``transpose`` swapping axes 1 and 3 after the conv.

Why ``(B, n, 1, V_k)`` and not ``(B, 1, n, V_k)``: both are one transpose after the conv
and give the same dense rows (one per position and chunk). Swapping the channel and width axes
(perm ``[0, 3, 2, 1]``) keeps axis 2 the BC1L singleton, so the output has the same rank-4
(batch, *, 1, *) form as every other BC1L tensor, and with n = 1 (decode, the window's last
logit) the element order does not change at all. The conv itself is unchanged (1x1 over the
channels, on the NE); `anec plan-inspect` predicts the transposes on the NE, in the head's one
NE segment (tests/test_mil_cli.py; SmolLM2 at 2 layers in bench/README.md: 98,304 output bytes
per call instead of 3,145,728).

Version history of the I/O contract (``converter.pipeline.manifest.IO_CONTRACT_CHANGES``):
manifest schema 2 returned ``(B, V_k, 1, n)``; schema 3 returns ``(B, n, 1, V_k)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch

HeadOutput = Literal["logits", "argmax", "topk"]

# How a runtime indexes one chunk output, as the manifest states it.
LAYOUT = "[batch, position, 0, token]"
PREFIX = "logits_"


def choose(chunk: torch.Tensor, output: HeadOutput, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In-model selection on one vocabulary-last chunk (B, n, 1, V_k): the indices inside the
    chunk (int32) and their logits, (B, n, 1, 1) for ``argmax``, (B, n, 1, k) for ``topk``
    (largest first). coremltools lowers these to ``reduce_argmax`` + ``reduce_max`` and to
    ``topk``; plan-inspect predicts them on the CPU (int outputs: rules R-INT, O-TOPK)."""
    if output == "argmax":
        values, index = chunk.max(dim=-1, keepdim=True)
    elif output == "topk":
        values, index = torch.topk(chunk, k, dim=-1)
    else:
        raise ValueError(f"no in-model selection for head output {output!r}")
    return index.to(torch.int32), values


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


def output_names(output: HeadOutput, k: int) -> list[str]:
    """The names of chunk ``k``'s outputs for a head output choice, in the program's order."""
    if output == "logits":
        return [f"{PREFIX}{k}"]
    return [f"{output}_index_{k}", f"{output}_value_{k}"]


def head_output_of(outputs: Mapping[str, object]) -> HeadOutput:
    """Which head output choice a program's outputs are (by their names)."""
    if chunk_names(outputs):
        return "logits"
    for choice in ("argmax", "topk"):
        if any(name.startswith(f"{choice}_index_") for name in outputs):
            return choice
    raise ValueError(
        "no LM-head output (logits_<k>, argmax_* or topk_*) among " + ", ".join(outputs)
    )


def candidates(
    outputs: Mapping[str, np.ndarray], chunk_sizes: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's returned candidates as vocabulary ids and logits, (B, n, C) each: the
    whole vocabulary for logits outputs, one per chunk for argmax, k per chunk for top-k."""
    choice = head_output_of(outputs)
    if choice == "logits":
        logits = join_logits(outputs)
        every = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
        return every, logits
    ids: list[np.ndarray] = []
    values: list[np.ndarray] = []
    start = 0
    for k, size in enumerate(chunk_sizes):
        index_name, value_name = output_names(choice, k)
        if index_name not in outputs:
            raise ValueError(f"no output {index_name} for LM-head chunk {k}")
        index = np.asarray(outputs[index_name]).astype(np.int64)[:, :, 0, :]
        if index.size and (index.min() < 0 or index.max() >= size):
            raise ValueError(f"output {index_name}: an index outside chunk {k}'s 0..{size - 1}")
        ids.append(index + start)
        values.append(np.asarray(outputs[value_name], dtype=np.float32)[:, :, 0, :])
        start += size
    return np.concatenate(ids, axis=-1), np.concatenate(values, axis=-1)


def top_ids(outputs: Mapping[str, np.ndarray], chunk_sizes: list[int], k: int = 1) -> np.ndarray:
    """The host's combination of the chunks: the ``k`` ids with the largest logits at each
    position, (B, n, k), largest first, ties to the lower id (as ``np.argmax``)."""
    ids, values = candidates(outputs, chunk_sizes)
    order = np.lexsort((ids, -values.astype(np.float64)), axis=-1)[..., :k]
    return np.take_along_axis(ids, order, axis=-1)
