"""``anec device-check`` of an encoder or a decision model: its fp16 task output (hidden
states, a sentence embedding, a classifier's logits, a decision head's outputs) from Core ML's
predictions per units setting, gated as the MIL level gates it, read against the same gates on
the MIL evaluator's outputs.

The module, host step, fixtures and reference runs are rebuilt from the manifest's recipe and
checkpoint (its hash checked), as ``anec parity`` does; a partitioned encoder runs its host
embedding in numpy, then its island and tail packages.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
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
from parity.gate import GateResult


@dataclass
class _Outputs:
    outputs: dict[str, np.ndarray]


class _Piece:
    """A Core ML model as the encoder runner calls a piece: ``run(feeds).outputs``."""

    def __init__(self, model: CoreMLModel) -> None:
        self.model = model

    def run(self, feeds: dict[str, np.ndarray]) -> _Outputs:
        return _Outputs({k: np.asarray(v) for k, v in self.model.predict(feeds).items()})


Gated = Callable[[dict[str, Path], str, dict[str, Any] | None], list[GateResult]]


def _encoder_gates(run: Any) -> Gated:
    """Rebuild an encoder's module and references (`run`'s first steps); the function that
    gates its pieces run by ``runs`` (None: the MIL evaluator) under an implementation name."""
    from converter.tasks.base import load
    from converter.tasks.encoder import references, rewrite, thresholds
    from parity.encoder_gates import check_encoder
    from parity.encoder_mil import output_runner

    for step in (load, rewrite, references):
        step(run, lambda: None)
    rw, limits, dtype = run.rewrite, thresholds(run.recipe), run.recipe.io.dtype

    def gated(pieces: dict[str, Path], name: str, runs: dict[str, Any] | None) -> Any:
        runner = output_runner(pieces, rw.module, rw.host, dtype, runs)
        report, _ = check_encoder(rw.module, rw.batches, run.references, limits, {name: runner},
                                  torch_levels=False)  # fmt: skip
        return report.gates

    return gated


def _decision_gates(run: Any) -> Gated:
    """As `_encoder_gates`, for an encoder with a decision head (island, then tail)."""
    from converter.tasks.decision import load_with_head, references, rewrite, thresholds
    from parity.decision_gates import check_decision
    from parity.encoder_mil import decision_mil_runner

    for step in (load_with_head, rewrite, references):
        step(run, lambda: None)
    rw, limits, dtype = run.rewrite, thresholds(run.recipe), run.recipe.io.dtype

    def gated(pieces: dict[str, Path], name: str, runs: dict[str, Any] | None) -> Any:
        runner = decision_mil_runner(pieces, rw.host, rw.tail.spec, dtype, runs)
        report, _ = check_decision(rw.module, rw.tail, rw.batches, rw.slices, run.references,
                                   limits, {name: runner}, False)  # fmt: skip
        return report.gates

    return gated


def encoder_check(
    artifact: Path,
    manifest: Manifest,
    units: Sequence[str],
    load: ModelLoader,
    probe: MemoryProbe | None,
    recorded: dict[str, Any],
) -> DeviceEvidence:
    """Run an encoder's (or a decision model's) output gates under each of ``units`` through
    ``load``."""
    from converter.recheck import checkpoint_source, published_programs, recipe_from_manifest
    from converter.tasks import task_of
    from converter.tasks.base import Job

    if manifest.compression is not None:
        raise InputError(f"{artifact}: a compressed variant; device-check runs fp16 artifacts")
    packages = checked_packages(artifact)
    pieces = {p.piece: p.path for p in published_programs(artifact, manifest)}
    recipe = recipe_from_manifest(manifest)
    with tempfile.TemporaryDirectory(prefix="anec-device-") as scratch:
        job = Job(recipe, checkpoint_source(manifest), Path(scratch),
                  expected_checkpoint_sha256=manifest.checkpoint["sha256"])  # fmt: skip
        run = task_of(recipe).start(job)
        gates_of = _decision_gates(run) if manifest.task == "decision" else _encoder_gates(run)
    gated = partial(gates_of, pieces)

    baseline = gated(PROGRAM, None)
    results = []
    for unit in units:
        timed = TimedLoader(load, {path: piece for piece, path in pieces.items()})
        models = {piece: _Piece(timed(path, "main", unit)) for piece, path in pieces.items()}
        gates = gated(implementation(unit), models)
        results.append(UnitsResult(unit, gates, {g.name: g for g in baseline}, timed.functions))
    memory = None
    if probe is not None:

        def load_set(names: list[str]) -> list[CoreMLModel]:
            return [load(pieces[n], "main", units[-1]) for n in names]

        memory = memory_census(load_set, list(pieces), units[-1], probe)
    return DeviceEvidence(artifact.name, packages, recorded, baseline, results, memory)
