"""The MIL level, one entry point for every model kind: `run_mil_level`.

A subject (a window decoder, an encoder, a decision island and tail, a cached decoder's
functions) says how its emitted program(s) run in the evaluator: in the fp32 profile against
its fp64 baseline (`MilSubject.fp32`: the `Pair`s gathered in one `Fp32Check`), with its own
fp32-profile gates if it has any (a decision tail's gather, the fp32 cache level), and in the
fp16 profile(s) against the reference (`MilSubject.fp16`: their gates). The level is the same
for each: the markers gate and the fp32 gate (`parity.mil_fp32.level_gates`), the subject's
own, then the fp16 gates. A program the evaluator cannot prepare fails the markers gate and
the level stops there: a failed gate, never "not run".

The fp32 part and the fp16 part share only what is loaded, so a caller may run the first
beside the second (``start``: a cached decoder's levels, on a host with a second core,
`converter.pipeline.beside`); the gates and their order are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from graph_passes.markers import MarkerError
from parity.gate_registry import GateResult
from parity.mil.errors import MILError
from parity.mil_fp32 import Fp32Check, level_gates

Progress = Callable[[], None]
# Why a program cannot be run: an op without a kernel, a subject that needs its markers.
CANNOT_RUN = (MILError, MarkerError)


@dataclass(frozen=True)
class Fp32Run:
    """What the fp32 profile's run found."""

    check: Fp32Check | None  # None: the fp32 profile was not asked for
    detail: str = ""  # what the fp32 gate compared
    problem: str = ""  # a layer's output the program lost (no layer compared), else ""
    found: str = ""  # what the markers gate says when nothing was lost


@dataclass(frozen=True)
class MilSubject:
    """One model kind's emitted program(s) as the MIL level runs them. ``fp32`` and ``more``
    are given the progress callable to tick (a child's, when they run beside)."""

    fp32: Callable[[Progress], Fp32Run]  # raises one of `CANNOT_RUN` when it cannot run
    fp16: Callable[[], list[GateResult]]  # the fp16 profile(s)' gates
    threshold: float  # mil_fp32_layer_rel_error's
    more: Callable[[Progress], list[GateResult]] = lambda progress: []  # own fp32 gates


class Waiting(Protocol):
    """Work started elsewhere (`converter.pipeline.beside.Pending` is one)."""

    def result(self) -> Any:
        """Its value, or its error raised here."""

    def cancel(self) -> None:
        """Stop it."""


Start = Callable[[Callable[[Progress], Any]], Waiting]


@dataclass(frozen=True)
class MilLevel:
    """The level's gates, its fp32 check; or why it could not run."""

    fp32_gates: list[GateResult]  # the markers gate, the fp32 gate, the subject's own
    fp16_gates: list[GateResult]
    fp32: Fp32Check | None
    error: str = ""  # why the evaluator cannot run the program(s)

    @property
    def gates(self) -> list[GateResult]:
        """Every gate, in report order."""
        return self.fp32_gates + self.fp16_gates

    @property
    def layer_rel_error(self) -> list[float]:
        """Each layer's worst fp32 error (none when the fp32 profile did not run)."""
        return self.fp32.layer_rel_error if self.fp32 is not None else []


@dataclass(frozen=True)
class _Done:
    value: Any

    def result(self) -> Any:
        return self.value

    def cancel(self) -> None:
        pass


def run_mil_level(
    subject: MilSubject, progress: Progress = lambda: None, start: Start | None = None
) -> MilLevel:
    """Run ``subject``'s MIL level: its fp32 profile and own gates (here, ticking
    ``progress``, or through ``start`` beside what follows), then its fp16 profile(s). A
    program that cannot be run fails ``layer_markers_present``; run here, nothing more runs;
    run beside, the fp16 gates are dropped, so the gate set is the same."""

    def fp32_part(tick: Progress) -> tuple[Fp32Run, list[GateResult]]:
        return subject.fp32(tick), subject.more(tick)

    try:
        waiting: Waiting = start(fp32_part) if start is not None else _Done(fp32_part(progress))
    except CANNOT_RUN as e:
        return _cannot(subject, e)
    try:
        fp16 = subject.fp16()
    except BaseException:
        waiting.cancel()  # no child outlives the level
        raise
    try:
        run, more = waiting.result()
    except CANNOT_RUN as e:
        return _cannot(subject, e)
    gates = level_gates(run.check, subject.threshold, run.detail, run.problem, run.found)
    return MilLevel(gates + more, fp16, run.check)


def _cannot(subject: MilSubject, error: Exception) -> MilLevel:
    problem = f"cannot run the program: {error}"
    return MilLevel(level_gates(None, subject.threshold, "", problem), [], None, str(error))
