"""Which token ids a trimmed LM head keeps: the most used on a ranking corpus, then the
tokenizer's own order for ids the corpus never produced; special and fixture tokens always.

The kept ids are returned in ascending order: the head's rows stay in vocabulary order, and
row j of the trimmed head is token ``ids[j]`` (the manifest's ``head_ids.npy``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from converter.errors import InputError
from converter.vocabulary.corpora import Corpus

# Texts per tokenizer call: the fast tokenizer batches in Rust; bounded for memory.
_BATCH = 4096


def corpus_counts(tokenizer: Any, corpus: Corpus, vocab_size: int) -> np.ndarray:
    """How often each id occurs when every text of the corpus is tokenized on its own (no
    special tokens added), as an int64 array of ``vocab_size``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(corpus.texts), _BATCH):
        batch = corpus.texts[start : start + _BATCH]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    return counts


def tokenizer_rank(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """A rank per id from the tokenizer's own model, lower first: for BPE the index of the
    merge that makes the token (its alphabet before every merge), for Unigram the pieces by
    descending score; the id itself otherwise (and for ids the model does not name)."""
    rank = np.arange(vocab_size, dtype=np.float64) + 1e9  # unnamed ids: after all, by id
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = model.get("vocab")
    if model.get("type") == "BPE" and isinstance(vocab, dict):
        made: dict[str, int] = {}
        for i, merge in enumerate(model.get("merges") or []):
            a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
            made.setdefault(a + b, i + 1)
        for token, token_id in vocab.items():
            if token_id < vocab_size:
                rank[token_id] = made.get(token, 0)
    elif model.get("type") == "Unigram" and isinstance(vocab, list):
        for token_id, (_, score) in enumerate(vocab[:vocab_size]):
            rank[token_id] = -float(score)
    else:
        rank = np.arange(vocab_size, dtype=np.float64)
    return rank


def always_kept(tokenizer: Any, fixture_ids: Iterable[Iterable[int]], vocab_size: int) -> set[int]:
    """Special and added tokens, and every token of the parity fixtures."""
    kept = {int(i) for i in tokenizer.all_special_ids}
    kept |= {int(i) for i in tokenizer.get_added_vocab().values()}
    for ids in fixture_ids:
        kept |= {int(i) for i in ids}
    return {i for i in kept if 0 <= i < vocab_size}


@dataclass(frozen=True)
class KeptIds:
    """The trimmed head's ids and how they were chosen."""

    ids: np.ndarray  # ascending int64
    always: int  # special, added and fixture tokens among them
    ranked_seen: int  # ids the corpus produced, kept by count
    ranked_unseen: int  # ids kept by the tokenizer's order (the corpus never produced them)
    corpus_tokens: int
    corpus_distinct: int


def choose_ids(counts: np.ndarray, rank: np.ndarray, always: set[int], size: int) -> KeptIds:
    """``size`` ids: ``always`` first, then by corpus count (descending), ties and unseen ids
    by ``rank``, then by id."""
    vocab = len(counts)
    if size > vocab:
        raise InputError(f"vocabulary.size: {size} exceeds the checkpoint's {vocab} tokens")
    if len(always) > size:
        raise InputError(
            f"vocabulary.size: {size} is below the {len(always)} special and fixture tokens "
            "that are always kept"
        )
    order = np.lexsort((np.arange(vocab), rank, -counts))  # last key first
    chosen = set(always)
    for token in order:
        if len(chosen) == size:
            break
        chosen.add(int(token))
    ids = np.array(sorted(chosen), dtype=np.int64)
    ranked = [i for i in ids if i not in always]
    seen = sum(1 for i in ranked if counts[i] > 0)
    return KeptIds(
        ids, len(always), seen, len(ranked) - seen, int(counts.sum()), int((counts > 0).sum())
    )
