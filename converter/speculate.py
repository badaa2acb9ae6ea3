"""Greedy speculative decoding: a cached draft artifact proposes, a transformers target verifies.

One cycle with depth K: the draft proposes K tokens one ``decode`` call at a time; the target
runs the context plus the K drafts once (a full recompute, fp32) and takes its own greedy token
at each of the K + 1 positions; the longest prefix of drafts equal to the target's tokens is
accepted, followed by the target's token after it (a correction, or a bonus token when all K
were accepted). The draft then rolls back to the start of the cycle (the manifest's rollback
convention) and absorbs the accepted tokens and the target's token with ``extend`` calls. The
output is exactly the target's greedy continuation.

Figures: acceptance per draft position (accepted / reached), mean accepted drafts per cycle,
tokens per target call. The speed-up is `predicted` from stated inputs only (see `speedup`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from parity.kv_session import CacheSession

# Held-out, human-written text (not the recipes' fixtures or held-out sets): prompts whose
# continuations the draft and the target both generate.
TEXTS = (
    "The old lighthouse keeper climbed the stairs every evening at dusk, carrying a lamp and a",
    "When the bakery on the corner closed for good, the neighbours gathered outside to",
    "To repot a houseplant, first water it the day before, then gently loosen the roots and",
    "The museum's new exhibition traces the history of printing from woodblocks to",
)


@dataclass
class Acceptance:
    """What a speculative run measured for one depth K."""

    k: int
    reached: list[int] = field(default_factory=list)  # cycles that reached draft position i
    accepted: list[int] = field(default_factory=list)  # of those, cycles that accepted it
    cycles: int = 0
    target_calls: int = 0
    tokens: int = 0
    # One run's cycles in order: (continuation index the cycle starts at, drafts accepted);
    # `add` sums counts, not traces.
    trace: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def rate(self, i: int) -> float:
        """Acceptance rate at draft position i (accepted / reached)."""
        return self.accepted[i] / self.reached[i] if self.reached[i] else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per cycle."""
        return sum(self.accepted) / self.cycles if self.cycles else 0.0

    def add(self, other: Acceptance) -> None:
        """Add another run's counts at the same K (a sweep's texts, one at a time)."""
        for i in range(self.k):
            self.reached[i] += other.reached[i]
            self.accepted[i] += other.accepted[i]
        self.cycles += other.cycles
        self.target_calls += other.target_calls
        self.tokens += other.tokens

    @property
    def tokens_per_call(self) -> float:
        """Tokens produced per target call."""
        return self.tokens / self.target_calls if self.target_calls else 0.0


def replay(agree: list[bool], new_tokens: int, k: int, stats: Acceptance) -> None:
    """Greedy speculative cycles with depth ``k`` over a target continuation, counted into
    ``stats`` without running them: ``agree[i]`` says whether the draft's greedy token after
    the prompt plus the first i continuation tokens equals continuation token i.

    Exact for greedy verification: a cycle at continuation index t drafts from a context
    equal to the target's own (every earlier token was accepted or the target's), so its
    j-th draft, reached only when drafts t..t+j-1 were accepted, is the draft's greedy token
    after continuation index t + j: accepted while ``agree`` holds, at most k, then the
    target's token. ``agree`` covers ``new_tokens + k - 1`` indices (the last cycle drafts
    past the end, as `speculate` does); a cycle's output is cut at ``new_tokens``."""
    if len(agree) < new_tokens + k - 1:
        raise ValueError(f"agree covers {len(agree)} indices, need {new_tokens + k - 1}")
    t = 0
    while t < new_tokens:
        accepted = 0
        while accepted < k and agree[t + accepted]:
            accepted += 1
        stats.cycles += 1
        stats.target_calls += 1
        stats.trace.append((t, accepted))
        for i in range(min(accepted + 1, k)):
            stats.reached[i] += 1
        for i in range(accepted):
            stats.accepted[i] += 1
        stats.tokens += min(accepted + 1, new_tokens - t)
        t += accepted + 1


