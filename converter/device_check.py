"""``anec device-check ARTIFACT``: a cached decoder's own gates run by Core ML on this Mac,
per compute-units setting, with per-function timing and memory, in one evidence file.

For every units setting the cache gates (`parity.kv_gates.check_kv`: prefill, decode against
the checkpoint's fp32 continuations, extend against decode, stale rows) run through the host
loop with Core ML's predictions. The same gates run once on the emitted program in anec's MIL
evaluator (fp16), so each failure says where it comes from: the program (it fails there too)
or the device (it passes there). The gates' own calls give each function's latency; the first
load of each function is timed apart (Core ML compiles then). Memory: the process's physical
footprint and the system's wired memory before and after loading each function alone, then all
of them together (Anemll reports a multifunction package holding a copy of its weights per
loaded function: ../shared/research/anchors_runtime.md section 6).

Everything that touches Core ML is a `converter.coreml_runtime` adapter (macOS only, NEVER
RUN HERE); the tests run this module with stand-ins of the same shape, and the evidence they
write says ``origin: stand-in`` (`converter.plan.provenance`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml_runtime import (
    STATE_SHARING,
    CoreMLModel,
    MemoryProbe,
    MemoryReading,
    ModelLoader,
)
from converter.errors import InputError
from converter.evidence import Evidence
from converter.generate import Runtime, artifact_checkpoint, coreml_backend, mil_backend
from converter.hashing import mlpackage_content_hash
from converter.plan.device_bench import latency_stats
from converter.plan.device_evidence import FORMAT, read_raw
from converter.plan.provenance import check_recorded, provenance_json, provenance_text
from parity.gate import GateResult
from parity.kv_gates import check_kv
from parity.reference import Continuation

DEFAULT_UNITS = ("CPU_ONLY", "CPU_AND_NE")
PROGRAM = "mil-fp16"  # the baseline every device result is read against


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
    """What `device_check` measured; `to_json` is the evidence file."""

    artifact: str
    packages: list[dict[str, str]]
    recorded: dict[str, Any]
    program: list[GateResult]
    units: list[UnitsResult]
    memory: dict[str, Any] | None

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
        for row in (self.memory or {}).get("rows", []):
            lines.append(f"memory with {'+'.join(row['functions'])} loaded: footprint "
                         f"+{row['footprint_added'] / 2**20:.1f} MiB, wired "
                         f"+{row['wired_added'] / 2**20:.1f} MiB")  # fmt: skip
        return "\n".join(lines)


def checked_packages(runtime: Runtime) -> list[dict[str, str]]:
    """Every package of the artifact with its manifest hash, checked against its content."""
    entries = [runtime.manifest["package"], *(runtime.manifest.get("extra_packages") or [])]
    kv = runtime.manifest["kv_cache"]
    files = [c["package"] for c in kv.get("chunks") or []] or [entries[0]["file"]]
    if runtime.function_packages:
        files = [p.name for p in runtime.function_packages.values()]
    hashes = {e["file"]: e["content_sha256"] for e in entries}
    out = []
    for file in files:
        path = runtime.directory / file
        if not path.is_dir():
            raise InputError(f"{path}: the package the manifest names is missing")
        if mlpackage_content_hash(path) != hashes.get(file):
            raise InputError(f"{path}: its content differs from the hash in manifest.json")
        out.append({"file": file, "content_sha256": hashes[file]})
    return out


def continuations(runtime: Runtime) -> list[Continuation]:
    """The recipe's fixtures' greedy continuations by the checkpoint in fp32, as the
    conversion's cache gates use them (its hash checked against the manifest)."""
    import torch

    from converter.recipe import DecoderRecipe, recipe_from_dict
    from parity.fixtures import build_fixtures
    from parity.reference import continuation, originals

    recipe = recipe_from_dict(runtime.manifest["recipe"])
    assert isinstance(recipe, DecoderRecipe)
    ckpt = artifact_checkpoint(runtime.directory)
    fixtures = build_fixtures(
        recipe.fixtures.prompts, recipe.fixtures.token_ids, ckpt.tokenizer,
        recipe.shapes.sequence_length, int(runtime.manifest["vocab_size"]),
        recipe.fixtures.padded_variants,
    )  # fmt: skip
    ids = runtime.head_ids()
    head_ids = None if ids is None else torch.from_numpy(ids)
    steps = recipe.cache.decode_steps
    return [continuation(ckpt.model, f, steps, head_ids) for f in originals(fixtures)]


