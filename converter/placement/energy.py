"""Energy per decision (evidence ``observed``): the analysis of a recorded energy run.

A run (``anec bench-device ARTIFACT --energy --baseline BASELINE``, macOS, recorded by
`converter.placement.energy_run`) holds at least five sustained blocks per arm, alternating
baseline and candidate, each with its decisions, latencies and power samples over the same
interval, plus the idle power of the same power domain and each arm's cold compile time.
This module reads such a file and computes, per arm and per pair of blocks:

* t, the time per completed decision (block duration / completed decisions); P, the average
  power over the same interval; E = P x t, raw and with the idle power subtracted;
* S = t_base / t_cand (speed-up), R = P_base / P_cand (power ratio) and the energy gain
  S x R = E_base / E_cand (time enters once: never S x R x S);
* P50 and P95 latency per arm; for the equal-offered-load test, offered and completed
  decisions and missed deadlines (latency above the tick interval);
* a 95 % bootstrap interval of each ratio over the paired blocks (the geometric mean of the
  per-pair ratios, pairs resampled with replacement, fixed seed), kept as computed (never
  clipped at 1);
* a claim of an N-fold gain only when the interval's lower bound reaches N.

The power domain is named in every report: powermetrics' CPU + GPU + ANE telemetry is not
whole-machine power (no DRAM, display, SSD, fans). Cold compile is reported apart from the
sustained blocks and never mixed into t.

NEVER RUN ON THIS PLATFORM: the recording needs macOS; the parsing, arithmetic and the
refusal to overclaim are tested here on recorded-format inputs.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from converter.errors import InputError
from converter.evidence.labels import Evidence

ENERGY_FORMAT = "anec-energy/1"
MIN_PAIRS = 5
BOOTSTRAP_SAMPLES = 10_000
Arm = Literal["baseline", "candidate"]
Test = Literal["saturated", "offered-load"]

# powermetrics --samplers cpu_power,gpu_power,ane_power prints per sample, in mW:
#   CPU Power: 1234 mW / GPU Power: 56 mW / ANE Power: 789 mW /
#   Combined Power (CPU + GPU + ANE): 2079 mW
_DOMAIN_LINE = re.compile(
    r"^\s*(CPU|GPU|ANE) Power:\s*([0-9]+(?:\.[0-9]+)?)\s*mW\s*$", re.MULTILINE
)
_COMBINED = re.compile(
    r"^\s*Combined Power \(CPU \+ GPU \+ ANE\):\s*([0-9]+(?:\.[0-9]+)?)\s*mW\s*$", re.MULTILINE
)
POWER_DOMAIN = (
    "CPU + GPU + ANE package telemetry (powermetrics 'Combined Power'); not whole-machine "
    "power: DRAM, display, storage and fans are outside it"
)


def parse_combined_power(text: str) -> list[float]:
    """The "Combined Power (CPU + GPU + ANE)" samples of powermetrics output, in mW; where a
    sample has no combined line, the sum of its CPU, GPU and ANE lines."""
    combined = [float(v) for v in _COMBINED.findall(text)]
    if combined:
        return combined
    samples: list[float] = []
    current: dict[str, float] = {}
    for domain, value in _DOMAIN_LINE.findall(text):
        if domain in current:  # a new sample starts
            samples.append(sum(current.values()))
            current = {}
        current[domain] = float(value)
    if current:
        samples.append(sum(current.values()))
    return samples


@dataclass(frozen=True)
class Block:
    """One sustained block of one arm."""

    arm: Arm
    duration_s: float
    completed: int  # completed decisions
    latencies_ms: list[float]
    power_mw: list[float]  # samples over the same interval
    offered: int | None = None  # offered-load test: decisions offered at the tick rate
    missed_deadlines: int | None = None

    @property
    def t_s(self) -> float:
        """Time per completed decision."""
        return self.duration_s / self.completed

    @property
    def power_w(self) -> float:
        """Average power over the block, watts."""
        return statistics.fmean(self.power_mw) / 1e3

    def energy_j(self, idle_w: float = 0.0) -> float:
        """Energy per completed decision, joules (``idle_w`` subtracted from P first)."""
        return (self.power_w - idle_w) * self.t_s


@dataclass(frozen=True)
class EnergyRun:
    """A recorded run: blocks in recording order, idle power, cold compile, settings."""

    test: Test
    tick_hz: float | None
    power_domain: str
    idle_mw: float
    cold_compile_ms: dict[str, float]
    blocks: list[Block]
    recorded: dict[str, Any] = field(default_factory=dict)

    def pairs(self) -> list[tuple[Block, Block]]:
        """(baseline, candidate) pairs in recording order; the arms must alternate."""
        pairs = []
        for i in range(0, len(self.blocks) - 1, 2):
            a, b = self.blocks[i], self.blocks[i + 1]
            arms = {a.arm, b.arm}
            if arms != {"baseline", "candidate"}:
                raise InputError(
                    f"blocks[{i}], blocks[{i + 1}]: arms {a.arm}, {b.arm}; the blocks must "
                    "alternate baseline and candidate"
                )
            pairs.append((a, b) if a.arm == "baseline" else (b, a))
        return pairs


def _number(doc: dict[str, Any], key: str, where: str, positive: bool = True) -> float:
    value: Any = doc.get(key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise InputError(f"{where}: {key}: expected a {'positive ' if positive else ''}number, "
                         f"got {value!r}")  # fmt: skip
    return float(value)


def _samples(doc: dict[str, Any], key: str, where: str) -> list[float]:
    value = doc.get(key)
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: {key}: expected a non-empty list of numbers")
    if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in value):
        raise InputError(f"{where}: {key}: expected finite numbers >= 0")
    return [float(v) for v in value]


def _block(doc: Any, where: str, test: Test) -> Block:
    if not isinstance(doc, dict) or doc.get("arm") not in ("baseline", "candidate"):
        raise InputError(f"{where}: arm: expected baseline or candidate")
    completed = doc.get("completed")
    if not isinstance(completed, int) or isinstance(completed, bool) or completed < 1:
        raise InputError(f"{where}: completed: expected a count >= 1, got {completed!r}")
    power = doc.get("power_mw")
    if isinstance(power, str):  # raw powermetrics text recorded over the block
        power = parse_combined_power(power)
    offered = missed = None
    if test == "offered-load":
        offered = int(_number(doc, "offered", where))
        missed = int(_number(doc, "missed_deadlines", where, positive=False))
    return Block(
        arm=doc["arm"],
        duration_s=_number(doc, "duration_s", where),
        completed=completed,
        latencies_ms=_samples(doc, "latencies_ms", where),
        power_mw=_samples({"power_mw": power}, "power_mw", where),
        offered=offered,
        missed_deadlines=missed,
    )


def read_energy(path: Path) -> EnergyRun:
    """Read a recorded energy run; InputError naming the file and field when malformed."""
    from converter.placement.provenance import check_recorded

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read the energy run: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != ENERGY_FORMAT:
        raise InputError(f"{path}: not an {ENERGY_FORMAT} file")
    if doc.get("evidence") != Evidence.OBSERVED.value:
        raise InputError(f"{path}: evidence is {doc.get('evidence')!r}, expected 'observed'")
    test = doc.get("test")
    if test not in ("saturated", "offered-load"):
        raise InputError(f"{path}: test: expected saturated or offered-load, got {test!r}")
    tick = _number(doc, "tick_hz", str(path)) if test == "offered-load" else None
    domain = doc.get("power_domain")
    if not isinstance(domain, str) or not domain.strip():
        raise InputError(f"{path}: power_domain: name the power domain the samples cover")
    blocks_doc = doc.get("blocks")
    if not isinstance(blocks_doc, list):
        raise InputError(f"{path}: blocks: expected a list")
    blocks = [_block(b, f"{path}: blocks[{i}]", test) for i, b in enumerate(blocks_doc)]
    compile_doc = doc.get("cold_compile_ms") or {}
    cold = {arm: _number(compile_doc, arm, f"{path}: cold_compile_ms")
            for arm in ("baseline", "candidate")}  # fmt: skip
    run = EnergyRun(
        test=test, tick_hz=tick, power_domain=domain,
        idle_mw=_number(doc, "idle_mw", str(path), positive=False), cold_compile_ms=cold,
        blocks=blocks, recorded=check_recorded(doc.get("recorded"), str(path)),
    )  # fmt: skip
    pairs = run.pairs()
    if len(pairs) < MIN_PAIRS or len(blocks) != 2 * len(pairs):
        raise InputError(
            f"{path}: blocks: {len(blocks)} block(s); at least {MIN_PAIRS} alternating "
            "baseline/candidate pairs are needed for an interval"
        )
    return run
