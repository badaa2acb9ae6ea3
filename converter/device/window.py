"""``anec device-check`` of a window decoder: the program's fp16 output gates (argmax
agreement, |dp|, finite) on Core ML's predictions per units setting, read against the same
gates on the MIL evaluator's fp16 outputs for the same inputs.

The module, fixtures and reference runs are rebuilt from the manifest's recipe and checkpoint
(its hash checked), as ``anec parity`` does; the feeds are the program's own inputs
(`parity.conversion.program_feed`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml_runtime import CoreMLModel, MemoryProbe, ModelLoader
from converter.device.evidence import (
    PROGRAM,
    DeviceEvidence,
    TimedLoader,
    UnitsResult,
    checked_packages,
    implementation,
    memory_census,
)
from converter.errors import InputError
from converter.manifest import Manifest


class _EvaluatorModel:
    """The MIL evaluator with Core ML's ``predict``: the program's own outputs."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    def predict(self, data: dict[str, np.ndarray], state: Any = None) -> dict[str, Any]:
        return dict(self.evaluator.run(data).outputs)

    def make_state(self) -> Any:
        raise TypeError("a window program has no state")


def _refuse_unless_plain(artifact: Path, manifest: Manifest) -> None:
    if manifest.compression is not None:
        raise InputError(f"{artifact}: a compressed variant; device-check runs fp16 artifacts")
    if manifest.draft_vocabulary is not None:
        raise InputError(
            f"{artifact}: a trimmed draft vocabulary; device-check of a window program with a "
            "trimmed head is not implemented (its cached functions are: convert with cache:)"
        )


def window_check(
    artifact: Path,
    manifest: Manifest,
    units: Sequence[str],
    load: ModelLoader,
    probe: MemoryProbe | None,
    recorded: dict[str, Any],
) -> DeviceEvidence:
    """Run the window program's output gates under each of ``units`` through ``load``."""
    from converter.recheck import checkpoint_source, recipe_from_manifest
    from converter.tasks import task_of
    from converter.tasks.base import Job
    from converter.tasks.base import load as load_checkpoint
    from converter.tasks.text_generation import DecoderRun, references, rewrite, thresholds
    from parity.conversion import output_gates, predicted_run, program_feed
    from parity.mil import Evaluator, load_package
    from parity.mil.program import dtype_name

    _refuse_unless_plain(artifact, manifest)
    packages = checked_packages(artifact)
    package = artifact / manifest.package.file
    recipe = recipe_from_manifest(manifest)
    with tempfile.TemporaryDirectory(prefix="anec-device-") as scratch:
        job = Job(recipe, checkpoint_source(manifest), Path(scratch),
                  expected_checkpoint_sha256=manifest.checkpoint["sha256"])  # fmt: skip
        run = task_of(recipe).start(job)
        assert isinstance(run, DecoderRun)
        for step in (load_checkpoint, rewrite, references):
            step(run, lambda: None)
    rw = run.rewrite
    assert rw is not None
    program = load_package(package)
    specs = {name: dtype_name(var) for name, var in program.functions["main"].inputs.items()}
    feeds = [program_feed(specs, rw.module, batch, rw.embed_table) for batch in rw.batches]
    limits = thresholds(recipe)

    def gated(name: str, description: str, model: Any) -> Any:
        measured = predicted_run(
            name, description, model, rw.module, rw.batches, run.references, feeds
        )
        return output_gates(measured, limits, name)

    evaluator = _EvaluatorModel(Evaluator(program, "fp16"))
    baseline = gated(PROGRAM, "anec MIL evaluator, fp16 profile", evaluator)
    del evaluator
    results = []
    for unit in units:
        timed = TimedLoader(load)
        model = timed(package, "main", unit)
        gates = gated(implementation(unit), f"Core ML predictions, {unit}", model)
        results.append(UnitsResult(unit, gates, {g.name: g for g in baseline}, timed.functions))
    memory = None
    if probe is not None:

        def load_set(names: list[str]) -> list[CoreMLModel]:
            return [load(package, "main", units[-1]) for _ in names]

        memory = memory_census(load_set, ["main"], units[-1], probe)
    return DeviceEvidence(artifact.name, packages, recorded, baseline, results, memory)
