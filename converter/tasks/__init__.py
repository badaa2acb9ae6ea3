"""Tasks: what each recipe ``task`` converts, as a state type and a step list.

`TASKS` maps a recipe task to its `Task`; `converter.pipeline.run.convert` runs any of them the
same way (check inputs, the steps inside an artifact stage, publish, compressed variants).
Adding a task is one module with its state and steps, plus one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from converter.errors import InputError
from converter.pipeline.progress import Steps
from converter.pipeline.steps import Step
from converter.tasks import decision, encoder, text_generation, text_generation_kv
from converter.tasks.shared import Job, TaskRun

R = TypeVar("R", bound=TaskRun)
# (state, published artifact, output directory, force, progress) -> the variants' results
Compress = Callable[[Any, Path, Path, bool, Steps], list[Any]]


@dataclass(frozen=True)
class Task(Generic[R]):
    """A task: how to start its state, its steps (converting; re-checking a published
    artifact), and how to emit compressed variants."""

    name: str
    start: Callable[[Job], R]
    steps: tuple[Step[R], ...]
    recheck_steps: tuple[Step[R], ...]
    compress: Compress


_DECODER = Task(
    "text-generation",
    text_generation.DecoderRun,
    text_generation.CONVERT_STEPS,
    text_generation.RECHECK_STEPS,
    text_generation.compress,
)
# text-generation with a KV cache (recipe cache.style state or io): the same task, other steps.
_DECODER_KV = Task(
    "text-generation",
    text_generation_kv.KvRun,
    text_generation_kv.CONVERT_STEPS,
    text_generation_kv.RECHECK_STEPS,
    text_generation_kv.compress,
)
_ENCODER = Task(
    "encoder", encoder.EncoderRun, encoder.CONVERT_STEPS, encoder.RECHECK_STEPS, encoder.compress
)

_DECISION = Task(
    "decision",
    decision.DecisionRun,
    decision.CONVERT_STEPS,
    decision.RECHECK_STEPS,
    decision.compress,
)

TASKS: dict[str, Task[Any]] = {
    "text-generation": _DECODER,
    "feature-extraction": _ENCODER,
    "sentence-similarity": _ENCODER,
    "text-classification": _ENCODER,
    "decision": _DECISION,
}


def task_of(recipe: Any) -> Task[Any]:
    """The task a recipe runs: its ``task``, with the cached decoder's steps when a
    text-generation recipe asks for a KV cache."""
    cache = getattr(recipe, "cache", None)
    if cache is not None and cache.style != "none":
        return _DECODER_KV
    return task_for(recipe.task)


def task_for(name: str) -> Task[Any]:
    """The task a recipe's ``task`` names; InputError for an unknown one."""
    if name not in TASKS:
        raise InputError(f"task: {name!r} is not a task; one of {', '.join(TASKS)}")
    return TASKS[name]
