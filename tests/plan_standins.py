"""Stand-ins with the shape of coremltools' MLComputePlan for the plan tests.

coremltools' own ``MLModelStructure*``, ``MLComputePlanDeviceUsage`` and ``MLComputePlanCost``
dataclasses, and real device-class instances created without their native proxy; only
``MLComputePlan`` itself (which needs the native library) is a small fake with the same three
members the adapter calls. Import as ``import plan_standins`` (tests is not a package).

Plans and measurements built from these say ``origin: stand-in``: reading them needs the
``stand_in_evidence`` fixture (conftest.py), the test-only switch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from converter.pipeline.hashing import mlpackage_content_hash
from converter.placement.computeplan import walk_plan
from converter.placement.dump import RecordedPlan
from converter.placement.provenance import ORIGIN_STAND_IN


def device(kind: str) -> Any:
    from coremltools.models import compute_device as cd

    cls = {
        "NE": cd.MLNeuralEngineComputeDevice,
        "GPU": cd.MLGPUComputeDevice,
        "CPU": cd.MLCPUComputeDevice,
    }[kind]
    return object.__new__(cls)  # a real device instance; its proxy is never touched


def structure_op(operator: str, outputs: list[str], blocks: list[Any] | None = None) -> Any:
    from coremltools.models import compute_plan as cp

    return cp.MLModelStructureProgramOperation(
        inputs={},
        operator_name=operator,
        outputs=[
            cp.MLModelStructureProgramNamedValueType(
                name=o, type=cp.MLModelStructureProgramValueType()
            )
            for o in outputs
        ],
        blocks=blocks or [],
        __proxy__=None,
    )


def block(ops: list[Any]) -> Any:
    from coremltools.models import compute_plan as cp

    return cp.MLModelStructureProgramBlock(inputs=[], operations=ops, output_names=[])


def structure_of(program: Any) -> Any:
    """An MLModelStructure mirroring a MIL program (every function, constants included)."""
    from coremltools.models import compute_plan as cp

    def block_of(mil_block: Any) -> Any:
        ops = []
        for op in mil_block.operations:
            inner = [block_of(b) for b in getattr(op, "blocks", None) or ()]
            ops.append(structure_op(f"ios17.{op.op_type}", [v.name for v in op.outputs], inner))
        return block(ops)

    functions = {
        name: cp.MLModelStructureProgramFunction(inputs=[], block=block_of(f))
        for name, f in program.functions.items()
    }
    return cp.MLModelStructure(
        neuralnetwork=None, program=cp.MLModelStructureProgram(functions=functions), pipeline=None
    )


class FakePlan:
    """The three members of coremltools' MLComputePlan that the adapter uses."""

    def __init__(self, structure: Any, policy: Callable[[str, str], str | None]) -> None:
        self.model_structure = structure
        self.policy = policy  # (operator, first output) -> device, None = undetermined

    def get_compute_device_usage_for_mlprogram_operation(self, op: Any) -> Any:
        from coremltools.models import compute_plan as cp

        kind = self.policy(op.operator_name, op.outputs[0].name if op.outputs else "")
        if kind is None:
            return None
        supported = [device(d) for d in ("CPU", "GPU", "NE")]
        return cp.MLComputePlanDeviceUsage(
            preferred_compute_device=device(kind), supported_compute_devices=supported
        )

    def get_estimated_cost_for_mlprogram_operation(self, op: Any) -> Any:
        from coremltools.models import compute_plan as cp

        if op.operator_name.endswith(".const"):
            return None  # Core ML gives constants no cost
        return cp.MLComputePlanCost(weight=0.01)


def ne_except(*cpu_outputs: str) -> Callable[[str, str], str | None]:
    def policy(operator: str, output: str) -> str | None:
        if operator.endswith(".const"):
            return None
        return "CPU" if output in cpu_outputs else "NE"

    return policy


def recorded(package: Path, policy: Callable[[str, str], str | None]) -> RecordedPlan:
    from parity.mil.program import load_package

    plan = FakePlan(structure_of(load_package(package)), policy)
    return RecordedPlan(
        content_sha256=mlpackage_content_hash(package),
        package=package.name,
        # Never recorded on a Mac: accepted only behind the test-only switch, and every
        # report prints STAND-IN (converter.placement.provenance).
        recorded={"origin": ORIGIN_STAND_IN, "machine": "test"},
        plans={"CPU_AND_NE": {"main": walk_plan(plan, "main")}},
    )
