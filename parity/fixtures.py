"""Parity fixtures: token sequences laid out in the model's fixed window.

Every fixture is left-padded to the window (the last real token in the last slot, as the
draft decoder's I/O contract says). With ``padded_variants`` each fixture also appears as a
full window - its tokens repeated to fill all L slots - so both slices, padded and unpadded,
are covered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from graph_passes.errors import InputError

Slice = Literal["padded", "full-window"]


@dataclass(frozen=True)
class Fixture:
    """One token sequence to check, and the slice it belongs to."""

    name: str
    token_ids: tuple[int, ...]
    slice: Slice


@dataclass(frozen=True)
class Batch:
    """Fixtures stacked into the model's fixed (B, L) shape, left-padded."""

    fixtures: tuple[Fixture, ...]  # real rows; rows beyond these repeat the first (filler)
    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) 1 real, 0 padding


def build_fixtures(
    prompts: list[str],
    token_ids: list[list[int]],
    tokenizer: Any | None,
    length: int,
    vocab_size: int,
    padded_variants: bool,
) -> list[Fixture]:
    """Tokenize prompts with the checkpoint's tokenizer and check every fixture fits."""
    sequences: list[tuple[str, list[int]]] = []
    if prompts and tokenizer is None:
        raise InputError(
            "fixtures.prompts: the checkpoint has no tokenizer; give fixtures.token_ids instead"
        )
    for i, prompt in enumerate(prompts):
        sequences.append((f"prompt[{i}]", list(tokenizer(prompt)["input_ids"])))  # type: ignore[misc]
    for i, ids in enumerate(token_ids):
        sequences.append((f"token_ids[{i}]", list(ids)))

    fixtures = []
    for name, ids in sequences:
        if not ids:
            raise InputError(f"fixtures.{name}: tokenizes to no tokens")
        if len(ids) > length:
            raise InputError(
                f"fixtures.{name}: {len(ids)} tokens do not fit shapes.sequence_length = {length}"
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(
                f"fixtures.{name}: token ids {bad[:5]} outside the vocabulary (0..{vocab_size - 1})"
            )
        fixtures.append(Fixture(name, tuple(ids), "padded" if len(ids) < length else "full-window"))
        if padded_variants and len(ids) < length:
            repeats = -(-length // len(ids))
            fixtures.append(
                Fixture(f"{name}/full-window", tuple((ids * repeats)[:length]), "full-window")
            )
    return fixtures


def make_batches(
    fixtures: list[Fixture], batch: int, length: int, pad_id: int, right: bool = False
) -> list[Batch]:
    """Group fixtures into (B, L) batches, left-padded with ``pad_id`` (``right``: right-padded,
    slot l = position l, as encoders take them); rows beyond the fixtures repeat the first."""
    batches = []
    for start in range(0, len(fixtures), batch):
        group = fixtures[start : start + batch]
        rows = list(group) + [group[0]] * (batch - len(group))
        ids = torch.full((batch, length), pad_id, dtype=torch.int64)
        mask = torch.zeros((batch, length), dtype=torch.int64)
        for r, fixture in enumerate(rows):
            n = len(fixture.token_ids)
            real = slice(0, n) if right else slice(length - n, length)
            ids[r, real] = torch.tensor(fixture.token_ids)
            mask[r, real] = 1
        batches.append(Batch(tuple(group), ids, mask))
    return batches


def pad_id(tokenizer: Any, config: Any) -> int:
    """The id written into padded slots: the tokenizer's or config's pad id, else EOS, else 0.

    Any id works (the key mask excludes padded slots); a real one keeps the fixtures readable.
    """
    for holder in (tokenizer, config):
        value = getattr(holder, "pad_token_id", None)
        if isinstance(value, int):
            return value
    eos = getattr(config, "eos_token_id", None)
    return eos if isinstance(eos, int) else 0
