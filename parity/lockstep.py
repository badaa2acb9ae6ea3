"""Host loops run side by side, their program calls in lockstep.

The cache levels run one host loop per continuation, call after call, and every call of a
cached function reads every weight of the program: widened from fp16 and streamed from memory
once per call, for a single token's worth of arithmetic (py-spy, SmolLM2 KV: the widening alone
was 94 s of its 310 s of cache parity). Run in lockstep, the calls the loops are waiting on at
the same moment that go to the same evaluator run through `Evaluator.run_many` together: each
weight is widened once for all of them (and may still be in the CPU's cache for the next). Each
result has the bits of its own run (`run_many`'s promise), so what a loop computes does not
depend on which loops ran beside it.

A loop runs in a thread of its own only so that it can wait for its call in the middle of its
code (a session's prefill, an extend run, a rejected draft). The threads never run at once:
`Lockstep.run` hands the turn to one loop at a time, in loop order, until it waits for a call
or ends, then runs the waiting calls, one evaluator at a time, in the calling thread. So the
order in which the loops' code runs is fixed too. A loop's own findings are its own; the caller
combines them in loop order, as one loop after the other would have found them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")
# Loops live at once. Each holds its session's cache state and its call's values: SmolLM2 KV's
# six fixtures side by side ran its cache parity 1.1-1.3x faster and held 0.70 GB more than one
# after the other (bench/README.md, "SmolLM2 kv at full depth" and "cache_gates.py"); a recipe
# with many more fixtures would hold that much per six, for little more speed (run_many of
# 3 / 6 / 12 decode calls: 1.06x / 1.11x / 1.10x).
LANES = 6


class _Stopped(BaseException):
    """Raised in a waiting loop when another loop failed: it unwinds without running on."""


@dataclass
class _Call:
    evaluator: Any
    inputs: dict[str, np.ndarray]
    capture: list[str]
    states: dict[str, np.ndarray] | None
    result: Any = None


@dataclass
class _Loop(Generic[T]):
    index: int
    body: Callable[[], T]
    turn: threading.Event = field(default_factory=threading.Event)
    call: _Call | None = None
    done: bool = False
    value: T | None = None
    error: BaseException | None = None


class Lockstep:
    """Runs loops side by side (`run`), at most ``lanes`` at once; inside a loop, `call`
    stands for ``evaluator.run``."""

    def __init__(self, lanes: int = LANES) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, not {lanes}")
        self.lanes = lanes
        self._local = threading.local()  # the loop whose thread is running
        self._back = threading.Event()  # set by a loop when it waits for a call or ends
        self._stopping = False

    def lane(self) -> int:
        """The index of the loop running now (0 outside `run`): for what a loop keeps of its
        own in an object the loops share."""
        loop: _Loop[Any] | None = getattr(self._local, "loop", None)
        return loop.index if loop is not None else 0

    def call(
        self,
        evaluator: Any,
        inputs: dict[str, np.ndarray],
        capture: Iterable[str] = (),
        states: dict[str, np.ndarray] | None = None,
    ) -> Any:
        """``evaluator.run(inputs, capture, states)``, run beside the other loops' waiting
        calls to the same evaluator; outside `run`'s loops, simply run."""
        loop: _Loop[Any] | None = getattr(self._local, "loop", None)
        if loop is None:
            return evaluator.run(inputs, capture=capture, states=states)
        loop.call = _Call(evaluator, inputs, list(capture), states)
        self._wait(loop)
        result, loop.call = loop.call.result, None
        return result

    def run(self, bodies: Sequence[Callable[[], T]]) -> list[T]:
        """Each of ``bodies`` run to its end, their calls in lockstep; their values in order.
        The first ``lanes`` start at once, each later one when a lane is free. The first loop
        (in order) that raises stops the others, and its error is raised."""
        loops = [_Loop(i, body) for i, body in enumerate(bodies)]
        threads = [threading.Thread(target=self._thread, args=(loop,), daemon=True)
                   for loop in loops]  # fmt: skip
        for thread in threads:
            thread.start()
        try:
            pending, live = list(loops), list[_Loop[T]]()
            while True:
                for loop in live:  # one turn each, in order
                    self._turn(loop)
                live = [loop for loop in live if not loop.done]
                while pending and len(live) < self.lanes:  # the next loops take the free lanes
                    loop = pending.pop(0)
                    self._turn(loop)
                    live += [] if loop.done else [loop]
                failed = next((loop for loop in loops if loop.error is not None), None)
                if failed is not None:
                    assert failed.error is not None
                    raise failed.error
                if not live:
                    break
                self._run_waiting(live)
        finally:
            self._stopping = True
            for loop in loops:
                loop.turn.set()
            for thread in threads:
                thread.join()
        return [loop.value for loop in loops]  # type: ignore[misc]

    def _turn(self, loop: _Loop[Any]) -> None:
        """Let ``loop`` run until it waits for a call or ends."""
        self._back.clear()
        loop.turn.set()
        self._back.wait()

    def _thread(self, loop: _Loop[Any]) -> None:
        self._local.loop = loop
        try:
            loop.turn.wait()
            if self._stopping:
                return
            loop.value = loop.body()
        except _Stopped:
            return
        except BaseException as e:  # handed to `run`, which raises it in the caller
            loop.error = e
        loop.done = True
        self._back.set()

    def _wait(self, loop: _Loop[Any]) -> None:
        """Give the turn back and wait for the next."""
        loop.turn.clear()
        self._back.set()
        loop.turn.wait()
        if self._stopping:
            raise _Stopped

    @staticmethod
    def _run_waiting(loops: list[_Loop[Any]]) -> None:
        """Every waiting call, grouped by evaluator (in the order the loops wait on them)."""
        groups: dict[int, list[_Call]] = {}
        for loop in loops:
            assert loop.call is not None  # a live loop that gave its turn back waits on a call
            groups.setdefault(id(loop.call.evaluator), []).append(loop.call)
        for calls in groups.values():
            evaluator = calls[0].evaluator
            # Each call may capture other values: capture the union, return each its own.
            capture = list(dict.fromkeys(name for c in calls for name in c.capture))
            results = evaluator.run_many([c.inputs for c in calls], capture,
                                         [c.states for c in calls])  # fmt: skip
            for c, result in zip(calls, results, strict=True):
                result.captured = {k: v for k, v in result.captured.items() if k in c.capture}
                c.result = result


def run_loops(bodies: Sequence[Callable[[], T]], lockstep: Lockstep | None) -> list[T]:
    """``bodies`` side by side through ``lockstep`` (the one their calls go through), or with
    None one after the other in the calling thread; their values in order."""
    return lockstep.run(bodies) if lockstep is not None else [body() for body in bodies]
