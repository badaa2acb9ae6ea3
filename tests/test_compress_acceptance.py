"""A variant's acceptance as a speculative draft (``compress.acceptance``): the session-based
verifier yields the target's own greedy continuation whatever the draft proposes, a draft equal
to the target is accepted everywhere, and a perturbed draft measurably less."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny, perturbed_copy

from converter.compression.variant_acceptance import (
    AcceptanceSetup,
    SessionVerifier,
    acceptance_json,
    draft_acceptance,
    session,
)
from converter.drafts.speculation import Acceptance, speculate
from parity.reference import greedy_ids

PROMPTS = [[7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return build_tiny("llama", batch=1)


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_speculation_reproduces_the_target_greedy_continuation(tiny, scale: float) -> None:  # type: ignore[no-untyped-def]
    setup = AcceptanceSetup([3], PROMPTS, 12)
    draft = perturbed_copy(tiny.module, scale)
    for prompt in PROMPTS:
        stats = Acceptance(3)
        verifier = SessionVerifier(session(tiny.module, setup, tiny.embed_table, 4))
        make = lambda: session(draft, setup, tiny.embed_table, 4)  # noqa: E731
        new = speculate(make, verifier, prompt, 3, 12, stats)
        assert new == greedy_ids(tiny.model, tuple(prompt), 12)
        assert stats.tokens == 12 and stats.target_calls == stats.cycles


def test_acceptance_is_measured_per_position(tiny) -> None:  # type: ignore[no-untyped-def]
    setup = AcceptanceSetup([1, 4], PROMPTS, 16)
    same = draft_acceptance(tiny.module, tiny.module, tiny.embed_table, setup)
    assert [s.k for s in same] == [1, 4]
    assert all(s.rate(i) == 1.0 for s in same for i in range(s.k))
    # every draft accepted: 5 tokens per cycle, 16 per prompt in ceil(16 / 5) = 4 cycles
    assert same[1].cycles == 8 and same[1].tokens_per_call == 4.0
    worse = draft_acceptance(perturbed_copy(tiny.module, 0.5), tiny.module, tiny.embed_table, setup)
    assert worse[1].mean_accepted < same[1].mean_accepted
    doc = acceptance_json(worse, setup)
    assert doc["prompts"] == 2 and [d["k"] for d in doc["depths"]] == [1, 4]
    assert "not a device" in doc["evidence"]