def draft_agreement(
    make_session: Callable[[], CacheSession], prompt: list[int], cont: list[int]
) -> list[bool]:
    """Whether the draft's greedy token after ``prompt + cont[:i]`` is ``cont[i]``, for every
    i: the prompt prefilled, then ``cont`` decoded one token at a time (teacher-forced), for
    `replay`. The context must fit the cache (no eviction)."""
    session = make_session()
    capacity = session.functions["prefill"].shape.cache_length
    if len(prompt) + len(cont) > capacity:
        raise ValueError(f"{len(prompt)} + {len(cont)} tokens exceed the {capacity}-slot cache")
    token = session.choose(session.prefill_outputs("prefill", prompt))
    agree = [token == cont[0]]
    for i in range(len(cont) - 1):
        token = session.choose(session.call_outputs("decode", [cont[i]]))
        agree.append(token == cont[i + 1])
    return agree


@torch.no_grad()
def target_tokens(target: nn.Module, ids: list[int], start: int) -> list[int]:
    """The target's greedy token after each position from ``start`` on (full recompute)."""
    logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return [int(t) for t in logits[start:].argmax(dim=-1)]


def absorb(session: CacheSession, tokens: list[int], k: int) -> int:
    """Feed ``tokens`` to the draft in extend calls of up to K; its greedy next token."""
    outputs = None
    for i in range(0, len(tokens), k):
        outputs = session.call_outputs("extend", tokens[i : i + k])
    assert outputs is not None
    return session.choose(outputs)


# (ids, first) -> the target's greedy token after each position of ids from ``first`` on
Verifier = Callable[[list[int], int], list[int]]


def speculate(
    make_session: Callable[[], CacheSession],
    verify: Verifier,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    stats: Acceptance,
) -> list[int]:
    """Generate ``max_new_tokens`` greedily with draft depth ``k``, the target's tokens from
    ``verify`` (e.g. ``partial(target_tokens, model)``); adds to ``stats`` and returns the new
    tokens (the target's own greedy continuation)."""
    session = make_session()
    context = list(prompt)
    token = session.choose(session.prefill_outputs("prefill", context))
    new: list[int] = []
    while len(new) < max_new_tokens:
        start = len(context)
        drafted: list[int] = []
        for i in range(k):
            drafted.append(token)
            if i < k - 1:
                token = session.choose(session.call_outputs("decode", [token]))
        verified = verify(context + drafted, start - 1)  # K + 1 tokens
        stats.target_calls += 1
        stats.cycles += 1
        accepted = 0
        while accepted < k and drafted[accepted] == verified[accepted]:
            accepted += 1
        stats.trace.append((start - len(prompt), accepted))
        for i in range(k):
            if i <= accepted:
                stats.reached[i] += 1
            if i < accepted:
                stats.accepted[i] += 1
        produced = drafted[:accepted] + [verified[accepted]]
        produced = produced[: max_new_tokens - len(new)]
        new += produced
        stats.tokens += len(produced)
        context += produced
        session.rollback(start)  # the rejected drafts become stale slots
        token = absorb(session, produced, session.functions["extend"].shape.tokens)
    return new


def speedup(
    mean_accepted: float, k: int, draft_ms: float, verify_ms: float, target_ms: float
) -> dict[str, float]:
    """Predicted speed-up over the target alone from stated inputs: draft time per token
    ``draft_ms``, target time to verify K tokens ``verify_ms``, target time per token alone
    ``target_ms``. A cycle yields ``mean_accepted + 1`` tokens; sequential cycle time
    ``k * draft_ms + verify_ms``; pipelined (the next cycle's drafting overlaps verification)
    ``max(k * draft_ms, verify_ms)``."""
    tokens = mean_accepted + 1.0
    sequential = k * draft_ms + verify_ms
    pipelined = max(k * draft_ms, verify_ms)
    return {
        "sequential": tokens * target_ms / sequential,
        "pipelined": tokens * target_ms / pipelined,
    }
