"""Greedy speculative decoding: a cached draft artifact proposes, a transformers target verifies.

One cycle with depth K: the draft proposes K tokens one ``decode`` call at a time; the target
runs the context plus the K drafts once (a full recompute, fp32) and takes its own greedy token
at each of the K + 1 positions; the longest prefix of drafts equal to the target's tokens is
accepted, followed by the target's token after it (a correction, or a bonus token when all K
were accepted). The draft then rolls back to the start of the cycle (the manifest's rollback
convention) and absorbs the accepted tokens and the target's token with ``extend`` calls. The
output is exactly the target's greedy continuation.

Figures: acceptance per draft position (accepted / reached), mean accepted drafts per cycle,
tokens per target call. The loop's speed is predicted apart (`converter.drafts.loop_model`).

Under sampling at temperature T > 0 (speculative sampling: Leviathan et al. 2023, Chen et al.
2023) a drafted token is accepted with probability ``alpha = sum_x min(p_T(x), q_T(x))``, one
minus the total-variation distance of the target's and the draft's distributions at that
position, which the logits give exactly (`acceptance_probability`). The estimator
(`expected_replay`): per text, the target's own continuation sampled at T (`target_sample`,
seeded, computed once per target and shared by its drafts); alpha at each of its positions
from the draft's logits after the same prefix (teacher-forced in ``extend`` calls,
`draft_logits`); then the expected counts of the cycles, a cycle at index t accepting its
j-th draft with probability ``alpha_t * ... * alpha_(t+j-1)`` (each acceptance judged at the
target's sampled context, not at the accepted draft's: an approximation the tests compare
with real speculative sampling). At T = 0 it is `replay`, exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from graph_passes.logits_layout import chunk_names, join_logits
from parity.kv_session import CacheSession

# Held-out, human-written text (not the recipes' fixtures or held-out sets): prompts whose
# continuations the draft and the target both generate.
TEXTS = (
    "The old lighthouse keeper climbed the stairs every evening at dusk, carrying a lamp and a",
    "When the bakery on the corner closed for good, the neighbours gathered outside to",
    "To repot a houseplant, first water it the day before, then gently loosen the roots and",
    "The museum's new exhibition traces the history of printing from woodblocks to",
    "My grandmother kept every letter she ever received in a tin box under her bed, and when",
    "The train was forty minutes late, so the passengers on the cold platform began to",
    "Before you paint a wooden fence, scrape off the loose flakes, wash the boards and let",
    "Nobody in the village could remember who had planted the enormous oak tree by the river,",
)


@dataclass
class Acceptance:
    """What a speculative run measured for one depth K."""

    k: int
    # Counts; expected counts (floats) under sampling (`expected_replay`).
    reached: list[float] = field(default_factory=list)  # cycles that reached draft position i
    accepted: list[float] = field(default_factory=list)  # of those, cycles that accepted it
    cycles: float = 0
    target_calls: float = 0
    tokens: float = 0
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


def expected_replay(alpha: Sequence[float], new_tokens: int, k: int, stats: Acceptance) -> None:
    """`replay` under sampling: the expected counts of speculative cycles with depth ``k``
    over a continuation whose draft at index i is accepted with probability ``alpha[i]``
    (`acceptance_probability`), added to ``stats``. A cycle starts at index t with the
    probability ``start[t]`` the cycles before it give; it reaches draft j when drafts
    t..t+j-1 were accepted (the product of their alphas) and ends after A accepted drafts and
    the target's token, so the next starts at t + A + 1. With every alpha 0 or 1 these are
    `replay`'s counts, exactly."""
    if len(alpha) < new_tokens + k - 1:
        raise ValueError(f"alpha covers {len(alpha)} indices, need {new_tokens + k - 1}")
    start = [0.0] * (new_tokens + k + 1)
    start[0] = 1.0
    for t in range(new_tokens):
        w = start[t]
        if w == 0.0:
            continue
        stats.cycles += w
        stats.target_calls += w
        survive = 1.0  # P(A >= j)
        for j in range(k + 1):
            beyond = survive * alpha[t + j] if j < k else 0.0  # P(A >= j + 1)
            if j < k:
                stats.reached[j] += w * survive
                stats.accepted[j] += w * beyond
            ends = w * (survive - beyond)  # P(A = j)
            stats.tokens += ends * min(j + 1, new_tokens - t)
            start[t + j + 1] += ends
            survive = beyond


def acceptance_probability(
    draft: np.ndarray, target: np.ndarray, temperature: float, head_ids: np.ndarray | None = None
) -> float:
    """``sum_x min(p_T(x), q_T(x))``: the probability that speculative sampling at
    ``temperature`` (> 0) accepts the draft's token, from the draft's logits (its head's rows;
    ``head_ids``: a trimmed head's token id per row, else row j is token j) and the target's
    (every token id). Ids the draft cannot propose have draft mass 0, so the target's mass on
    them is rejection; ids beyond the target's vocabulary, target mass 0."""
    if not temperature > 0:
        raise ValueError(f"temperature {temperature}: sampling acceptance needs T > 0")
    p = _softmax(target, temperature)
    q = _softmax(draft, temperature)
    ids = np.arange(q.size) if head_ids is None else np.asarray(head_ids)
    inside = ids < p.size
    return float(np.minimum(p[ids[inside]], q[inside]).sum())


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