def memory_census(
    runtime: Runtime, units: str, load: ModelLoader, probe: MemoryProbe
) -> dict[str, Any]:
    """Footprint and wired memory added by loading each function alone, then all together."""
    packages = runtime.packages or [runtime.package]

    def load_all(names: list[str]) -> list[CoreMLModel]:
        if runtime.function_packages:  # one package per function, its function main
            return [load(runtime.function_packages[n], "main", units) for n in names]
        return [load(p, n, units) for p in packages for n in names]

    def loaded(names: list[str]) -> dict[str, Any]:
        gc.collect()
        before = probe()
        models = load_all(names)
        after = probe()
        del models
        gc.collect()
        return {"functions": names, **_added(before, after)}

    names = list(runtime.functions)
    rows = [loaded([n]) for n in names] + ([loaded(names)] if len(names) > 1 else [])
    return {"units": units, "rows": rows}


def _added(before: MemoryReading, after: MemoryReading) -> dict[str, int]:
    return {
        "footprint_before": before.footprint, "footprint_after": after.footprint,
        "footprint_added": after.footprint - before.footprint,
        "wired_before": before.wired, "wired_after": after.wired,
        "wired_added": after.wired - before.wired,
    }  # fmt: skip


def device_check(
    artifact: Path,
    units: Sequence[str],
    load: ModelLoader,
    probe: MemoryProbe | None,
    recorded: dict[str, Any],
) -> DeviceEvidence:
    """Run the artifact's cache gates under each of ``units`` through ``load``; ``probe``
    (None: no memory census) reads memory; ``recorded`` says where this ran."""
    runtime = Runtime.from_artifact(artifact)
    choice = (runtime.manifest.get("head_output") or {}).get("choice", "logits")
    if choice != "logits":
        # Core ML returns only a program's choice per chunk; the gates compare logits.
        raise InputError(
            f"{artifact}: head_output.choice is {choice}; device-check compares logits with the "
            "checkpoint's: convert the same recipe with io.output: logits"
        )
    packages = checked_packages(runtime)
    references = continuations(runtime)
    extend = int(runtime.functions["extend"].shape.tokens)
    program = check_kv(mil_backend(runtime), references, "prefill", extend, PROGRAM).gates
    baseline = {g.name: g for g in program}
    results = []
    for unit in units:
        timed = TimedLoader(load, {p: f for f, p in runtime.function_packages.items()})
        make = coreml_backend(runtime, unit, timed)
        name = "coreml-" + unit.lower().replace("_", "-")  # as the parity runtime level's
        gates = check_kv(make, references, "prefill", extend, name).gates
        results.append(UnitsResult(unit, gates, baseline, timed.functions))
    memory = None if probe is None else memory_census(runtime, units[-1], load, probe)
    return DeviceEvidence(artifact.name, packages, recorded, program, results, memory)


def read_evidence(path: Path, runtime: Runtime) -> dict[str, Any]:
    """A device-check file, checked against the artifact ``runtime`` was read from (its
    provenance and every package hash); InputError otherwise."""
    doc = read_raw(path)
    if doc.get("format") != FORMAT:
        raise InputError(f"{path}: not an {FORMAT} file (written by anec device-check)")
    check_recorded(doc.get("recorded"), str(path))
    expected = checked_packages(runtime)
    if doc.get("packages") != expected:
        raise InputError(
            f"{path}: measured packages {_short(doc.get('packages'))}, not this artifact's "
            f"({_short(expected)}): evidence from another artifact"
        )
    return doc


def evidence_gates(doc: dict[str, Any]) -> list[GateResult]:
    """The device gates of a device-check file (read by `read_evidence`), each under its
    units' implementation, with its attribution and the provenance in its detail."""
    from parity.gate import gate

    provenance = provenance_text(doc["recorded"])
    out = []
    for units in doc["units"].values():
        for g in units["gates"]:
            out.append(
                gate(g["level"], g["name"]).check(
                    float(g["value"]),  # inf and NaN are spelt as strings in JSON
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
