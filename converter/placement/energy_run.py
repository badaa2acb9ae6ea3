"""Recording an energy run on a Mac (``anec bench-device ARTIFACT --energy --baseline B``):
the thin macOS adapter over `converter.placement.energy`'s format.

    idle power (nothing running) -> cold compile of each arm (first load, timed apart) ->
    blocks alternating baseline, candidate, baseline, ... each sustained for block_seconds
    with powermetrics (cpu_power, gpu_power, ane_power) sampling over exactly that interval

Two tests: ``saturated`` (predictions back to back) and ``offered-load`` (one decision offered
per tick at tick_hz; a decision finishing after its tick interval is a missed deadline).

NEVER RUN ON THIS PLATFORM: written against coremltools' and powermetrics' documented
behaviour; what it writes is the format the analysis reads and tests.
"""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.evidence.labels import Evidence
from converter.placement.energy import ENERGY_FORMAT, MIN_PAIRS, POWER_DOMAIN

_SAMPLERS = ["--samplers", "cpu_power,gpu_power,ane_power", "-i", "100"]


def run_block(
    predict: Callable[[], Any], seconds: float, tick_hz: float | None,
    clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:  # fmt: skip
    """One sustained block: latencies, completed and (offered load) offered decisions and
    missed deadlines. Pure timing logic (tested with a fake clock)."""
    latencies: list[float] = []
    offered = missed = 0
    start = clock()
    next_tick = start
    while clock() - start < seconds:
        if tick_hz is not None:
            now = clock()
            if now < next_tick:
                sleep(next_tick - now)
            offered += 1
            next_tick += 1.0 / tick_hz
        t0 = clock()
        predict()
        latency = (clock() - t0) * 1e3
        latencies.append(latency)
        if tick_hz is not None and latency > 1e3 / tick_hz:
            missed += 1
    block: dict[str, Any] = {
        "duration_s": clock() - start, "completed": len(latencies), "latencies_ms": latencies,
    }  # fmt: skip
    if tick_hz is not None:
        block.update(offered=offered, missed_deadlines=missed)
    return block


def _with_power(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # pragma: no cover
    proc = subprocess.Popen(["sudo", "-n", "powermetrics", *_SAMPLERS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        block = work()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    if proc.returncode not in (0, -15) or "Power" not in out:
        raise InputError(f"powermetrics (sudo -n) gave no power samples: {err.strip()[:300]}")
    block["power_mw"] = out  # raw text: the analysis parses it (parse_combined_power)
    return block


def record_energy(
    candidate: Path,
    baseline: Path,
    pairs: int,
    block_seconds: float,
    tick_hz: float | None,
    units: str = "CPU_AND_NE",
    baseline_units: str = "CPU_AND_GPU",
) -> dict[str, Any]:  # pragma: no cover - macOS only, never run here
    """Record an energy run of ``candidate`` against ``baseline`` on this Mac."""
    if platform.system() != "Darwin":
        raise InputError("bench-device --energy records on Apple hardware and needs macOS; it "
                         "has never run on this platform")  # fmt: skip
    if pairs < MIN_PAIRS:
        raise InputError(f"--blocks {pairs}: at least {MIN_PAIRS} pairs give an interval")
    import coremltools as ct

    from converter.placement.device_bench import _example_inputs
    from converter.placement.dump import recording_metadata

    arms: dict[str, Any] = {}
    cold: dict[str, float] = {}
    for arm, path, unit in (("baseline", baseline, baseline_units),
                            ("candidate", candidate, units)):  # fmt: skip
        t0 = time.perf_counter()
        model = ct.models.MLModel(str(path), compute_units=ct.ComputeUnit[unit])
        inputs = _example_inputs(model.get_spec())
        model.predict(inputs)
        cold[arm] = (time.perf_counter() - t0) * 1e3  # load + compile + first prediction
        arms[arm] = (model, inputs)

    def idle_wait() -> dict[str, Any]:
        time.sleep(5.0)
        return {}

    idle = _with_power(idle_wait)
    from converter.placement.energy import parse_combined_power

    idle_samples = parse_combined_power(idle["power_mw"])
    blocks = []
    for i in range(2 * pairs):
        arm = "baseline" if i % 2 == 0 else "candidate"
        model, inputs = arms[arm]

        def sustained(m: Any = model, x: Any = inputs) -> dict[str, Any]:
            return run_block(lambda: m.predict(x), block_seconds, tick_hz)

        block = _with_power(sustained)
        blocks.append({"arm": arm, **block})
    return {
        "format": ENERGY_FORMAT,
        "evidence": Evidence.OBSERVED.value,
        "recorded": recording_metadata(),
        "test": "offered-load" if tick_hz else "saturated",
        "tick_hz": tick_hz,
        "power_domain": POWER_DOMAIN,
        "idle_mw": sum(idle_samples) / len(idle_samples),
        "cold_compile_ms": cold,
        "settings": {
            "candidate": candidate.name,
            "baseline": baseline.name,
            "units": units,
            "baseline_units": baseline_units,
            "block_seconds": block_seconds,
        },  # fmt: skip
        "blocks": blocks,
    }
