"""What ``anec device-check`` measured and the evidence file it writes: per units setting the
gates (each read against the program's own in the MIL evaluator), the timing of every call
and load, the memory census; reading the file back for ``anec parity`` (its provenance and
the artifact's package hashes checked)."""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml.runtime import (
    STATE_SHARING,
    CoreMLModel,
    MemoryProbe,
    MemoryReading,
    ModelLoader,
)
from converter.errors import InputError
from converter.evidence.labels import Evidence
from converter.pipeline.hashing import mlpackage_content_hash
from converter.pipeline.progress import Steps
from converter.placement.computeplan import PlanOp
from converter.placement.device_bench import latency_stats
from converter.placement.device_evidence import FORMAT, read_raw
from converter.placement.provenance import check_recorded, provenance_json, provenance_text
from parity.gate_registry import GateResult

PROGRAM = "mil-fp16"  # the baseline every device result is read against
# package, units settings -> {units: {function: ops}} (`converter.placement.computeplan.read_plans`)
Planner = Callable[[Path, list[str]], dict[str, dict[str, list[PlanOp]]]]


@dataclass(frozen=True)
class Adapters:
    """What device-check calls on a Mac: Core ML's loader, the memory probe, the compute-plan
    reader and where this runs (stand-ins of the same shape in the tests)."""

    load: ModelLoader
    probe: MemoryProbe
    plans: Planner
    recorded: dict[str, Any]


@dataclass
class Prepared:
    """One artifact kind ready to measure (its references rebuilt): its gates on the program
    in the MIL evaluator, its gates on the models a loader gives for one units setting, and
    how to load a set of its functions (the memory census)."""

    program: Callable[[], list[GateResult]]
    on_device: Callable[[str, ModelLoader], list[GateResult]]
    load_functions: Callable[[ModelLoader, str, list[str]], list[CoreMLModel]]
    functions: list[str]
    names: dict[Path, str] = field(default_factory=dict)  # single-function packages' functions


@dataclass
class FunctionTimes:
    """One function's first load and every predict the gates made, under one units setting."""

    load_s: float = 0.0
    samples_ms: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Load seconds, call count, latency statistics and the samples."""
        stats = asdict(latency_stats(self.samples_ms)) if self.samples_ms else None
        return {"load_s": self.load_s, "calls": len(self.samples_ms), "latency": stats,
                "samples_ms": self.samples_ms}  # fmt: skip


class _TimedModel:
    def __init__(self, model: CoreMLModel, times: FunctionTimes) -> None:
        self.model, self.times = model, times

    def predict(self, data: dict[str, np.ndarray], state: Any = None) -> dict[str, Any]:
        start = time.perf_counter()
        out = self.model.predict(data) if state is None else self.model.predict(data, state=state)
        self.times.samples_ms.append((time.perf_counter() - start) * 1e3)
        return out

    def make_state(self) -> Any:
        return self.model.make_state()


class TimedLoader:
    """A `ModelLoader` that times each load and every predict of the models it returns, by
    function (``names``: the function of each single-function package, whose own is main)."""

    def __init__(self, load: ModelLoader, names: dict[Path, str] | None = None) -> None:
        self.load, self.names = load, names or {}
        self.functions: dict[str, FunctionTimes] = {}

    def __call__(self, package: Path, function: str, units: str) -> CoreMLModel:
        start = time.perf_counter()
        model = self.load(package, function, units)
        times = self.functions.setdefault(self.names.get(package, function), FunctionTimes())
        times.load_s += time.perf_counter() - start
        return _TimedModel(model, times)


@dataclass
class UnitsResult:
    """The gates under one compute-units setting, read against the program's own."""

    units: str
    gates: list[GateResult]
    program: dict[str, GateResult]
    functions: dict[str, FunctionTimes]

    @property
    def passed(self) -> bool:
        """Every gate passed on the device."""
        return all(g.passed for g in self.gates)

    def attribution(self, result: GateResult) -> str:
        """Where a failure comes from: the program (the MIL evaluator fails it too) or the
        device (it passes there)."""
        if result.passed:
            return "passed"
        baseline = self.program.get(result.name)
        if baseline is not None and not baseline.passed:
            return f"program: fails in anec's MIL evaluator ({PROGRAM}) as well"
        return f"device: passes in anec's MIL evaluator ({PROGRAM}), fails on Core ML"


