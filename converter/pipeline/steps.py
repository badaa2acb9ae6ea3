"""Named steps and the runner that runs a list of them: the unit every task's pipeline is made of.

A task (``converter/tasks/``) declares its conversion as a tuple of `Step` values, the way
coremltools declares a pass pipeline as a list of pass names. Each step reads what earlier steps
put into the task's state (a plain dataclass) and adds its own result; a step that finds a gate
failed returns a `Stop` naming the gate, and the runner stops there. The runner times each step
and shows its progress (`converter.pipeline.progress.Steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from converter.pipeline.progress import Steps

S = TypeVar("S")
Advance = Callable[[], None]


@dataclass(frozen=True)
class Stop:
    """A gate failed: nothing is published; ``gate`` names its kind (parity, MIL-level, plan)."""

    gate: str
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step(Generic[S]):
    """One named unit of a pipeline.

    ``run(state, advance)`` does the work, calling ``advance()`` once per unit of ``total(state)``
    when the step has a progress bar; it returns a `Stop` when a gate failed, else None. A
    step with ``when`` runs only where ``when(state)`` holds (and shows no line otherwise).
    """

    name: str
    run: Callable[[S, Advance], Stop | None]
    total: Callable[[S], int] | None = None
    # Whether the step applies to this state (a recipe section it serves); None: always.
    when: Callable[[S], bool] | None = None


def run_steps(steps: Sequence[Step[S]], state: S, progress: Steps) -> Stop | None:
    """Run ``steps`` in order on ``state``; the first `Stop` ends the run and is returned."""
    for step in steps:
        if step.when is not None and not step.when(state):
            continue
        total = step.total(state) if step.total is not None else None
        with progress.step(step.name, total=total) as advance:
            stop = step.run(state, advance)
        if stop is not None:
            return stop
    return None


def step_names(steps: Sequence[Step[S]]) -> list[str]:
    """The names of ``steps``, in order (for help texts and tests)."""
    return [s.name for s in steps]
