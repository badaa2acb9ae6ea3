"""Held-out and calibration text installed with Python: the prose of ``pydoc_data.topics``.

The standard library ships its language reference's topics as plain text (``pydoc_data.
topics.topics``, what ``help("assert")`` prints): human-written, not model-generated, and
present wherever Python is. A paragraph counts as prose when none of its lines is indented
(code, grammar and tables are) and it has at least ``_MIN_WORDS`` words; headings and their
underlines are dropped. Paragraphs are numbered in sorted topic order; the held-out slice takes
the even ones and the calibration slice the odd ones, so the two never share a text.

A decoder's slice is the paragraphs' token ids, each cut to the window, taken in order until
the recipe's ``positions`` are reached (every real position is scored); an encoder's is the
paragraphs' sentences that fit the window, in order, ``sentences`` of them.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import replace
from typing import Any

from converter.errors import InputError

_MIN_WORDS = 12  # shorter blocks are captions, list items and headings, not prose
_SENTENCE_WORDS = (6, 40)  # a sentence between these word counts (inclusive, exclusive)
_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$", re.M)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")
PARTS = ("held_out", "calibration")


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """Every prose paragraph of the installed ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = block.split("\n")
            if any(line.startswith((" ", "\t")) for line in lines) or _UNDERLINE.search(block):
                continue
            text = " ".join(line.strip() for line in lines).strip()
            if len(text.split()) >= _MIN_WORDS:
                out.append(text)
    return tuple(dict.fromkeys(out))  # topics repeat some paragraphs: the first one counts


def part_paragraphs(part: str) -> list[str]:
    """The paragraphs of ``part``: held_out the even ones, calibration the odd ones."""
    if part not in PARTS:
        raise ValueError(f"corpus part {part!r}: expected one of {', '.join(PARTS)}")
    return list(paragraphs()[PARTS.index(part) :: 2])


@functools.cache
def _sentence_parts() -> dict[str, int]:
    """Every sentence of 6 to 39 words and the part (0 held-out, 1 calibration) of the first
    paragraph holding it: topics repeat sentences in other paragraphs."""
    low, high = _SENTENCE_WORDS
    out: dict[str, int] = {}
    for i, paragraph in enumerate(paragraphs()):
        for sentence in _SENTENCE_END.split(paragraph):
            if low <= len(sentence.split()) < high:
                out.setdefault(sentence, i % 2)
    return out


def part_sentences(part: str) -> list[str]:
    """The sentences of ``part`` (each sentence in one part only), in order."""
    index = PARTS.index(part) if part in PARTS else part_paragraphs(part)  # raises
    return [s for s, p in _sentence_parts().items() if p == index]


def source(corpus: Any, part: str) -> str:
    """What the slice is, for reports: corpus, part and the Python whose text it is."""
    v = sys.version_info
    return (
        f"{corpus.corpus} (the standard library's documentation topics, Python "
        f"{v.major}.{v.minor}.{v.micro}), {'even' if part == 'held_out' else 'odd'} prose "
        "paragraphs"
    )


def shared_with(corpus: Any, part: str, texts: list[str]) -> int:
    """How many of ``texts`` are a paragraph or a sentence of ``part`` (0 expected)."""
    pool = set(part_paragraphs(part)) | set(part_sentences(part))
    return sum(t in pool for t in texts)


def _tokenize(tokenizer: Any, text: str, where: str) -> list[int]:
    if tokenizer is None:
        raise InputError(f"{where}: a corpus needs the checkpoint's tokenizer; it has none")
    return list(tokenizer(text)["input_ids"])


def decoder_texts(corpus: Any, part: str, tokenizer: Any, length: int) -> list[list[int]]:
    """Token ids of ``part``'s paragraphs, each cut to ``length``, until ``corpus.positions``
    positions are covered."""
    where = f"compression.{part}"
    want = corpus.positions
    out: list[list[int]] = []
    have = 0
    for text in part_paragraphs(part):
        ids = _tokenize(tokenizer, text, where)[:length]
        out.append(ids)
        have += len(ids)
        if have >= want:
            return out
    raise InputError(
        f"{where}.positions: {want} positions asked, the corpus {corpus.corpus} gives {have} "
        f"in windows of {length}"
    )


def encoder_texts(corpus: Any, part: str, tokenizer: Any, length: int) -> list[str]:
    """The first ``corpus.sentences`` sentences of ``part`` whose tokens fit ``length``."""
    where = f"compression.{part}"
    want = corpus.sentences
    out = [s for s in part_sentences(part) if len(_tokenize(tokenizer, s, where)) <= length]
    if len(out) < want:
        raise InputError(
            f"{where}.sentences: {want} asked, the corpus {corpus.corpus} has {len(out)} that "
            f"fit {length} tokens"
        )
    return out[:want]


def encoder_pairs(corpus: Any, part: str, tokenizer: Any, length: int) -> list[tuple[str, str]]:
    """The first ``corpus.sentences`` pairs of consecutive sentences of ``part`` (each sentence
    with the one after it: mostly the same paragraph's) whose joint tokens fit ``length``."""
    where = f"compression.{part}"
    if tokenizer is None:
        raise InputError(f"{where}: a corpus needs the checkpoint's tokenizer; it has none")
    sentences = part_sentences(part)
    out = [
        (a, b) for a, b in zip(sentences, sentences[1:], strict=False)
        if len(tokenizer(a, b)["input_ids"]) <= length
    ]  # fmt: skip
    if len(out) < corpus.sentences:
        raise InputError(
            f"{where}.sentences: {corpus.sentences} pairs asked, the corpus {corpus.corpus} "
            f"has {len(out)} that fit {length} tokens"
        )
    return out[: corpus.sentences]


Text = str | list[int] | tuple[str, str]  # one text, token ids, or a text pair


def resolve(
    items: Any, part: str, tokenizer: Any, length: int, decoder: bool
) -> tuple[list[Text], str]:
    """A held-out or calibration list as texts / token-id lists / text pairs, and a line
    saying what it is (a recipe's own list: ``recipe``)."""
    if isinstance(items, list | tuple):  # not a ``recipe.compression.Corpus``
        return list(items), "the recipe's own texts"
    texts: list[Text]
    if decoder:
        texts = list(decoder_texts(items, part, tokenizer, length))
    elif items.pairs:
        texts = list(encoder_pairs(items, part, tokenizer, length))
    else:
        texts = list(encoder_texts(items, part, tokenizer, length))
    where = source(items, part)
    return texts, where + (", consecutive sentences as text pairs" if items.pairs else "")


def slice_fixtures(
    items: Any, part: str, tokenizer: Any, length: int, vocab_size: int, decoder: bool,
    type_vocab_size: int = 0,
) -> tuple[list[Any], str]:  # fmt: skip
    """A held-out or calibration slice (`resolve`) as fixtures named ``<part>[i]`` (each
    checked to fit ``length``, the vocabulary and a pair's segment ids the model's
    ``type_vocab_size`` token types), and the line saying what it is."""
    from parity.fixtures import build_fixtures

    texts, where = resolve(items, part, tokenizer, length, decoder)
    prompts = [t for t in texts if isinstance(t, str)]
    pairs = [t for t in texts if isinstance(t, tuple)]
    ids = [t for t in texts if isinstance(t, list)]
    built = build_fixtures(prompts, ids, tokenizer, length, vocab_size, False, pairs,
                           type_vocab_size)  # fmt: skip
    return [replace(f, name=f"{part}[{i}]") for i, f in enumerate(built)], where