@dataclass
class DeviceEvidence:
    """What a device-check measured; `to_json` is the evidence file."""

    artifact: str
    packages: list[dict[str, Any]]
    recorded: dict[str, Any]
    program: list[GateResult]
    units: list[UnitsResult]
    memory: dict[str, Any] | None
    # Core ML's compute plan per package, units setting and function (`plan_section`)
    plans: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """Every gate passed under every units setting."""
        return all(u.passed for u in self.units)

    def to_json(self) -> dict[str, Any]:
        """The evidence document (`FORMAT`)."""
        return {
            "format": FORMAT,
            "evidence": Evidence.OBSERVED.value,
            "artifact": self.artifact,
            "packages": self.packages,
            "recorded": self.recorded,
            **provenance_json(self.recorded),
            "state_sharing": STATE_SHARING,
            "passed": self.passed,
            "program": {"implementation": PROGRAM, "gates": [g.to_json() for g in self.program]},
            "units": {
                u.units: {
                    "passed": u.passed,
                    "gates": [g.to_json() | {"attribution": u.attribution(g)} for g in u.gates],
                    "functions": {n: t.to_json() for n, t in u.functions.items()},
                }
                for u in self.units
            },
            "memory": self.memory,
            "compute_plans": self.plans,
        }

    def text(self) -> str:
        """A readable summary: provenance, each units setting's gates and latency, memory."""
        lines = [f"anec device-check: {self.artifact}", provenance_text(self.recorded)]
        for u in self.units:
            lines.append(f"\n{u.units}: {'every gate passed' if u.passed else 'FAILED'}")
            for g in u.gates:
                note = "" if g.passed else f"  <- {u.attribution(g)}"
                lines.append(f"  {g.text()}{note}")
            for name, t in u.functions.items():
                stats = latency_stats(t.samples_ms) if t.samples_ms else None
                timing = f"median {stats.median_ms:.2f} ms, p90 {stats.p90_ms:.2f} ms over " \
                    f"{stats.runs} calls" if stats else "not called"  # fmt: skip
                lines.append(f"  {name}: first load {t.load_s:.2f} s; {timing}")
        for package, by_units in (self.plans or {}).items():
            for units, by_function in by_units.items():
                for function, plan in by_function.items():
                    devices = ", ".join(f"{d} {n}" for d, n in sorted(plan["devices"].items()))
                    lines.append(f"compute plan {package} {units} {function}: {devices}")
        for row in (self.memory or {}).get("rows", []):
            lines.append(f"memory with {'+'.join(row['functions'])} loaded: footprint "
                         f"+{row['footprint_added'] / 2**20:.1f} MiB, wired "
                         f"+{row['wired_added'] / 2**20:.1f} MiB")  # fmt: skip
        return "\n".join(lines)


def checked_packages(artifact: Path) -> list[dict[str, Any]]:
    """Every package of the artifact with its manifest hash (checked against its content)
    and the functions it holds, as the device-check names them: a cached decoder's prefill /
    decode / extend (one each in the per-function layout), an encoder's pieces, else main."""
    manifest = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
    entries = [manifest["package"], *(manifest.get("extra_packages") or [])]
    kv = manifest.get("kv_cache") or {}
    pieces = [p["name"] for p in manifest.get("pieces") or [] if p["runs_on"] != "host"]
    out = []
    for i, entry in enumerate(entries):
        file = entry["file"]
        path = artifact / file
        if not path.is_dir():
            raise InputError(f"{path}: the package the manifest names is missing")
        if mlpackage_content_hash(path) != entry["content_sha256"]:
            raise InputError(f"{path}: its content differs from the hash in manifest.json")
        if kv.get("layout") == "per-function":
            functions = [f for f, e in kv["functions"].items() if e["package"] == file]
        elif kv:
            functions = list(kv["functions"])
        else:
            functions = [pieces[i]] if len(pieces) == len(entries) else ["main"]
        out.append({"file": file, "content_sha256": entry["content_sha256"],
                    "functions": functions})  # fmt: skip
    return out


