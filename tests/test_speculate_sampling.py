"""Acceptance under sampling (``converter.drafts.speculation``): the exact per-position probability,
the expected-cycles estimator (`replay`'s counts at T = 0, exactly) and its agreement with a
Monte-Carlo run of real speculative sampling (Leviathan et al. 2023) on a tiny model."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from tiny_models import Tiny, build_tiny, one_torch_thread, perturbed_copy

from converter.compression.variant_acceptance import AcceptanceSetup, session
from converter.drafts.speculation import (
    Acceptance,
    acceptance_probability,
    expected_replay,
    replay,
    sampling_alphas,
    target_sample,
)
from parity.kv_session import CacheSession

K, NEW = 3, 16
PROMPTS = [[7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_estimator_at_zero_or_one_is_the_greedy_replay(k: int) -> None:
    rng = np.random.default_rng(k)
    for _ in range(20):
        agree = list(rng.random(40 + k - 1) < 0.7)
        greedy, expected = Acceptance(k), Acceptance(k)
        replay(agree, 40, k, greedy)
        expected_replay([float(a) for a in agree], 40, k, expected)
        assert (expected.reached, expected.accepted) == (greedy.reached, greedy.accepted)
        assert (expected.cycles, expected.tokens) == (greedy.cycles, greedy.tokens)
        assert expected.mean_accepted == greedy.mean_accepted


def test_the_estimator_sums_the_chain_of_acceptances_by_hand() -> None:
    # K = 2 over 2 new tokens, alpha 0.5 everywhere. A cycle at index t accepts 0 drafts
    # (p 0.5), 1 (0.25) or 2 (0.25). The cycle at 0 (weight 1) is followed by one at 1 only
    # when it accepted none (weight 0.5), which counts its drafts as `replay` does, though the
    # output is cut at 2 tokens. Reached: [1 + 0.5, 0.5 + 0.25]; accepted: [0.5 + 0.25,
    # 0.25 + 0.125]; cycles 1.5; mean accepted 1.125 / 1.5 = 0.75; tokens: 0.5 * 1 + 0.5 * 2
    # (cut at 2) + 0.5 * 1 = 2.
    stats = Acceptance(2)
    expected_replay([0.5, 0.5, 0.5], 2, 2, stats)
    assert stats.reached == [1.5, 0.75] and stats.accepted == [0.75, 0.375]
    assert stats.cycles == 1.5 and stats.tokens == 2.0 and stats.mean_accepted == 0.75


def test_the_acceptance_probability_is_one_minus_the_total_variation() -> None:
    target = np.log(np.array([0.5, 0.3, 0.2]))
    draft = np.log(np.array([0.2, 0.3, 0.5]))
    assert acceptance_probability(draft, target, 1.0) == pytest.approx(0.2 + 0.3 + 0.2)
    assert acceptance_probability(target, target, 0.7) == pytest.approx(1.0)
    # A trimmed head keeps ids 0 and 2: the target's mass on id 1 is rejection.
    kept = np.log(np.array([0.6, 0.4]))
    assert acceptance_probability(kept, target, 1.0, np.array([0, 2])) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="T > 0"):
        acceptance_probability(draft, target, 0.0)


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return build_tiny("llama", batch=1)


def _softmax(x: np.ndarray, t: float) -> np.ndarray:
    z = np.asarray(x, np.float64) / t
    e = np.exp(z - z.max())
    return e / e.sum()


@torch.no_grad()
def _speculative_sampling(
    make: Callable[[], CacheSession], target: torch.nn.Module, prompt: list[int], t: float,
    rng: np.random.Generator,
) -> list[int]:  # fmt: skip
    """Real speculative sampling (the test's oracle): the draft samples K tokens, the target
    accepts each with min(1, p/q), resamples the residual on a rejection and adds a bonus
    token after K acceptances. Returns the drafts accepted per cycle."""
    s = make()
    context, out, accepted = list(prompt), 0, []
    q_logits = s.prefill("prefill", context)
    while out < NEW:
        start, drafts, qs = len(context), [], []
        q = _softmax(q_logits, t)
        for i in range(K):
            drafts.append(int(rng.choice(q.size, p=q)))
            qs.append(q)
            if i < K - 1:
                q = _softmax(s.call("decode", [drafts[-1]])[:, -1], t)
        rows = target(input_ids=torch.tensor([context + drafts]), use_cache=False).logits[0]
        p = [_softmax(r, t) for r in rows[start - 1 : start + K].double().numpy()]
        a = 0
        while a < K and rng.random() < min(1.0, p[a][drafts[a]] / qs[a][drafts[a]]):
            a += 1
        rest = np.maximum(p[a] - qs[a], 0.0) if a < K else p[K]
        produced = (drafts[:a] + [int(rng.choice(rest.size, p=rest / rest.sum()))])[: NEW - out]
        accepted.append(a)
        out += len(produced)
        context += produced
        s.rollback(start)
        for i in range(0, len(produced), K):
            q_logits = s.call("extend", produced[i : i + K])[:, -1]
    return accepted


def _ratio_interval(a: np.ndarray, c: np.ndarray, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, len(a), len(a)) for _ in range(1000)]
    ratios = [a[i].sum() / c[i].sum() for i in picks]
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def test_the_estimator_agrees_with_real_speculative_sampling(tiny: Tiny) -> None:
    # Measured when written (150 runs a prompt, T = 1.0): MC 1.301 [1.252, 1.353], estimator
    # 1.285; T = 0.7: MC 0.840 [0.801, 0.882], estimator 0.868.
    setup = AcceptanceSetup([K], PROMPTS, NEW + K + 8)
    draft = perturbed_copy(tiny.module, 0.5)

    def make() -> CacheSession:
        return session(draft, setup, tiny.embed_table, K + 1)

    rng = np.random.default_rng(0)
    runs = [_speculative_sampling(make, tiny.model, p, 1.0, rng) for _ in range(100)
            for p in PROMPTS]  # fmt: skip
    low, high = _ratio_interval(np.array([sum(r) for r in runs], float),
                                np.array([len(r) for r in runs], float), 1)  # fmt: skip
    accepted, cycles = 0.0, 0.0
    for seed in range(100):
        for p in PROMPTS:
            stats = Acceptance(K)
            sample = target_sample(tiny.model, p, NEW + K - 1, 1.0, seed)
            expected_replay(sampling_alphas(make, p, sample, 1.0), NEW, K, stats)
            accepted, cycles = accepted + sum(stats.accepted), cycles + stats.cycles
    estimate = accepted / cycles
    assert low <= estimate <= high, (estimate, low, high)
    assert 0.3 < estimate < K - 0.3  # neither side of the comparison is trivial here
