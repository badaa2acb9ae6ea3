"""Parity fixtures for a recipe made from a checkpoint (``anec convert DIR``, ``recipes new``).

With a tokenizer, the fixtures are sentences of `TEXT`, a short human-written passage shipped
with anec (plain prose, a question, a chat turn, code, numbers, two other languages), each cut
at a word boundary to fit the window as the checkpoint's own tokenizer counts it. Without one,
they are token ids drawn from a fixed seed across the whole vocabulary (every embedding row
and LM-head chunk can be reached), at a few lengths up to the full window.
"""

from __future__ import annotations

import random
from typing import Any

# Written for anec; each line is one fixture candidate, in the order they are used.
TEXT = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "How do I reset my password if I no longer have access to my email?",
    "Rain is expected in the afternoon, so take an umbrella when you leave.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 5, 8, 13, 21, 34,",
    "The service was quick and the staff were friendly.",
    "Das Wetter ist heute schön, aber morgen soll es regnen.",
    "Le chat dort sur le canapé depuis ce matin.",
    "A draft model proposes several tokens and the larger model checks them in one pass.",
)
# Query and passage pairs for a cross-encoder, relevant and not; each passage is cut to fit.
PAIRS = (
    ("how do I reset my password", "Open the sign-in page and choose 'Forgot password' to get "
     "a reset link by email."),
    ("what is the capital of France", "Paris is the capital and largest city of France."),
    ("will it rain this afternoon", "The museum is open every day except Monday."),
    ("Wie wird das Wetter morgen?", "Morgen soll es den ganzen Tag regnen."),
)  # fmt: skip
MAX_FIXTURES = 6  # parity time grows with each fixture; six cover the kinds of text above
_SEED = 20240601  # token-id fixtures: fixed, so a recipe is the same every time it is made
_ID_LENGTH_SHARES = (0.3, 0.5, 0.7, 1.0)  # of the window: padded rows and one full window


def _fitting(tokenizer: Any, sentence: str, length: int, before: str | None = None) -> str | None:
    """The longest word prefix of ``sentence`` that tokenizes to at most ``length`` tokens
    (after ``before``, as a text pair's second segment, when given)."""
    words = sentence.split(" ")
    for n in range(len(words), 0, -1):
        text = " ".join(words[:n])
        text = text if n == len(words) else text.rstrip(",;:")
        encoded = tokenizer(text) if before is None else tokenizer(before, text)
        if text.strip() and len(encoded["input_ids"]) <= length:
            return text
    return None


def fixture_prompts(tokenizer: Any, length: int) -> list[str]:
    """Up to `MAX_FIXTURES` texts of `TEXT` (cut to fit ``length`` tokens), distinct, in order."""
    prompts: list[str] = []
    for sentence in TEXT:
        text = _fitting(tokenizer, sentence, length)
        if text is not None and text not in prompts:
            prompts.append(text)
        if len(prompts) == MAX_FIXTURES:
            break
    return prompts


def fixture_pairs(tokenizer: Any, length: int) -> list[tuple[str, str]]:
    """The `PAIRS` whose query and passage (cut to fit) fit ``length`` tokens together."""
    fitting = [(query, _fitting(tokenizer, passage, length, query)) for query, passage in PAIRS]
    return [(query, passage) for query, passage in fitting if passage is not None]


def fixture_token_ids(vocab_size: int, length: int, seed: int = _SEED) -> list[list[int]]:
    """Token-id fixtures for a checkpoint without a tokenizer: ids 1..V-1 (0 is often the pad
    id), one sequence per length share of the window."""
    rng = random.Random(seed)
    lengths = sorted({max(1, round(length * share)) for share in _ID_LENGTH_SHARES})
    low = 1 if vocab_size > 1 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]