def memory_census(
    load_set: Callable[[list[str]], list[CoreMLModel]],
    names: list[str],
    units: str,
    probe: MemoryProbe,
) -> dict[str, Any]:
    """Footprint and wired memory added by loading each function alone (``load_set`` loads
    the named functions' models), then all of them together."""

    def loaded(functions: list[str]) -> dict[str, Any]:
        gc.collect()
        before = probe()
        models = load_set(functions)
        after = probe()
        del models
        gc.collect()
        return {"functions": functions, **_added(before, after)}

    rows = [loaded([n]) for n in names] + ([loaded(names)] if len(names) > 1 else [])
    return {"units": units, "rows": rows}


def measure(
    artifact: Path,
    packages: list[dict[str, Any]],
    kind: Prepared,
    units: Sequence[str],
    mac: Adapters,
    memory: bool,
    steps: Steps,
) -> DeviceEvidence:
    """The program's gates, then each units setting's through a timed loader, then (with
    ``memory``) the census under the last units setting."""
    with steps.step(f"program ({PROGRAM})"):
        baseline = kind.program()
    by_name = {g.name: g for g in baseline}
    results = []
    for unit in units:
        with steps.step(f"Core ML {unit}"):
            timed = TimedLoader(mac.load, kind.names)
            results.append(UnitsResult(unit, kind.on_device(unit, timed), by_name, timed.functions))
    census = None
    if memory:
        with steps.step("memory census"):
            census = memory_census(
                lambda names: kind.load_functions(mac.load, units[-1], names),
                kind.functions, units[-1], mac.probe,
            )  # fmt: skip
    return DeviceEvidence(artifact.name, packages, mac.recorded, baseline, results, census)


def plan_section(plans: dict[str, dict[str, list[PlanOp]]]) -> dict[str, Any]:
    """One package's compute plans ({units: {function: ops}}): per function the ops Core ML
    prefers on each device, and each op's index, type and preferred device."""
    return {
        units: {
            function: {
                "devices": dict(Counter(op.preferred or "unknown" for op in ops)),
                "ops": [[op.index, op.op_type, op.preferred] for op in ops],
            }
            for function, ops in by_function.items()
        }
        for units, by_function in plans.items()
    }


def implementation(units: str) -> str:
    """A units setting's gate implementation, named as the parity runtime level's."""
    return "coreml-" + units.lower().replace("_", "-")


def _added(before: MemoryReading, after: MemoryReading) -> dict[str, int]:
    return {
        "footprint_before": before.footprint, "footprint_after": after.footprint,
        "footprint_added": after.footprint - before.footprint,
        "wired_before": before.wired, "wired_after": after.wired,
        "wired_added": after.wired - before.wired,
    }  # fmt: skip


def read_evidence(path: Path, artifact: Path) -> dict[str, Any]:
    """A device-check file, checked against ``artifact`` (its provenance and every package
    hash) and readable as gates; InputError otherwise."""
    doc = read_raw(path)
    if doc.get("format") != FORMAT:
        raise InputError(f"{path}: not an {FORMAT} file (written by anec device-check)")
    check_recorded(doc.get("recorded"), str(path))
    expected = checked_packages(artifact)
    if doc.get("packages") != expected:
        raise InputError(
            f"{path}: measured packages {_short(doc.get('packages'))}, not this artifact's "
            f"({_short(expected)}): evidence from another artifact"
        )
    try:
        evidence_gates(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: malformed units section ({type(e).__name__}: {e})") from None
    return doc


def evidence_gates(doc: dict[str, Any]) -> list[GateResult]:
    """The device gates of a device-check file (read by `read_evidence`), each under its
    units' implementation, with its attribution and the provenance in its detail; a gate
    with a recipe threshold keeps the one it was checked against."""
    from parity.gate_registry import gate

    provenance = provenance_text(doc["recorded"])
    out = []
    for units in doc["units"].values():
        for g in units["gates"]:
            registered = gate(g["level"], g["name"])
            threshold = float(g["threshold"]) if registered.recipe_key else None
            out.append(
                registered.check(
                    float(g["value"]),  # inf and NaN are spelt as strings in JSON
                    threshold,
                    implementation=g["implementation"],
                    where=g["where"],
                    detail=f"{g['attribution']}; {provenance}",
                )
            )
    return out


def _short(packages: Any) -> str:
    if not isinstance(packages, list):
        return repr(packages)
    return ", ".join(f"{p.get('file')} {str(p.get('content_sha256'))[:12]}" for p in packages)