@torch.no_grad()
def sampled_ids(
    model: nn.Module, prompt: list[int], steps: int, temperature: float, seed: int
) -> list[int]:
    """The target's continuation of ``prompt`` sampled at ``temperature`` (plain softmax
    sampling, no top-k or top-p), from its own torch generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    new: list[int] = []
    for i in range(steps):
        probs = torch.softmax(out.logits[0, -1].double() / temperature, dim=-1)
        new.append(int(torch.multinomial(probs, 1, generator=generator)))
        if i < steps - 1:
            out = model(input_ids=torch.tensor([[new[-1]]]), cache=out.cache, use_cache=True)
    return new


@dataclass(frozen=True)
class TargetSample:
    """The target's continuation of one prompt sampled at one temperature (`sampled_ids`)
    and its logits after each prefix: what every draft of that target is judged against."""

    ids: list[int]
    logits: np.ndarray = field(repr=False)  # (len(ids), V) fp32: after prompt + ids[:i]


@torch.no_grad()
def target_sample(
    model: nn.Module, prompt: list[int], steps: int, temperature: float, seed: int
) -> TargetSample:
    """``steps`` tokens of the target's continuation sampled at ``temperature`` (seeded), with
    its logits at each of them (one full fp32 recompute)."""
    cont = sampled_ids(model, prompt, steps, temperature, seed)
    logits = model(input_ids=torch.tensor([prompt + cont]), use_cache=False).logits[0]
    return TargetSample(cont, logits[len(prompt) - 1 : len(prompt) - 1 + steps].float().numpy())


def forced_calls(
    session: CacheSession, prompt: list[int], cont: list[int]
) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """The draft teacher-forced along ``cont`` from a fresh ``session``: each call's outputs
    and how many of its last positions are new, together the draft's outputs after
    ``prompt + cont[:i]`` for every i. The prompt is prefilled (its last position: i = 0),
    then ``cont[:-1]`` fed in ``extend`` calls of the function's T tokens where it returns
    every position (an artifact's does: the function the loop absorbs accepted tokens with,
    T times fewer calls than one ``decode`` per token), else one ``decode`` call per token.
    The context must fit the cache (no eviction)."""
    capacity = session.functions["prefill"].shape.cache_length
    if len(prompt) + len(cont) > capacity:
        raise ValueError(f"{len(prompt)} + {len(cont)} tokens exceed the {capacity}-slot cache")
    yield session.prefill_outputs("prefill", prompt), 1
    extend = session.functions.get("extend")
    function = "extend" if extend is not None and extend.logits == "all" else "decode"
    t = session.functions[function].shape.tokens
    fed = cont[:-1]
    for i in range(0, len(fed), t):
        chunk = fed[i : i + t]
        yield session.call_outputs(function, chunk), len(chunk)


def draft_logits(session: CacheSession, prompt: list[int], cont: list[int]) -> Iterator[np.ndarray]:
    """The draft's logits (its head's rows) after ``prompt + cont[:i]`` for every i
    (`forced_calls`). A draft whose head returns its choice instead of logits (argmax, top-k)
    cannot say its distribution: ValueError."""
    for outputs, n in forced_calls(session, prompt, cont):
        if not chunk_names(outputs):
            raise ValueError(
                "the draft returns " + ", ".join(sorted(outputs)) + ", not logits: sampling "
                "acceptance needs the draft's distribution (convert with io.output: logits)"
            )
        yield from join_logits(outputs)[0, -n:]


def sampling_alphas(
    make_session: Callable[[], CacheSession],
    prompt: list[int],
    sample: TargetSample,
    temperature: float,
) -> list[float]:
    """The acceptance probability at each index of the target's sampled continuation
    ``sample`` (`target_sample`, at ``temperature``): the estimator's input (module
    docstring)."""
    session = make_session()
    return [
        acceptance_probability(d, t, temperature, session.head_ids)
        for d, t in zip(draft_logits(session, prompt, sample.ids), sample.logits, strict=True)
    ]


def draft_agreement(
    make_session: Callable[[], CacheSession], prompt: list[int], cont: list[int]
) -> list[bool]:
    """Whether the draft's greedy token after ``prompt + cont[:i]`` is ``cont[i]``, for every
    i (`forced_calls`), for `replay`."""
    session = make_session()
    chosen = [
        token
        for outputs, n in forced_calls(session, prompt, cont)
        for token in session.choices(outputs, n)
    ]
    return [a == b for a, b in zip(chosen, cont, strict=True)]


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
