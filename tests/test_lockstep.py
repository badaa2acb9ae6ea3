"""`parity.lockstep`: loops run side by side, their calls to one evaluator run together, each
loop's code in a fixed order, and a failing loop's error reaches the caller."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from parity.lockstep import Lockstep


class Counting:
    """An evaluator stand-in: ``run_many`` doubles ``x`` and counts its feeds; a state
    ``n`` counts the calls of each session."""

    def __init__(self) -> None:
        self.groups: list[int] = []

    def run(self, inputs: dict[str, np.ndarray], capture: Any = (), states: Any = None) -> Any:
        return self.run_many([inputs], capture, [states])[0]

    def run_many(self, feeds: list[dict[str, np.ndarray]], capture: Any = (),
                 states: Any = None) -> list[Any]:  # fmt: skip
        self.groups.append(len(feeds))
        out = []
        for feed, state in zip(feeds, states or [None] * len(feeds), strict=True):
            if state is not None:
                state["n"] = state["n"] + 1
            result = type("R", (), {})()
            result.outputs = {"y": 2 * feed["x"]}
            result.captured = {name: feed["x"] for name in capture}
            out.append(result)
        return out


def test_loops_run_side_by_side_and_each_gets_its_own_results() -> None:
    lockstep, evaluator, order = Lockstep(), Counting(), []

    def loop(i: int, calls: int) -> list[float]:
        state = {"n": np.zeros(())}
        got = []
        for k in range(calls):
            order.append((i, k))
            result = lockstep.call(evaluator, {"x": np.array(10.0 * i + k)}, ["x"], state)
            got.append(float(result.outputs["y"]))
            assert lockstep.lane() == i
        assert int(state["n"]) == calls
        return got

    values = lockstep.run([lambda i=i: loop(i, 3 + i) for i in range(3)])
    assert values == [[2.0 * (10 * i + k) for k in range(3 + i)] for i in range(3)]
    # Three rounds of three calls, then the longer loops alone: five runs, not twelve.
    assert evaluator.groups == [3, 3, 3, 2, 1]
    # The loops' code ran one turn each, in loop order, every round.
    assert order[:6] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_each_call_gets_only_what_it_captured() -> None:
    lockstep, evaluator = Lockstep(), Counting()

    def loop(capture: list[str]) -> set[str]:
        return set(lockstep.call(evaluator, {"x": np.ones(2)}, capture).captured)

    assert lockstep.run([lambda: loop(["x"]), lambda: loop([])]) == [{"x"}, set()]
    assert evaluator.groups == [2]


def test_outside_its_loops_a_call_simply_runs() -> None:
    lockstep, evaluator = Lockstep(), Counting()
    assert float(lockstep.call(evaluator, {"x": np.array(3.0)}).outputs["y"]) == 6.0
    assert lockstep.lane() == 0


def test_the_first_failing_loop_stops_the_others_and_its_error_is_raised() -> None:
    lockstep, evaluator, finished = Lockstep(), Counting(), []

    def loop(i: int) -> int:
        for k in range(5):
            lockstep.call(evaluator, {"x": np.array(float(k))})
            if i == 1 and k == 1:
                raise ValueError(f"loop {i} failed")
        finished.append(i)
        return i

    with pytest.raises(ValueError, match="loop 1 failed"):
        lockstep.run([lambda i=i: loop(i) for i in range(3)])
    assert finished == []  # the others were stopped, not run to their end


def test_at_most_lanes_loops_run_at_once_the_next_taking_a_free_lane() -> None:
    lockstep, evaluator = Lockstep(lanes=2), Counting()

    def loop(calls: int) -> int:
        for k in range(calls):
            lockstep.call(evaluator, {"x": np.array(float(k))})
        return calls

    assert lockstep.run([lambda n=n: loop(n) for n in (1, 3, 2)]) == [1, 3, 2]
    # Loops 0 and 1, then 1 and 2 once loop 0 has ended: never more than two calls at once.
    assert evaluator.groups == [2, 2, 2]
    with pytest.raises(ValueError, match="at least 1"):
        Lockstep(lanes=0)
