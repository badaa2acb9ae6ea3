"""Parity fixtures: token sequences laid out in the model's fixed window.

Every fixture is left-padded to the window (the last real token in the last slot, as the
draft decoder's I/O contract says). With ``padded_variants`` each fixture also appears as a
full window - its tokens repeated to fill all L slots - so both slices, padded and unpadded,
are covered.

A text pair (a cross-encoder's query and passage) is tokenized as the checkpoint's tokenizer
joins two segments, with its segment ids: a BERT model adds the second segment's token-type
row to those tokens, so a program fed all-zero types would be checked on inputs it never
gets at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    token_types: tuple[int, ...] = ()  # segment id per token (a text pair); () all segment 0


@dataclass(frozen=True)
class Batch:
    """Fixtures stacked into the model's fixed (B, L) shape, left-padded."""

    fixtures: tuple[Fixture, ...]  # real rows; rows beyond these repeat the first (filler)
    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) 1 real, 0 padding
    token_type_ids: torch.Tensor | None = None  # (B, L) int64 segment ids; None: all 0

    @property
    def segments(self) -> torch.Tensor:
        """The (B, L) segment ids, 0 at padding and wherever no pair gave others."""
        if self.token_type_ids is None:
            return torch.zeros_like(self.input_ids)
        return self.token_type_ids


def build_fixtures(
    prompts: list[str],
    token_ids: list[list[int]],
    tokenizer: Any | None,
    length: int,
    vocab_size: int,
    padded_variants: bool,
    pairs: Sequence[tuple[str, str]] = (),
    type_vocab_size: int = 0,
) -> list[Fixture]:
    """Tokenize prompts (and text ``pairs``, with their segment ids) with the checkpoint's
    tokenizer and check every fixture fits: the window, the vocabulary and, for a model with
    ``type_vocab_size`` token-type rows (0: none), its segment ids."""
    sequences: list[tuple[str, list[int], list[int]]] = []
    if (prompts or pairs) and tokenizer is None:
        key = "prompts" if prompts else "pairs"
        raise InputError(
            f"fixtures.{key}: the checkpoint has no tokenizer; give fixtures.token_ids instead"
        )
    for i, prompt in enumerate(prompts):
        sequences.append((f"prompt[{i}]", list(tokenizer(prompt)["input_ids"]), []))  # type: ignore[misc]
    for i, (first, second) in enumerate(pairs):
        encoded = tokenizer(first, second)  # type: ignore[misc]
        types = list(encoded.get("token_type_ids") or []) if type_vocab_size else []
        sequences.append((f"pair[{i}]", list(encoded["input_ids"]), types))
    for i, ids in enumerate(token_ids):
        sequences.append((f"token_ids[{i}]", list(ids), []))

    fixtures = []
    for name, ids, types in sequences:
        _check_fits(name, ids, types, length, vocab_size, type_vocab_size)
        slice_: Slice = "padded" if len(ids) < length else "full-window"
        fixtures.append(Fixture(name, tuple(ids), slice_, tuple(types)))
        if padded_variants and len(ids) < length:
            repeats = -(-length // len(ids))
            fixtures.append(
                Fixture(f"{name}/full-window", tuple((ids * repeats)[:length]), "full-window",
                        tuple((types * repeats)[:length]))
            )  # fmt: skip
    return fixtures


def _check_fits(name: str, ids: list[int], types: list[int], length: int, vocab_size: int,
                type_vocab_size: int) -> None:  # fmt: skip
    """Refuse a fixture that is empty, longer than the window, or has an id outside the
    vocabulary (or a segment id outside the token-type table)."""
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
    bad = sorted({t for t in types if not 0 <= t < type_vocab_size})
    if bad:
        raise InputError(
            f"fixtures.{name}: segment ids {bad[:5]} outside the model's token-type table "
            f"(0..{type_vocab_size - 1})"
        )


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
        types = torch.zeros((batch, length), dtype=torch.int64)
        for r, fixture in enumerate(rows):
            n = len(fixture.token_ids)
            real = slice(0, n) if right else slice(length - n, length)
            ids[r, real] = torch.tensor(fixture.token_ids)
            mask[r, real] = 1
            if fixture.token_types:
                types[r, real] = torch.tensor(fixture.token_types)
        segments = types if any(f.token_types for f in group) else None
        batches.append(Batch(tuple(group), ids, mask, segments))
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
