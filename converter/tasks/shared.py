"""What every task's conversion state holds, and the steps every task shares.

A task's state is a dataclass derived from `TaskRun`: the job (recipe, source, where files
go) plus the fields its steps fill in order. Shared steps here: loading the checkpoint,
tracing / converting / saving a program, the static plan gate.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from converter.checkpoints.loading import Checkpoint, load_checkpoint
from converter.coreml.program import TensorIO, live_ops, save_package, to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.errors import InputError
from converter.pipeline.manifest import Manifest
from converter.pipeline.publish import write_json_atomic, write_text_atomic
from converter.pipeline.steps import Advance, Stop
from converter.placement.artifact_gate import plan_artifact
from converter.placement.ops import op_table
from converter.recipe import Recipe, ResolvedSource
from graph_passes.markers import mark_layer_outputs
from parity.conversion import ConversionReport
from parity.html_report import report_to_html
from parity.report import conversion_to_text, parity_document, report_to_json, report_to_text
from parity.result import ParityReport, rows_to_json

T = TypeVar("T")


def need(value: T | None, what: str) -> T:
    """``value``, which an earlier step must have produced (a pipeline bug otherwise)."""
    if value is None:
        raise RuntimeError(f"pipeline order: {what} is needed before this step")
    return value


@dataclass(frozen=True)
class Job:
    """What one conversion was asked to do and where its files go (the staging directory)."""

    recipe: Recipe
    source: ResolvedSource
    directory: Path
    allow_pickle: bool = False
    # `anec parity`: the checkpoint must be the one the artifact was converted from.
    expected_checkpoint_sha256: str | None = None
    # `anec parity` of a trimmed draft: the published head_ids.npy, which the ranking must
    # reproduce (its program scores exactly those rows).
    expected_head_ids: Path | None = None


@dataclass
class Program:
    """One emitted package: the traced piece's I/O contract, the converted program, its path."""

    piece: str  # "main", or "island" / "tail" of a partitioned encoder
    inputs: list[TensorIO]
    outputs: list[TensorIO]
    path: Path
    mlmodel: Any = field(repr=False)
    ops: collections.Counter[str]
    # The plan step's op table, made from the program when it was converted, so that a task
    # can drop the in-memory program (its weights) before the MIL parity step loads the saved
    # one (at Qwen2.5-0.5B size each holds 1 GB).
    plan_table: Any = field(default=None, repr=False)


@dataclass
class TaskRun:
    """The state every task's steps share; tasks derive their own state from it."""

    job: Job
    ckpt: Checkpoint | None = None
    report: ParityReport | None = None
    programs: list[Program] = field(default_factory=list)
    manifest: Manifest | None = None

    @property
    def recipe(self) -> Recipe:
        """The recipe being converted."""
        return self.job.recipe

    @property
    def main(self) -> Program:
        """The package the manifest's ``package`` entry names (the single or island program)."""
        return need(self.programs[0] if self.programs else None, "a converted program")

    def num_layers(self) -> int:
        """Transformer layers of the converted model (for the summary's ops per layer)."""
        raise NotImplementedError

    def release_programs(self) -> None:
        """Drop the in-memory programs once every step has run: their packages are saved and
        compression reloads them from disk (at Qwen2.5-0.5B size one holds 0.9 GiB)."""
        for program in self.programs:
            program.mlmodel = None


def load(run: TaskRun, advance: Advance) -> None:
    """Load the checkpoint the recipe names (safetensors / GGUF; pickle only when allowed)."""
    job = run.job
    run.ckpt = load_checkpoint(job.source, run.recipe.task, allow_pickle=job.allow_pickle)
    expected = job.expected_checkpoint_sha256
    if expected is not None and run.ckpt.sha256 != expected:
        raise InputError(
            f"{job.source.directory}: the checkpoint differs from the one the artifact was "
            f"converted from (sha256 {run.ckpt.sha256[:12]}..., manifest {expected[:12]}...)"
        )


def emit_program(
    run: TaskRun,
    piece: str,
    module: torch.nn.Module,
    contract: tuple[list[TensorIO], list[TensorIO]],
    file: str,
    markers: int = 0,
) -> Program:
    """Trace ``module``, name its first ``markers`` layer outputs ``layer_<i>_out`` (so the MIL
    level compares layer by layer), convert to an ML Program and save it as ``file``."""
    inputs, outputs = contract
    traced = trace(module, inputs)
    if markers:
        mark_layer_outputs(traced, markers)
    target = TARGETS[run.recipe.target]
    mlmodel = to_mlprogram(traced, inputs, outputs, target.ct_target(), run.recipe.precision)
    path = run.job.directory / file
    save_package(mlmodel, path)
    table = op_table(mlmodel._mil_program)
    program = Program(piece, inputs, outputs, path, mlmodel, live_ops(mlmodel), table)
    run.programs.append(program)
    return program


def plan(run: TaskRun, advance: Advance) -> Stop | None:
    """The static placement prediction of the main package and the recipe's plan gates."""
    main = run.main
    result = plan_artifact(
        # the program just saved, without reloading its weights
        main.plan_table if main.plan_table is not None else main.mlmodel._mil_program,
        main.path,
        need(run.manifest, "the manifest").package.content_sha256,
        TARGETS[run.recipe.target].platform,
        run.recipe.gates.plan_min_ne_flop_share,
        run.recipe.gates.plan_max_ne_segments,
        run.job.directory,
    )
    return None if result.passed else Stop("plan", result.failures())


def write_parity_reports(
    directory: Path,
    report: ParityReport,
    conversion: ConversionReport | None,
    extra: dict[str, Any],
    levels: list[dict[str, Any]] | None = None,
    notes: str = "",
) -> dict[str, Any]:
    """A decoder's parity report files (`parity.report.parity_document`, whose levels
    table says what ran; ``notes`` close the text); returns the JSON document."""
    doc = parity_document(report, conversion, extra, levels)
    text = report_to_text(report) + (f"\n\n{notes}" if notes else "")
    if conversion is not None:
        text += "\n\n" + conversion_to_text(conversion)
    write_parity_files(directory, doc, text)
    return doc


def write_rows_parity(run: TaskRun, key: str, rows: list[Any], extra: dict[str, Any],
                      text: str = "") -> None:  # fmt: skip
    """The report files of an encoder or decision report so far: the report, its per-fixture
    (per-request) ``rows`` under ``key``, then ``extra``; ``text`` follows the report's."""
    report = need(run.report, "the torch report")
    doc = report_to_json(report, {"recipe": run.recipe.name, key: rows_to_json(rows), **extra})
    write_parity_files(run.job.directory, doc, report_to_text(report) + text)


def write_parity_files(directory: Path, doc: dict[str, Any], text: str) -> None:
    """Write ``parity.json`` (``doc``), ``parity.txt`` (``text``) and ``parity.html`` (from
    ``doc``) atomically into ``directory``: every model kind's report files."""
    write_json_atomic(directory / "parity.json", doc)
    write_text_atomic(directory / "parity.txt", text + "\n")
    name = doc.get("variant", doc.get("recipe"))  # a compressed variant's: its own name
    title = f"anec parity report: {name}" if name else "anec parity report"
    write_text_atomic(directory / "parity.html", report_to_html(doc, title))
