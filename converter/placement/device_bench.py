"""The macOS measurement kit (evidence ``observed``): prediction latency and NE power.

``anec bench-device ARTIFACT`` on a Mac loads the package once per compute-units setting
(CPU_ONLY and CPU_AND_NE by default), feeds fp16 inputs (numpy float16 arrays, so no
conversion happens on the way in), runs warm-up predictions, then times repeated predictions
and reports the median with its spread (p10, p90, IQR, min, max). Where ``sudo -n
powermetrics`` is permitted it samples "ANE Power" while the CPU_AND_NE runs repeat. The
result is a JSON file that ``plan-inspect --observed`` and the reports read.

NEVER RUN ON THIS PLATFORM: anec is developed on Linux, where Core ML cannot run a model.
The timing loop, statistics, powermetrics parsing and JSON reading are tested with
stand-ins and recorded-format text; loading and predicting through Core ML has not run.
coremltools' Python API offers no output backings, so outputs are allocated by Core ML.
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.evidence.labels import MEANING, Evidence
from converter.placement.provenance import check_recorded, provenance_json

BENCH_FORMAT = "anec-bench-device/1"
DEFAULT_UNITS = ("CPU_ONLY", "CPU_AND_NE")
_ANE_POWER = re.compile(r"^\s*ANE Power:\s*([0-9]+(?:\.[0-9]+)?)\s*mW\s*$", re.MULTILINE)


@dataclass(frozen=True)
class LatencyStats:
    """Latency of repeated predictions, in milliseconds."""

    runs: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    iqr_ms: float
    min_ms: float
    max_ms: float


def _quantile(sorted_ms: list[float], q: float) -> float:
    # Linear interpolation between closest ranks, as numpy's default.
    pos = (len(sorted_ms) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def latency_stats(samples_ms: Sequence[float]) -> LatencyStats:
    """Median and spread of latency samples (at least one)."""
    if not samples_ms:
        raise ValueError("no latency samples")
    s = sorted(float(x) for x in samples_ms)
    return LatencyStats(
        runs=len(s),
        median_ms=statistics.median(s),
        p10_ms=_quantile(s, 0.10),
        p90_ms=_quantile(s, 0.90),
        iqr_ms=_quantile(s, 0.75) - _quantile(s, 0.25),
        min_ms=s[0],
        max_ms=s[-1],
    )


def measure(
    predict: Callable[[], Any],
    runs: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Call ``predict`` ``warmup`` times untimed, then ``runs`` times; milliseconds per call."""
    if runs < 1 or warmup < 0:
        raise InputError(f"runs must be >= 1 and warm-up >= 0 (got {runs}, {warmup})")
    for _ in range(warmup):
        predict()
    samples = []
    for _ in range(runs):
        start = clock()
        predict()
        samples.append((clock() - start) * 1e3)
    return samples


def parse_powermetrics(text: str) -> list[float]:
    """Every "ANE Power: N mW" sample in powermetrics output, in mW."""
    return [float(m) for m in _ANE_POWER.findall(text)]


def power_summary(samples_mw: Sequence[float], note: str = "") -> dict[str, Any]:
    """Mean / median / max NE power of the samples, or why there are none."""
    if not samples_mw:
        return {"available": False, "reason": note or "no 'ANE Power' lines in the output"}
    return {
        "available": True,
        "samples": len(samples_mw),
        "mean_mw": statistics.fmean(samples_mw),
        "median_mw": statistics.median(samples_mw),
        "max_mw": max(samples_mw),
        "active": any(v > 0 for v in samples_mw),
        "note": note,
    }


# --------------------------------------------------------------------------- macOS only


def _example_inputs(spec: Any) -> dict[str, Any]:  # pragma: no cover - macOS only
    import numpy as np
    from coremltools.proto import FeatureTypes_pb2 as ft

    out = {}
    for feature in spec.description.input:
        array = feature.type.multiArrayType
        shape = tuple(int(d) for d in array.shape)
        if array.dataType == ft.ArrayFeatureType.FLOAT16:
            out[feature.name] = np.zeros(shape, dtype=np.float16)
        elif array.dataType == ft.ArrayFeatureType.INT32:
            out[feature.name] = np.zeros(shape, dtype=np.int32)
        else:
            out[feature.name] = np.zeros(shape, dtype=np.float32)
    return out


