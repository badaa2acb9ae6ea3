"""The loop model (`converter.drafts.loop_model`) on hand-computed cases."""

from __future__ import annotations

import pytest

from converter.drafts.loop_model import LoopCosts, best, predict


def test_the_seed_engines_ratio_sequential_unmerged_and_pipelined() -> None:
    # Inputs chosen to reproduce the ratio the seed engine reported (0.61x sequential and
    # unmerged, above 1x once pipelined), not its measurements. K = 1: no decode call, one
    # extend call (ceil(2 / 4) = 1) of 6.23 ms; 1.6 tokens a cycle.
    costs = LoopCosts(decode_ms=5.0, extend_ms=6.23, extend_tokens=4, verify_ms=10.0,
                      target_ms=10.0)  # fmt: skip
    unmerged = predict(1, 0.6, costs, merged=False)
    assert unmerged.verify_ms_per_cycle == 20.0  # two one-token target calls
    assert unmerged.sequential_ms == pytest.approx(26.23)
    assert unmerged.sequential_speedup == pytest.approx(1.6 * 10 / 26.23)  # 0.610x
    assert round(unmerged.sequential_speedup, 2) == 0.61
    merged = predict(1, 0.6, costs)
    assert merged.pipelined_ms == 10.0  # max(6.23, 10)
    assert merged.pipelined_speedup == pytest.approx(1.6)  # 160 tokens/s against 100
    assert merged.target_tokens_per_s == 100.0


def test_a_deep_cycle_pays_its_decodes_and_two_extend_calls() -> None:
    # K = 4, E = 4: 3 decodes of 2 ms, ceil(5 / 4) = 2 extends of 3 ms: 12 ms of drafting;
    # merged verify 15 ms; 2.5 accepted: 3.5 tokens a cycle.
    costs = LoopCosts(2.0, 3.0, 4, verify_ms=15.0, target_ms=12.0)
    p = predict(4, 2.5, costs)
    assert p.draft_ms_per_cycle == 12.0 and p.verify_ms_per_cycle == 15.0
    assert p.sequential_ms == 27.0 and p.pipelined_ms == 15.0
    assert p.sequential_tokens_per_s == pytest.approx(3500 / 27)
    assert p.pipelined_speedup == pytest.approx(3.5 * 12 / 15)  # 2.8x
    doc = p.to_json()
    assert doc["evidence"] == "predicted" and "pipelined = max(draft, verify)" in doc["formula"]


def test_best_takes_the_fastest_and_the_smaller_k_on_a_tie() -> None:
    costs = LoopCosts(1.0, 1.0, 8, verify_ms=10.0, target_ms=10.0)
    # every K's draft (K - 1 + 1 ms) stays under the 10 ms verify: pipelined is verify-bound,
    # so the speed-up is the tokens per cycle
    ps = [predict(1, 0.5, costs), predict(2, 1.0, costs), predict(3, 1.0, costs)]
    assert best(ps, pipelined=True).k == 2  # 2.0 tokens, tied with K = 3
    assert best(ps, pipelined=False).k == 2  # sequential: 2 / 12 ms beats 2 / 13 ms
    with pytest.raises(ValueError, match="no predictions"):
        best([], pipelined=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 0.0), "k 0"),
        ((2, 2.5), "mean_accepted 2.5: expected 0..2"),
        ((2, -0.1), "mean_accepted -0.1"),
    ],
)
def test_bad_loop_inputs_are_refused_by_name(args: tuple[int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        predict(*args, LoopCosts(1.0, 1.0, 4, 1.0, 1.0))


@pytest.mark.parametrize("field", ["decode_ms", "extend_ms", "verify_ms", "target_ms"])
def test_a_time_must_be_above_zero(field: str) -> None:
    values = {"decode_ms": 1.0, "extend_ms": 1.0, "extend_tokens": 4, "verify_ms": 1.0,
              "target_ms": 1.0, field: 0.0}  # fmt: skip
    with pytest.raises(ValueError, match=field):
        LoopCosts(**values)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extend_tokens"):
        LoopCosts(1.0, 1.0, 0, 1.0, 1.0)
