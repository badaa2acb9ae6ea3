"""A stand-in with the shape of coremltools' ``MLModel`` / ``MLState`` API, run by anec's MIL
evaluator (fp16): the Core ML code paths (`converter.drafts.host_loop.coreml_backend`, the chunk
chain,
one state shared by a package's functions, `anec device-check`) run on Linux against it, so
that on a Mac only Core ML itself is new."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml.runtime import MemoryReading
from parity.mil import Evaluator, load_package

Outputs = dict[str, np.ndarray]


class StandInState:
    """``MLState``: the state tensors' values, updated by each stateful predict, read and
    written whole by name."""

    def __init__(self, values: dict[str, np.ndarray]) -> None:
        self.values = values

    def read_state(self, name: str) -> np.ndarray:
        return self.values[name].astype(np.float16)  # Core ML holds the cache in fp16

    def write_state(self, name: str, value: np.ndarray) -> None:
        if value.shape != self.values[name].shape:
            raise RuntimeError(f"state {name}: shape {value.shape}, expected "
                               f"{self.values[name].shape}")  # fmt: skip
        self.values[name] = np.asarray(value, dtype=np.float32)


class StandInModel:
    """``MLModel(package, function_name=function)``: ``predict`` and ``make_state``."""

    def __init__(
        self, program: Any, function: str, perturb: Callable[[str, Outputs], Outputs] | None
    ) -> None:
        self.function = function
        self.evaluator = Evaluator(program, "fp16", function)
        self.perturb = perturb

    def make_state(self) -> StandInState:
        shapes = {name: shape for name, (_, shape) in self.evaluator.states.items()}
        return StandInState({name: np.zeros(shape, np.float32) for name, shape in shapes.items()})

    def predict(self, data: dict[str, np.ndarray], state: Any = None) -> Outputs:
        if self.evaluator.states and not isinstance(state, StandInState):
            raise ValueError(f"{self.function}: a stateful model predicts with its state")
        states = state.values if isinstance(state, StandInState) else None
        outputs = dict(self.evaluator.run(data, states=states).outputs)
        return self.perturb(self.function, outputs) if self.perturb else outputs


class StandInLoader:
    """A `converter.coreml.runtime.ModelLoader`: each package read once, every load recorded."""

    def __init__(self, perturb: Callable[[str, Outputs], Outputs] | None = None) -> None:
        self.perturb = perturb
        self.programs: dict[Path, Any] = {}
        self.loads: list[tuple[str, str, str]] = []

    def __call__(self, package: Path, function: str, units: str) -> StandInModel:
        if package not in self.programs:
            self.programs[package] = load_package(package)
        self.loads.append((package.name, function, units))
        return StandInModel(self.programs[package], function, self.perturb)


def rss_probe() -> MemoryReading:
    """This process's resident bytes (Linux /proc) as the footprint; no wired figure here."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return MemoryReading(pages * 4096, 0)


STAND_IN_RECORD = {"origin": "stand-in", "machine": "x86_64"}


def stand_in_plans(package: Path, units: list[str]) -> dict[str, dict[str, list[Any]]]:
    """``read_plans``'s shape: every non-constant op of every function, preferred on the NE
    (a stand-in: no Core ML planned anything)."""
    from converter.placement.computeplan import PlanOp

    program = load_package(package)
    ops = {
        name: [
            PlanOp(i, f"ios18.{op.op_type}", [o.name for o in op.outputs], "NE", ["NE", "CPU"])
            for i, op in enumerate(op for op in function.operations if op.op_type != "const")
        ]
        for name, function in program.functions.items()
    }
    return {u: ops for u in units}


def stand_in_adapters(loader: StandInLoader) -> Any:
    """`converter.device.dispatch.Adapters` of stand-ins (the record says ``origin: stand-in``)."""
    from converter.device.evidence_file import Adapters

    return Adapters(loader, rss_probe, stand_in_plans, dict(STAND_IN_RECORD))