def _sample_power(
    run: Callable[[], list[float]], interval_ms: int
) -> tuple[list[float], dict[str, Any]]:  # pragma: no cover - macOS only
    cmd = ["sudo", "-n", "powermetrics", "--samplers", "ane_power", "-i", str(interval_ms)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return run(), power_summary([], f"powermetrics could not start: {e}")
    try:
        samples = run()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    note = "" if proc.returncode in (0, -15) else err.strip()[:300]
    return samples, power_summary(parse_powermetrics(out), note or "not permitted (sudo -n)")


def bench_package(
    package: Path, runs: int, warmup: int, units: Sequence[str], power: bool
) -> dict[str, Any]:  # pragma: no cover - macOS only, never run here
    """Load and time ``package`` per compute units on this Mac; the ``observed`` document."""
    if platform.system() != "Darwin":
        raise InputError(
            "bench-device measures on Apple hardware and needs macOS; it has never run on "
            "this platform"
        )
    import coremltools as ct

    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.placement.dump import recording_metadata

    results: dict[str, Any] = {}
    for unit in units:
        start = time.perf_counter()
        model = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit[unit])
        load_ms = (time.perf_counter() - start) * 1e3
        inputs = _example_inputs(model.get_spec())

        def run(model: Any = model, inputs: dict[str, Any] = inputs) -> list[float]:
            return measure(lambda: model.predict(inputs), runs, warmup)

        if power and unit != "CPU_ONLY":
            samples, power_doc = _sample_power(run, 100)
        else:
            samples, power_doc = run(), power_summary([], "not sampled")
        results[unit] = {
            "load_ms": load_ms,
            "latency": asdict(latency_stats(samples)),
            "samples_ms": samples,
            "power": power_doc,
        }
    return {
        "format": BENCH_FORMAT,
        "evidence": Evidence.OBSERVED.value,
        "package": package.name,
        "content_sha256": mlpackage_content_hash(package),
        "recorded": recording_metadata(),
        "settings": {"runs": runs, "warmup": warmup, "inputs": "zeros, numpy float16"},
        "results": results,
    }


# --------------------------------------------------------------------------- reading


@dataclass
class Observed:
    """A bench-device result read back: latency (and power) per compute units."""

    package: str
    content_sha256: str
    recorded: dict[str, Any]
    latency: dict[str, LatencyStats]
    power: dict[str, dict[str, Any]]

    def speedup(self, slow: str = "CPU_ONLY", fast: str = "CPU_AND_NE") -> dict[str, Any] | None:
        """Median ratio and the ratio the spread still supports (slow p10 / fast p90)."""
        if slow not in self.latency or fast not in self.latency:
            return None
        a, b = self.latency[slow], self.latency[fast]
        return {
            "of": f"{slow} / {fast}",
            "median_ratio": a.median_ms / b.median_ms,
            "supported_ratio": a.p10_ms / b.p90_ms,
            "note": "claim no more than supported_ratio (SPEC 6: the lower bound of the "
            "measurement)",
        }

    def to_json(self) -> dict[str, Any]:
        """The ``observed`` section of a report."""
        energy = {}
        for unit, p in self.power.items():
            if p.get("available") and unit in self.latency:
                energy[unit] = p["mean_mw"] * self.latency[unit].median_ms / 1e3  # mJ
        return {
            "evidence": Evidence.OBSERVED.value,
            "meaning": MEANING[Evidence.OBSERVED],
            "package": self.package,
            "content_sha256": self.content_sha256,
            "recorded": self.recorded,
            **provenance_json(self.recorded),
            "latency": {u: asdict(s) for u, s in self.latency.items()},
            "power": self.power,
            "energy_mj_per_call": energy,
            "speedup": self.speedup(),
        }


def read_bench(path: Path, content_sha256: str | None = None) -> Observed:
    """Read a bench-device JSON (InputError when malformed or for another package)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read the bench-device result: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != BENCH_FORMAT:
        raise InputError(f"{path}: not an {BENCH_FORMAT} file")
    if doc.get("evidence") != Evidence.OBSERVED.value:
        raise InputError(f"{path}: evidence is {doc.get('evidence')!r}, expected 'observed'")
    sha = str(doc.get("content_sha256", ""))
    recorded = check_recorded(doc.get("recorded"), str(path))
    if content_sha256 is not None and sha != content_sha256:
        raise InputError(
            f"{path}: measured package {sha[:12]}, not this package ({content_sha256[:12]})"
        )
    latency: dict[str, LatencyStats] = {}
    power: dict[str, dict[str, Any]] = {}
    results = doc.get("results")
    if not isinstance(results, dict) or not results:
        raise InputError(f"{path}: no results")
    for unit, r in results.items():
        try:
            samples = r.get("samples_ms")
            # Recompute from the samples when present: the file's own summary is not trusted.
            latency[unit] = latency_stats(samples) if samples else LatencyStats(**r["latency"])
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise InputError(f"{path}: results[{unit!r}]: malformed latency: {e}") from None
        power[unit] = dict(r.get("power") or {"available": False, "reason": "not recorded"})
    return Observed(
        package=str(doc.get("package", "")),
        content_sha256=sha,
        recorded=recorded,
        latency=latency,
        power=power,
    )
