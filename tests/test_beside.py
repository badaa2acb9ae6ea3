"""`parity.beside`: work in a forked child gives back what it would give here (its value,
its progress, its error with its type and attributes), and a child that dies or is no longer
wanted never leaves the caller waiting."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import pytest

import converter.pipeline.beside as beside_module
from converter.pipeline.beside import ChildEnded, beside, can_fork
from converter.pipeline.steps import Advance
from parity.mil.errors import OpEvaluationError

needs_fork = pytest.mark.skipif(not can_fork(), reason="runs in a child on Linux, 2+ cores")


def counting(steps: int) -> Callable[[Advance], tuple[list[int], int]]:
    def work(advance: Advance) -> tuple[list[int], int]:
        for _ in range(steps):
            advance()
        return list(range(steps)), os.getpid()

    return work


@needs_fork
def test_the_childs_value_and_progress_reach_the_caller() -> None:
    ticks: list[int] = []
    pending = beside(counting(5), lambda: ticks.append(1), "counting")
    value, pid = pending.result()
    assert value == [0, 1, 2, 3, 4]
    assert pid != os.getpid()  # it ran beside this process
    assert len(ticks) == 5
    assert pending.peak_bytes > 0 and pending.shared_bytes > 0


def test_without_fork_the_work_runs_here_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(beside_module, "can_fork", lambda: False)
    ticks: list[int] = []
    pending = beside(counting(3), lambda: ticks.append(1), "counting")
    assert len(ticks) == 3  # done before `beside` returned
    value, pid = pending.result()
    assert value == [0, 1, 2] and pid == os.getpid()


def failing(advance: Advance) -> None:
    raise OpEvaluationError("conv", "layer_3_conv", "shape (1, 2) against (1, 3)")


@pytest.mark.parametrize("fork", [True, False])
def test_an_error_keeps_its_type_message_and_attributes(
    monkeypatch: pytest.MonkeyPatch, fork: bool
) -> None:
    if fork and not can_fork():
        pytest.skip("needs fork")
    monkeypatch.setattr(beside_module, "can_fork", lambda: fork)
    pending = beside(failing, lambda: None, "failing")
    with pytest.raises(OpEvaluationError, match="layer_3_conv.*against") as raised:
        pending.result()
    assert raised.value.op_type == "conv" and raised.value.op_name == "layer_3_conv"
    if fork:
        assert "in the child process" in "\n".join(raised.value.__notes__)


@needs_fork
def test_a_child_that_dies_is_an_error_naming_the_work_and_the_signal() -> None:
    def dies(advance: Advance) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(ChildEnded, match="the dying work: .*signal 9 .*out of memory"):
        beside(dies, lambda: None, "the dying work").result()


@needs_fork
def test_cancel_stops_a_child_still_running() -> None:
    def sleeps(advance: Advance) -> None:
        time.sleep(60)

    pending = beside(sleeps, lambda: None, "sleeping")
    start = time.perf_counter()
    pending.cancel()
    assert time.perf_counter() - start < 10
    with pytest.raises(ChildEnded, match="signal 15"):
        pending.result()


@needs_fork
def test_the_childs_log_records_reach_this_processs_handlers() -> None:
    """The conversion log is this process's memory: a child's records must reach it."""
    logger = logging.getLogger("anec.test.beside")
    kept = _Keep()
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    try:

        def logs(advance: Advance) -> int:
            logger.info("fixture %s: %d calls", "prompt[0]", 512)
            logger.debug("below the logger's level: never sent")
            try:
                raise ValueError("a kernel's complaint")
            except ValueError:
                logger.exception("a caught error")
            return os.getpid()

        pid = beside(logs, lambda: None, "logging").result()
    finally:
        logger.removeHandler(kept)
    assert pid != os.getpid()
    assert [r.getMessage() for r in kept.records] == ["fixture prompt[0]: 512 calls",
                                                      "a caught error"]  # fmt: skip
    assert "ValueError: a kernel's complaint" in (kept.records[1].exc_text or "")
    assert kept.records[0].process == pid


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
