"""``anec generate --check``'s verdict (parity.reference): every greedy step before the
reference's first near tie (top-1 - top-2 logit below 0.05) must match; past it, either token
is a valid pick, so a difference there is reported, not failed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_hf_model

from parity.fixtures import Fixture
from parity.reference import (
    NEAR_TIE,
    SpilledRows,
    check_greedy,
    continuation,
    greedy_ids,
    greedy_steps,
)

WIDE, TIE = 1.0, NEAR_TIE / 2


def test_every_step_matching_without_a_near_tie_passes() -> None:
    checked = check_greedy([5, 6, 7], [(5, WIDE), (6, WIDE), (7, WIDE)])
    assert (checked.matched, checked.first_near_tie, checked.passed) == (3, None, True)


def test_a_difference_at_or_after_the_first_near_tie_passes_and_is_reported() -> None:
    at_tie = check_greedy([5, 9, 7], [(5, WIDE), (6, TIE), (7, WIDE)])
    after = check_greedy([5, 6, 9], [(5, WIDE), (6, TIE), (7, WIDE)])
    assert (at_tie.matched, at_tie.first_near_tie, at_tie.passed) == (1, 1, True)
    assert (after.matched, after.passed) == (2, True)


def test_a_difference_before_the_first_near_tie_fails() -> None:
    checked = check_greedy([9, 6, 7], [(5, WIDE), (6, WIDE), (7, TIE)])
    assert (checked.matched, checked.first_near_tie, checked.passed) == (0, 2, False)
    assert not check_greedy([5, 9], [(5, WIDE), (6, WIDE)]).passed  # no tie at all


def test_a_gap_of_exactly_the_threshold_is_not_a_near_tie() -> None:
    assert check_greedy([5], [(5, NEAR_TIE)]).first_near_tie is None


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="2 generated steps against 1 reference"):
        check_greedy([5, 6], [(5, WIDE)])


def test_greedy_steps_gives_the_greedy_tokens_and_their_gaps_by_full_recompute() -> None:
    model = tiny_hf_model("llama")
    prompt = (1, 2, 3, 4)
    steps = greedy_steps(model, prompt, 6)
    assert [t for t, _ in steps] == greedy_ids(model, prompt, 6)
    ids = list(prompt) + [t for t, _ in steps]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    top2 = logits[len(prompt) - 1 : -1].topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    assert [g for _, g in steps] == pytest.approx(gaps, abs=1e-4)


def test_a_continuation_reads_back_the_full_recompute_logits_bit_for_bit() -> None:
    # The reference rows live in a temporary file (parity.reference.SpilledRows): what
    # the cache gates read must be the recompute's own fp32 values.
    model = tiny_hf_model("llama")
    fixture = Fixture("f", (1, 2, 3, 4), "padded")
    c = continuation(model, fixture, 5)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([c.ids]), use_cache=False).logits[0].numpy()
    for position in range(len(fixture.token_ids) - 1, len(c.ids)):
        assert np.array_equal(c.reference(position), logits[position])
    with pytest.raises(IndexError, match="row 6 of 6 logit rows"):
        c.logits[6]


def test_spilled_rows_keep_appended_rows_exactly_and_refuse_other_shapes() -> None:
    rows = SpilledRows.of(np.arange(6, dtype=np.float32).reshape(2, 3))
    half = np.array([0.1, -65504.0, 6e-8], np.float16)  # fp16 rows come back exact
    rows.append(half)
    assert np.array_equal(rows[1], [3, 4, 5]) and len(rows) == 3
    assert np.array_equal(rows[-1], half.astype(np.float32))
    with pytest.raises(ValueError, match=r"must be 2-D \(positions, vocabulary\), not \(6,\)"):
        SpilledRows.of(np.zeros(6, np.float32))
    with pytest.raises(ValueError, match=r"width 3, not shape \(4,\)"):
        rows.append(np.zeros(4, np.float32))
