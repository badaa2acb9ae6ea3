"""The energy-per-decision report from a recorded run (`converter.placement.energy`): per-arm
figures, paired ratios with 95 % bootstrap intervals, and claims no stronger than the
interval's lower bound."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from converter.evidence.labels import MEANING, Evidence
from converter.placement.energy import BOOTSTRAP_SAMPLES, Block, EnergyRun
from converter.placement.provenance import provenance_json, provenance_text


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Interval:
    """A ratio: the geometric mean over paired blocks and its 95 % bootstrap interval."""

    estimate: float
    low: float
    high: float
    pairs: int


def geometric_mean(ratios: list[float]) -> float:
    """exp(mean(log r)): the average of ratios that treats r and 1/r alike."""
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def bootstrap(ratios: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> Interval:
    """The geometric mean of per-pair ratios and its 95 % percentile bootstrap interval,
    resampling pairs with replacement (fixed seed: the same file gives the same interval).
    Nothing is clipped: an interval reaching below 1 says so."""
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"ratios must be positive and finite, got {ratios}")
    rng = random.Random(seed)
    n = len(ratios)
    means = sorted(geometric_mean([ratios[rng.randrange(n)] for _ in range(n)])
                   for _ in range(samples))  # fmt: skip
    return Interval(geometric_mean(ratios), quantile(means, 0.025), quantile(means, 0.975), n)


def claim(what: str, interval: Interval) -> str:
    """What may be said about a gain: an N-fold claim only when the lower bound reaches N."""
    n = math.floor(interval.low)
    if n >= 2:
        return f"{what}: at least {n}-fold (95 % interval {interval.low:.3g} - {interval.high:.3g})"
    if interval.low > 1:
        return (f"{what}: {interval.low:.3g}x or more, no N-fold claim (lower bound below 2; "
                f"interval {interval.low:.3g} - {interval.high:.3g})")  # fmt: skip
    return (f"{what}: no gain claimed (interval {interval.low:.3g} - {interval.high:.3g} "
            "reaches 1 or below)")  # fmt: skip


def _arm(blocks: list[Block], idle_w: float, tick_hz: float | None) -> dict[str, Any]:
    latencies = [x for b in blocks for x in b.latencies_ms]
    out: dict[str, Any] = {
        "blocks": len(blocks),
        "completed_decisions": sum(b.completed for b in blocks),
        "t_ms_per_decision": 1e3
        * sum(b.duration_s for b in blocks)
        / sum(b.completed for b in blocks),
        "power_w": statistics.fmean(b.power_w for b in blocks),
        "energy_mj_per_decision": 1e3 * statistics.fmean(b.energy_j() for b in blocks),
        "energy_mj_per_decision_idle_subtracted": 1e3
        * statistics.fmean(b.energy_j(idle_w) for b in blocks),
        "latency_p50_ms": quantile(latencies, 0.50),
        "latency_p95_ms": quantile(latencies, 0.95),
    }
    if tick_hz is not None:
        out["offered_decisions"] = sum(b.offered or 0 for b in blocks)
        out["missed_deadlines"] = sum(b.missed_deadlines or 0 for b in blocks)
        out["deadline_ms"] = 1e3 / tick_hz
    return out


def energy_report(run: EnergyRun) -> dict[str, Any]:
    """The report: per arm, per-pair ratios and their intervals, the claims."""
    idle_w = run.idle_mw / 1e3
    pairs = run.pairs()
    speed = [b.t_s / c.t_s for b, c in pairs]  # S = t_base / t_cand
    power = [b.power_w / c.power_w for b, c in pairs]  # R = P_base / P_cand
    gain = [s * r for s, r in zip(speed, power, strict=True)]  # S x R = E_base / E_cand
    # Idle-subtracted ratios only where every block draws more than idle (else undefined).
    idle_ok = all(x.power_w > idle_w for pair in pairs for x in pair)
    net_power = [(b.power_w - idle_w) / (c.power_w - idle_w) for b, c in pairs] if idle_ok else []
    net_gain = [b.energy_j(idle_w) / c.energy_j(idle_w) for b, c in pairs] if idle_ok else []
    intervals = {
        "speedup_S": bootstrap(speed),
        "power_ratio_R": bootstrap(power),
        "energy_gain_SxR": bootstrap(gain),
    }
    if idle_ok:
        intervals["power_ratio_R_idle_subtracted"] = bootstrap(net_power)
        intervals["energy_gain_idle_subtracted"] = bootstrap(net_gain)
    claims = [claim("speed-up", intervals["speedup_S"]),
              claim("energy gain per decision (raw)", intervals["energy_gain_SxR"])]  # fmt: skip
    if idle_ok:
        claims.append(claim("energy gain per decision (idle subtracted)",
                            intervals["energy_gain_idle_subtracted"]))  # fmt: skip
    else:
        claims.append("energy gain per decision (idle subtracted): not computed - a block's "
                      "average power is at or below the idle power")  # fmt: skip
    return {
        "evidence": Evidence.OBSERVED.value,
        "meaning": MEANING[Evidence.OBSERVED],
        "recorded": run.recorded,
        **provenance_json(run.recorded),
        "test": run.test,
        "tick_hz": run.tick_hz,
        "power_domain": run.power_domain,
        "idle_power_w": idle_w,
        "cold_compile_ms": run.cold_compile_ms,
        "arms": {
            arm: _arm([b for b in run.blocks if b.arm == arm], idle_w, run.tick_hz)
            for arm in ("baseline", "candidate")
        },  # fmt: skip
        "pairs": [{"S": s, "R": r, "SxR": g} for s, r, g in zip(speed, power, gain, strict=True)],
        "intervals": {k: asdict(v) for k, v in intervals.items()},
        "claims": claims,
        "note": "S = t_base / t_cand, R = P_base / P_cand, energy gain = S x R = E_base / "
        "E_cand (time counted once); intervals: 95 % bootstrap over paired blocks, not clipped",
    }


def report_text(doc: dict[str, Any]) -> str:
    """The report for the terminal."""
    lines = [
        f"evidence: observed ({doc['test']}"
        + (f", {doc['tick_hz']:g} decisions/s offered" if doc["tick_hz"] else "")
        + ")",
        f"provenance: {provenance_text(doc['recorded'])}",
        f"power domain: {doc['power_domain']}",
        f"idle power: {doc['idle_power_w']:.3g} W; cold compile (separate, not in t): "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in doc["cold_compile_ms"].items()),
    ]
    for arm, a in doc["arms"].items():
        extra = ""
        if "missed_deadlines" in a:
            extra = (f"; offered {a['offered_decisions']}, missed deadlines "
                     f"{a['missed_deadlines']} (> {a['deadline_ms']:.3g} ms)")  # fmt: skip
        lines.append(
            f"{arm:<9} t {a['t_ms_per_decision']:.3g} ms/decision, P {a['power_w']:.3g} W, "
            f"E {a['energy_mj_per_decision']:.3g} mJ (idle-subtracted "
            f"{a['energy_mj_per_decision_idle_subtracted']:.3g} mJ), P50 "
            f"{a['latency_p50_ms']:.3g} ms, P95 {a['latency_p95_ms']:.3g} ms, "
            f"{a['completed_decisions']} decisions in {a['blocks']} blocks{extra}"
        )
    for name, i in doc["intervals"].items():
        lines.append(f"{name:<32} {i['estimate']:.3g}  (95 % {i['low']:.3g} - {i['high']:.3g},"
                     f" {i['pairs']} pairs)")  # fmt: skip
    lines += doc["claims"]
    return "\n".join(line for line in lines if line)
