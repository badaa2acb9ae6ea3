"""``anec device-check`` of an encoder or a decision model: its fp16 task output (hidden
states, a sentence embedding, a classifier's logits, a decision head's outputs) from Core ML's
predictions per units setting, gated as the MIL level gates it, read against the same gates on
the MIL evaluator's outputs.

The module, host step, fixtures and reference runs are rebuilt from the manifest's recipe and
checkpoint (its hash checked), as ``anec parity`` does; a partitioned encoder runs its host
embedding in numpy, then its island and tail packages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml.runtime import CoreMLModel, ModelLoader
from converter.device.evidence_file import PROGRAM, Prepared, implementation
from converter.device.rebuild import rebuilt_run
from converter.pipeline.manifest import Manifest
from parity.gate_registry import GateResult


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


def _encoder_gates(manifest: Manifest) -> Gated:
    """An encoder rebuilt (module, host step, references); the function that gates its pieces
    run by ``runs`` (None: the MIL evaluator) under an implementation name."""
    from converter.tasks.encoder import references, rewrite, thresholds
    from converter.tasks.shared import load
    from parity.encoder_gates import check_encoder
    from parity.encoder_mil import output_runner

    run = rebuilt_run(manifest, (load, rewrite, references))
    rw, limits, dtype = run.rewrite, thresholds(run.recipe), run.recipe.io.dtype

    def gated(pieces: dict[str, Path], name: str, runs: dict[str, Any] | None) -> Any:
        runner = output_runner(pieces, rw.module, rw.host, dtype, runs)
        report, _ = check_encoder(rw.module, rw.batches, run.references, limits, {name: runner},
                                  torch_levels=False)  # fmt: skip
        return report.gates

    return gated


def _decision_gates(manifest: Manifest) -> Gated:
    """As `_encoder_gates`, for an encoder with a decision head (island, then tail)."""
    from converter.tasks.decision import load_with_head, references, rewrite, thresholds
    from parity.decision_gates import check_decision
    from parity.encoder_mil import decision_mil_runner

    run = rebuilt_run(manifest, (load_with_head, rewrite, references))
    rw, limits, dtype = run.rewrite, thresholds(run.recipe), run.recipe.io.dtype

    def gated(pieces: dict[str, Path], name: str, runs: dict[str, Any] | None) -> Any:
        runner = decision_mil_runner(pieces, rw.host, rw.tail.spec, dtype, runs)
        report, _ = check_decision(rw.module, rw.tail, rw.batches, rw.slices, run.references,
                                   limits, {name: runner}, False)  # fmt: skip
        return report.gates

    return gated


def prepare_encoder(artifact: Path, manifest: Manifest) -> Prepared:
    """An encoder's (or a decision model's) output gates, its references rebuilt."""
    from converter.evidence.recheck import published_programs

    pieces = {p.piece: p.path for p in published_programs(artifact, manifest)}
    gates_of = _decision_gates if manifest.task == "decision" else _encoder_gates
    gated = partial(gates_of(manifest), pieces)

    def on_device(unit: str, load: ModelLoader) -> list[GateResult]:
        models = {piece: _Piece(load(path, "main", unit)) for piece, path in pieces.items()}
        return gated(implementation(unit), models)

    def load_functions(load: ModelLoader, units: str, names: list[str]) -> list[CoreMLModel]:
        return [load(pieces[n], "main", units) for n in names]

    return Prepared(
        lambda: gated(PROGRAM, None), on_device, load_functions, list(pieces),
        {path: piece for piece, path in pieces.items()},
    )  # fmt: skip
