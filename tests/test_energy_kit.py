"""The energy-per-decision kit on recorded-format inputs (stand-ins: no Mac records here):
parsing, S / R / S x R arithmetic, bootstrap intervals, offered load, refusal to overclaim."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from converter.commands import main
from converter.errors import InputError
from converter.placement.energy import ENERGY_FORMAT, parse_combined_power, read_energy
from converter.placement.energy_report import Interval, bootstrap, claim, energy_report
from converter.placement.energy_run import run_block

# powermetrics --samplers cpu_power,gpu_power,ane_power, as it prints two samples.
POWERMETRICS = """*** Sampled system activity (Mon Nov 30 10:00:00 2026) (100.12ms elapsed) ***

**** Processor usage ****

CPU Power: 900 mW
GPU Power: 40 mW
ANE Power: 1060 mW
Combined Power (CPU + GPU + ANE): 2000 mW

*** Sampled system activity (Mon Nov 30 10:00:00 2026 +0000) (100.08ms elapsed) ***

CPU Power: 1000 mW
GPU Power: 40 mW
ANE Power: 960 mW
Combined Power (CPU + GPU + ANE): 2000 mW
"""


def block(arm: str, t_ms: float, power_mw: float | str, n: int = 100, **extra: Any) -> dict:
    return {"arm": arm, "duration_s": n * t_ms / 1e3, "completed": n,
            "latencies_ms": [t_ms * (0.9 + 0.2 * i / n) for i in range(n)],
            "power_mw": power_mw if isinstance(power_mw, str) else [power_mw] * 3,
            **extra}  # fmt: skip


def recorded(blocks: list[dict], **extra: Any) -> dict:
    return {"format": ENERGY_FORMAT, "evidence": "observed",
            "recorded": {"origin": "stand-in"}, "test": "saturated", "tick_hz": None,
            "power_domain": "CPU + GPU + ANE (powermetrics Combined Power)", "idle_mw": 500.0,
            "cold_compile_ms": {"baseline": 900.0, "candidate": 2400.0}, "blocks": blocks,
            **extra}  # fmt: skip


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "energy.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(autouse=True)
def _stand_ins(stand_in_evidence: None) -> None:
    """Every run here is a stand-in."""


def test_parse_powermetrics_combined_and_per_domain() -> None:
    assert parse_combined_power(POWERMETRICS) == [2000.0, 2000.0]
    without = "\n".join(x for x in POWERMETRICS.splitlines() if "Combined" not in x)
    assert parse_combined_power(without) == [2000.0, 2000.0]  # CPU + GPU + ANE per sample


def test_speedup_power_ratio_and_energy_gain_count_time_once(tmp_path: Path) -> None:
    # Baseline 11 ms at 6 W, candidate 4 ms at 2 W (powermetrics text): S = 2.75, R = 3,
    # energy gain = E_base / E_cand = (6 x 11) / (2 x 4) = 8.25 = S x R, not S x R x S.
    blocks = [b for _ in range(5) for b in (block("baseline", 11.0, 6000.0),
                                            block("candidate", 4.0, POWERMETRICS))]  # fmt: skip
    doc = energy_report(read_energy(write(tmp_path, recorded(blocks))))
    i = doc["intervals"]
    assert i["speedup_S"]["estimate"] == pytest.approx(2.75)
    assert i["power_ratio_R"]["estimate"] == pytest.approx(3.0)
    assert i["energy_gain_SxR"]["estimate"] == pytest.approx(8.25)
    base, cand = doc["arms"]["baseline"], doc["arms"]["candidate"]
    assert base["energy_mj_per_decision"] / cand["energy_mj_per_decision"] == pytest.approx(8.25)
    # Idle (0.5 W) subtracted: (5.5 x 11) / (1.5 x 4).
    assert i["energy_gain_idle_subtracted"]["estimate"] == pytest.approx(5.5 * 11 / (1.5 * 4))
    assert cand["energy_mj_per_decision_idle_subtracted"] == pytest.approx(1.5 * 4)
    assert cand["latency_p50_ms"] < cand["latency_p95_ms"]
    assert doc["cold_compile_ms"] == {"baseline": 900.0, "candidate": 2400.0}
    assert "not whole-machine" not in doc["power_domain"] and doc["power_domain"]
    # Identical pairs: the interval is the point; the claim is the floor of its lower bound.
    assert i["energy_gain_SxR"]["low"] == pytest.approx(8.25)
    assert any(
        c.startswith("energy gain per decision (raw): at least 8-fold") for c in doc["claims"]
    )


def test_bootstrap_interval_is_paired_reproducible_and_not_clipped() -> None:
    ratios = [0.7, 1.4, 0.9, 1.6, 0.8, 1.2]
    a, b = bootstrap(ratios), bootstrap(ratios)
    assert a == b and a.pairs == 6
    assert a.low < 1 < a.high and a.low < a.estimate < a.high
    assert a.estimate == pytest.approx(math.exp(sum(map(math.log, ratios)) / 6))


@pytest.mark.parametrize(
    ("low", "expected"),
    [
        (3.99, "at least 3-fold"),
        (2.0, "at least 2-fold"),
        (1.9, "no N-fold claim"),
        (0.95, "no gain claimed"),
    ],  # fmt: skip
)
def test_no_n_fold_claim_unless_the_lower_bound_reaches_n(low: float, expected: str) -> None:
    text = claim("energy gain", Interval(estimate=7.0, low=low, high=9.0, pairs=5))
    assert expected in text
    if low < 2:
        assert "-fold" not in text.replace("N-fold", "")


def test_a_noisy_large_point_estimate_is_not_claimed(tmp_path: Path) -> None:
    # Per-pair gains 2, 24, 2, 20, 2: the point estimate is about 5x; the lower bound is 2.
    powers = [6000.0, 500.0, 6000.0, 600.0, 6000.0]
    blocks = [b for p in powers for b in (block("baseline", 10.0, 6000.0),
                                          block("candidate", 5.0, p))]  # fmt: skip
    doc = energy_report(read_energy(write(tmp_path, recorded(blocks))))
    gain = doc["intervals"]["energy_gain_SxR"]
    assert gain["estimate"] > 5 and gain["low"] < 3
    raw = next(c for c in doc["claims"] if c.startswith("energy gain per decision (raw)"))
    assert "at least 2-fold" in raw and "at least 5-fold" not in raw
    # A candidate block at the idle power: no idle-subtracted ratio rather than a division.
    assert any("idle subtracted): not computed" in c for c in doc["claims"])


def test_offered_load_reports_missed_deadlines_and_completed_decisions(tmp_path: Path) -> None:
    blocks = [b for _ in range(5) for b in (
        block("baseline", 30.0, 6000.0, offered=110, missed_deadlines=12),
        block("candidate", 20.0, 3000.0, offered=100, missed_deadlines=0))]  # fmt: skip
    doc = energy_report(read_energy(write(
        tmp_path, recorded(blocks, test="offered-load", tick_hz=30.0))))  # fmt: skip
    base = doc["arms"]["baseline"]
    assert (base["offered_decisions"], base["missed_deadlines"]) == (550, 60)
    assert base["completed_decisions"] == 500 and base["deadline_ms"] == pytest.approx(33.33, 1e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(blocks=d["blocks"][:8]), "at least 5 alternating"),
        (lambda d: d["blocks"][1].update(arm="baseline"), "must alternate"),
        (lambda d: d.update(power_domain=""), "power_domain: name the power domain"),
        (lambda d: d["blocks"][3].update(completed=0), r"blocks\[3\]: completed"),
        (lambda d: d["cold_compile_ms"].pop("candidate"), "cold_compile_ms: candidate"),
        (lambda d: d.update(test="offered-load", tick_hz=None), "tick_hz"),
    ],
)
def test_malformed_runs_are_refused_naming_the_field(tmp_path: Path, change, message) -> None:  # type: ignore[no-untyped-def]
    doc = recorded([b for _ in range(5) for b in (block("baseline", 10.0, 5000.0),
                                                  block("candidate", 5.0, 2000.0))])  # fmt: skip
    change(doc)
    with pytest.raises(InputError, match=message):
        read_energy(write(tmp_path, doc))


def test_a_stand_in_is_refused_outside_the_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANEC_ACCEPT_STAND_IN_EVIDENCE")
    doc = recorded([b for _ in range(5) for b in (block("baseline", 10.0, 5000.0),
                                                  block("candidate", 5.0, 2000.0))])  # fmt: skip
    with pytest.raises(InputError, match="stand-in"):
        read_energy(write(tmp_path, doc))


def test_run_block_counts_offered_completed_and_missed_with_a_fake_clock() -> None:
    now = [0.0]
    costs = iter([0.010, 0.050] * 100)  # 10 ms and 50 ms predictions, alternating

    def predict() -> None:
        now[0] += next(costs)

    def sleep(s: float) -> None:
        now[0] += s

    out = run_block(predict, 0.5, 25.0, clock=lambda: now[0], sleep=sleep)  # 40 ms ticks
    assert out["offered"] == out["completed"] and out["completed"] >= 10
    assert out["missed_deadlines"] == sum(x > 40 for x in out["latencies_ms"]) > 0


def test_energy_report_command_prints_the_stand_in_label(tmp_path: Path) -> None:
    doc = recorded([b for _ in range(5) for b in (block("baseline", 11.0, 6000.0),
                                                  block("candidate", 4.0, 2000.0))])  # fmt: skip
    result = CliRunner().invoke(main, ["energy-report", str(write(tmp_path, doc))])
    assert result.exit_code == 0, result.output
    assert "STAND-IN" in result.output and "power domain: CPU + GPU + ANE" in result.output
    assert "speedup_S" in result.output and "P95" in result.output
