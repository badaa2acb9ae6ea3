"""``anec device-check`` of a window decoder: the program's fp16 output gates (argmax
agreement, |dp|, finite) on Core ML's predictions per units setting, read against the same
gates on the MIL evaluator's fp16 outputs for the same inputs.

The module, fixtures and reference runs are rebuilt from the manifest's recipe and checkpoint
(its hash checked), as ``anec parity`` does; the feeds are the program's own inputs
(`parity.conversion.program_feed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml.runtime import CoreMLModel, ModelLoader
from converter.device.evidence_file import PROGRAM, Prepared, implementation
from converter.device.rebuild import rebuilt_run
from converter.errors import InputError
from converter.pipeline.manifest import Manifest
from parity.gate_registry import GateResult


class _EvaluatorModel:
    """The MIL evaluator with Core ML's ``predict``: the program's own outputs."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    def predict(self, data: dict[str, np.ndarray], state: Any = None) -> dict[str, Any]:
        return dict(self.evaluator.run(data).outputs)

    def make_state(self) -> Any:
        raise TypeError("a window program has no state")


def _refuse_a_trimmed_head(artifact: Path, manifest: Manifest) -> None:
    if manifest.draft_vocabulary is not None:
        raise InputError(
            f"{artifact}: a trimmed draft vocabulary; device-check of a window program with a "
            "trimmed head is not implemented (its cached functions are: convert with cache:)"
        )


def prepare_window(artifact: Path, manifest: Manifest) -> Prepared:
    """A window decoder's output gates, its module, fixtures and references rebuilt."""
    from converter.tasks.shared import load
    from converter.tasks.text_generation import references, rewrite, thresholds
    from parity.conversion import output_gates, predicted_run, program_feed
    from parity.mil import Evaluator, load_package
    from parity.mil.program import dtype_name

    _refuse_a_trimmed_head(artifact, manifest)
    package = artifact / manifest.package.file
    run = rebuilt_run(manifest, (load, rewrite, references))
    rw, limits = run.rewrite, thresholds(run.recipe)
    program = load_package(package)
    specs = {name: dtype_name(var) for name, var in program.functions["main"].inputs.items()}
    feeds = [program_feed(specs, rw.module, batch, rw.embed_table) for batch in rw.batches]

    def gated(name: str, description: str, model: Any) -> list[GateResult]:
        measured = predicted_run(
            name, description, model, rw.module, rw.batches, run.references, feeds
        )
        return output_gates(measured, limits, name)

    def on_device(unit: str, load: ModelLoader) -> list[GateResult]:
        model = load(package, "main", unit)
        return gated(implementation(unit), f"Core ML predictions, {unit}", model)

    def load_functions(load: ModelLoader, units: str, names: list[str]) -> list[CoreMLModel]:
        return [load(package, "main", units) for _ in names]

    return Prepared(
        lambda: gated(PROGRAM, "anec MIL evaluator, fp16 profile", _EvaluatorModel(
            Evaluator(program, "fp16"))),
        on_device, load_functions, ["main"],
    )  # fmt: skip
