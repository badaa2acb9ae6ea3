"""The mixed-bit search picks the smallest measured plan that meets its budget."""

from __future__ import annotations

from converter.compress.search import Point, smallest_meeting


def _point(step: int | None, size: int, ok: bool, uniform: int | None = None) -> Point:
    return Point(step, size, 0.0, 0.0, 1.0 if ok else 0.0, ok, uniform_bits=uniform)


def test_a_uniform_plan_off_the_path_wins_when_it_is_smaller() -> None:
    # As measured on SmolLM2: the path's best plan (4 fp16, 5 lut6, 111 lut8 weights) was
    # larger than uniform lut8, which also met the budget.
    path = [_point(0, 200, True), _point(30, 103, True), _point(31, 102, False)]
    uniform = [_point(None, 101, True, 8), _point(None, 76, False, 6)]
    assert smallest_meeting(path + uniform).uniform_bits == 8


def test_a_path_plan_wins_over_a_larger_uniform_one_and_failing_plans_never_win() -> None:
    path = [_point(0, 200, True), _point(12, 90, True), _point(13, 60, False)]
    uniform = [_point(None, 101, True, 8), _point(None, 50, False, 4)]
    chosen = smallest_meeting(path + uniform)
    assert chosen.step == 12 and chosen.uniform_bits is None
