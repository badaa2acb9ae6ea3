"""The macOS adapter (evidence ``compute-plan``): Core ML's MLComputePlan, op by op.

On macOS 14.4+ with coremltools 8.1+, ``read_plans`` compiles the package and reads
``MLComputePlan`` for each compute-units setting asked for. coremltools 9.0 plans only the
default function of a multifunction package, so every other function is first re-saved as the
default of a copy (``resave_with_default``, plain protobuf editing that works anywhere).

NOT RUN HERE: this project is developed on Linux, where Core ML cannot compile models or
produce plans. The walking, device mapping and report logic is tested against stand-ins
built from coremltools' own ``MLModelStructure*`` dataclasses, ``MLComputePlanDeviceUsage``,
``MLComputePlanCost`` and device classes; the calls to ``compile_model`` and
``MLComputePlan.load_from_path`` have never been executed by this project.
"""

from __future__ import annotations

import platform
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.placement.rules import COMPUTE_UNITS, ComputeUnits

MODEL_FILE = Path("Data") / "com.apple.CoreML" / "model.mlmodel"


@dataclass
class PlanOp:
    """One operation as MLComputePlan sees it."""

    index: int  # position in the walk (nested blocks after their parent)
    operator: str  # versioned, e.g. "ios17.conv"
    outputs: list[str]
    preferred: str | None  # "NE", "CPU", "GPU"; None when Core ML could not determine usage
    supported: list[str] = field(default_factory=list)
    cost_weight: float | None = None

    @property
    def op_type(self) -> str:
        """The operator without its opset prefix ("ios17.conv" -> "conv")."""
        return self.operator.rsplit(".", 1)[-1]


def device_name(device: Any) -> str:
    """ "NE", "GPU" or "CPU" for a coremltools compute device object."""
    from coremltools.models import compute_device as cd

    if isinstance(device, cd.MLNeuralEngineComputeDevice):
        return "NE"
    if isinstance(device, cd.MLGPUComputeDevice):
        return "GPU"
    if isinstance(device, cd.MLCPUComputeDevice):
        return "CPU"
    raise InputError(f"unknown compute device type {type(device).__name__}")


def _walk(block: Any) -> Iterator[Any]:
    for op in block.operations:
        yield op
        for inner in op.blocks or ():  # cond / while_loop bodies
            yield from _walk(inner)


def walk_plan(plan: Any, function: str) -> list[PlanOp]:
    """Every operation of ``function`` in an MLComputePlan, with device usage and cost."""
    program = plan.model_structure.program
    if program is None:
        raise InputError("the compiled model is not an ML Program; only ML Programs are read")
    if function not in program.functions:
        raise InputError(f"function {function!r} not in the plan: {sorted(program.functions)}")
    out = []
    for i, op in enumerate(_walk(program.functions[function].block)):
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        out.append(
            PlanOp(
                index=i,
                operator=op.operator_name,
                outputs=[o.name for o in op.outputs],
                preferred=device_name(usage.preferred_compute_device) if usage else None,
                supported=[device_name(d) for d in usage.supported_compute_devices]
                if usage
                else [],
                cost_weight=float(cost.weight) if cost is not None else None,
            )
        )
    return out


# ------------------------------------------------------------------------ multifunction


def _read_spec(package: Path) -> Any:
    from coremltools.proto import Model_pb2

    path = package / MODEL_FILE
    if not path.is_file():
        raise InputError(f"{package}: no {MODEL_FILE}; not an .mlpackage")
    spec = Model_pb2.Model()
    spec.ParseFromString(path.read_bytes())
    return spec


def function_names(package: Path) -> tuple[list[str], str]:
    """(every function of the package's ML Program, the default function)."""
    spec = _read_spec(package)
    if not spec.HasField("mlProgram"):
        raise InputError(f"{package}: not an ML Program")
    names = sorted(spec.mlProgram.functions)  # a protobuf map: no order of its own
    default = spec.description.defaultFunctionName or "main"
    return names, default


def resave_with_default(package: Path, function: str, dest: Path) -> Path:
    """Copy ``package`` to ``dest`` with ``function`` as its default function."""
    names, _ = function_names(package)
    if function not in names:
        raise InputError(f"{package}: no function {function!r}; it has {names}")
    shutil.copytree(package, dest)
    spec = _read_spec(dest)
    spec.description.defaultFunctionName = function
    (dest / MODEL_FILE).write_bytes(spec.SerializeToString())
    return dest


# ------------------------------------------------------------------------------ macOS


CompileFn = Callable[[Path], str]
LoadPlanFn = Callable[[str, ComputeUnits], Any]


def _compile(package: Path) -> str:  # pragma: no cover - macOS only, never run here
    import coremltools as ct

    return str(ct.utils.compile_model(str(package)))


def _load_plan(compiled: str, units: ComputeUnits) -> Any:  # pragma: no cover - macOS only
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    return MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit[units])


def require_macos() -> None:
    """Raise InputError unless this is macOS, where Core ML can compile and plan."""
    if platform.system() != "Darwin":
        raise InputError(
            "compute plans need macOS 14.4+ with Core ML; on this platform read a recorded "
            "dump with --from-plan FILE instead"
        )


def read_plans(
    package: Path,
    compute_units: list[ComputeUnits],
    compile_fn: CompileFn | None = None,
    load_plan_fn: LoadPlanFn | None = None,
) -> dict[str, dict[str, list[PlanOp]]]:
    """``{compute units: {function: ops}}`` for every function of ``package``.

    ``compile_fn`` and ``load_plan_fn`` default to coremltools (macOS only); tests pass
    stand-ins.
    """
    if compile_fn is None or load_plan_fn is None:
        require_macos()
    compile_fn = compile_fn or _compile
    load_plan_fn = load_plan_fn or _load_plan
    for units in compute_units:
        if units not in COMPUTE_UNITS:
            raise InputError(f"unknown compute units {units!r}; expected one of {COMPUTE_UNITS}")
    names, default = function_names(package)
    plans: dict[str, dict[str, list[PlanOp]]] = {u: {} for u in compute_units}
    with tempfile.TemporaryDirectory(prefix="anec-plan-") as tmp:
        for name in names:
            source = package
            if name != default:
                source = resave_with_default(package, name, Path(tmp) / f"{name}.mlpackage")
            compiled = compile_fn(source)
            for units in compute_units:
                plans[units][name] = walk_plan(load_plan_fn(compiled, units), name)
    return plans


def plan_op_to_json(op: PlanOp) -> dict[str, Any]:
    """JSON form of one plan op."""
    return asdict(op)


def plan_op_from_json(data: dict[str, Any]) -> PlanOp:
    """A plan op from its JSON form (InputError on a malformed entry)."""
    try:
        preferred = data["preferred"]
        if preferred not in (None, "NE", "CPU", "GPU"):
            raise ValueError(f"preferred {preferred!r}")
        supported = [str(d) for d in data.get("supported", [])]
        if any(d not in ("NE", "CPU", "GPU") for d in supported):
            raise ValueError(f"supported {supported!r}")
        weight = data.get("cost_weight")
        return PlanOp(
            index=int(data["index"]),
            operator=str(data["operator"]),
            outputs=[str(o) for o in data["outputs"]],
            preferred=preferred,
            supported=supported,
            cost_weight=None if weight is None else float(weight),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"malformed compute-plan op {data!r:.200}: {e}") from None
