"""The one conversion pipeline: recipe -> proven package(s) + manifest, for every task.

    check inputs -> [the task's steps, inside an artifact stage] -> publish -> compressed variants

The task's step list (``converter/tasks/``) is data: `converter.tasks.TASKS` maps each recipe
task to its state type and steps. Everything runs inside an artifact stage, so a failure at any
point publishes nothing under the final name; a failed gate keeps the reports in
``<out>/<name>.failed/`` and returns exit code 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converter.pipeline.fsops import write_text_atomic
from converter.pipeline.preflight import preflight
from converter.pipeline.progress import Steps
from converter.pipeline.publish import ArtifactStage, clean_leftovers, stage_artifact
from converter.pipeline.runlog import write_log_into
from converter.pipeline.steps import Stop, run_steps
from converter.recipe import Recipe
from converter.recipe.writer import RECIPE_FILE, artifact_recipe_yaml
from converter.tasks import task_of
from converter.tasks.shared import Job, TaskRun
from parity.fp16_conv import fast_fp16_convs
from parity.memory import release_memory
from parity.result import ParityReport


@dataclass
class ConvertResult:
    """What a conversion produced; ``exit_code`` 0 published, 1 a gate failed."""

    name: str
    passed: bool
    artifact_dir: Path | None
    report_dir: Path
    parity: ParityReport
    timings: dict[str, float]
    live_ops: int = 0
    live_ops_per_layer: float = 0.0
    notes: list[str] = field(default_factory=list)
    # compression.variant_steps.VariantResult, in order
    variants: list[Any] = field(default_factory=list)
    failed_gate: str | None = None  # the kind of gate that blocked the artifact, if one did

    @property
    def exit_code(self) -> int:
        """0 when every gate passed (each compressed variant's too), else 1."""
        return 0 if self.passed and all(v.passed for v in self.variants) else 1


def gate_failed(
    stage: ArtifactStage, stop: Stop, report: ParityReport, timings: dict[str, float]
) -> ConvertResult:
    """Keep the staged reports as ``<name>.failed`` and log which gate failed (exit code 1)."""
    write_log_into(stage.path, f"a {stop.gate} gate failed; reports kept in {stage.name}.failed")
    failed = stage.keep_as_failed()
    return ConvertResult(
        stage.name, False, None, failed, report, timings, notes=stop.notes, failed_gate=stop.gate
    )


def convert(
    recipe: Recipe,
    out_dir: Path | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    steps: Steps | None = None,
) -> ConvertResult:
    """Run the recipe's task pipeline; publishes ``<out>/<name>/`` only if every gate passes."""
    progress = steps or Steps(quiet=True)
    out_dir = out_dir or recipe.output_dir
    task = task_of(recipe)
    # Bad input fails here, in about a second, before the output directory is touched.
    with progress.step("check inputs"):
        source = recipe.resolve_source()
        preflight(recipe, source, out_dir, allow_pickle)
    if out_dir.is_dir():
        clean_leftovers(out_dir)

    with stage_artifact(out_dir, recipe.name, force=force) as stage:
        # The recipe as converted, a file `anec convert` accepts (reports of a failed run too).
        write_text_atomic(stage.path / RECIPE_FILE, artifact_recipe_yaml(recipe, source))
        run: TaskRun = task.start(Job(recipe, source, stage.path, allow_pickle))
        stop = run_steps(task.steps, run, progress)
        report = run.report or ParityReport([], [], [], None, {})
        if stop is not None:
            return gate_failed(stage, stop, report, progress.timings)
        write_log_into(stage.path, f"every gate passed; publishing {out_dir / recipe.name}")
        final = stage.commit()

    run.release_programs()
    release_memory()
    with fast_fp16_convs():  # the variants' torch-fp16 levels
        variants = task.compress(run, final, out_dir, force, progress)
    ops = sum(sum(p.ops.values()) for p in run.programs)
    return ConvertResult(
        final.name,
        True,
        final,
        final,
        report,
        progress.timings,
        live_ops=ops,
        live_ops_per_layer=ops / run.num_layers(),
        variants=variants,
    )
