"""The measurement kit's pure parts: timing loop, statistics, powermetrics parsing, reading
results. Loading and predicting through Core ML needs macOS and has never run here."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import pytest

from converter.errors import InputError
from converter.placement.device_bench import (
    BENCH_FORMAT,
    latency_stats,
    measure,
    parse_powermetrics,
    power_summary,
    read_bench,
)

# The shape of `sudo powermetrics --samplers cpu_power,gpu_power,ane_power -i 1000` output
# on Apple silicon (hollance/neural-engine docs/is-model-using-ane.md; asitop parses the same).
POWERMETRICS = """Machine model: Mac14,2
OS version: 23E224

*** Sampled system activity (Tue Apr  2 10:00:00 2024 +0200) (1003.21ms elapsed) ***

**** Processor usage ****

CPU Power: 812 mW
GPU Power: 14 mW
ANE Power: 0 mW
Combined Power (CPU + GPU + ANE): 826 mW

*** Sampled system activity (Tue Apr  2 10:00:01 2024 +0200) (1001.87ms elapsed) ***

CPU Power: 640 mW
GPU Power: 9 mW
ANE Power: 1234.5 mW
Combined Power (CPU + GPU + ANE): 1883 mW
"""


# Recorded plans and measurements here are stand-ins: the test-only switch (conftest.py).
pytestmark = pytest.mark.usefixtures("stand_in_evidence")


def test_latency_statistics() -> None:
    s = latency_stats([float(x) for x in range(10, 0, -1)])
    assert s.runs == 10 and s.median_ms == 5.5
    assert s.p10_ms == pytest.approx(1.9) and s.p90_ms == pytest.approx(9.1)
    assert s.iqr_ms == pytest.approx(4.5) and (s.min_ms, s.max_ms) == (1.0, 10.0)
    with pytest.raises(ValueError):
        latency_stats([])


def test_measure_times_only_the_runs_after_the_warm_up() -> None:
    calls: list[str] = []
    ticks = iter(float(i) for i in range(100))

    def predict() -> None:
        calls.append("p")

    samples = measure(predict, runs=3, warmup=2, clock=lambda: next(ticks) / 1000)
    assert len(calls) == 5
    assert samples == pytest.approx([1.0, 1.0, 1.0])  # clock ticks 1 ms per read
    with pytest.raises(InputError):
        measure(predict, runs=0, warmup=0)


def test_powermetrics_ane_lines_are_parsed() -> None:
    assert parse_powermetrics(POWERMETRICS) == [0.0, 1234.5]
    assert parse_powermetrics("CPU Power: 5 mW\n") == []
    summary = power_summary(parse_powermetrics(POWERMETRICS))
    assert summary["available"] and summary["active"] and summary["max_mw"] == 1234.5
    assert not power_summary([], "sudo: a password is required")["available"]


def _recorded(sha: str, cpu: list[float], ne: list[float]) -> dict[str, Any]:
    """A result in the format bench_package writes."""

    def unit(samples: list[float], power: dict[str, Any]) -> dict[str, Any]:
        # A deliberately wrong summary: the reader must recompute it from the samples.
        return {
            "load_ms": 800.0,
            "latency": {
                "runs": 1,
                "median_ms": 0.001,
                "p10_ms": 0.0,
                "p90_ms": 0.0,
                "iqr_ms": 0.0,
                "min_ms": 0.0,
                "max_ms": 0.0,
            },
            "samples_ms": samples,
            "power": power,
        }

    return {
        "format": BENCH_FORMAT,
        "evidence": "observed",
        "package": "m.mlpackage",
        "content_sha256": sha,
        "recorded": {"origin": "stand-in", "machine": "arm64"},
        "settings": {"runs": len(ne), "warmup": 5},
        "results": {
            "CPU_ONLY": unit(cpu, {"available": False, "reason": "not sampled"}),
            "CPU_AND_NE": unit(ne, power_summary([400.0, 600.0])),
        },
    }


def test_a_recorded_result_is_read_with_its_spread_and_a_supported_speedup(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bench.json"
    cpu = [40.0 + i for i in range(11)]  # 40..50
    ne = [10.0 + i / 2 for i in range(11)]  # 10..15
    path.write_text(json.dumps(_recorded("ab" * 32, cpu, ne)))
    obs = read_bench(path, "ab" * 32)
    assert obs.latency["CPU_AND_NE"].median_ms == 12.5
    assert obs.latency["CPU_ONLY"].runs == 11
    s = obs.speedup()
    assert s is not None
    assert s["median_ratio"] == pytest.approx(45 / 12.5)
    assert s["supported_ratio"] == pytest.approx(41 / 14.5)  # slow p10 / fast p90
    doc = obs.to_json()
    assert doc["evidence"] == "observed"
    assert doc["energy_mj_per_call"]["CPU_AND_NE"] == pytest.approx(500 * 12.5 / 1000)


def test_a_result_for_another_package_or_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    good = _recorded("ab" * 32, [1.0], [1.0])
    path.write_text(json.dumps(good))
    with pytest.raises(InputError, match="not this package"):
        read_bench(path, "cd" * 32)
    for broken in (
        {**good, "evidence": "predicted"},
        {**good, "format": "x"},
        {**good, "results": {}},
    ):
        path.write_text(json.dumps(broken))
        with pytest.raises(InputError):
            read_bench(path)
    good["results"]["CPU_ONLY"] = {"samples_ms": [], "latency": {"runs": "many"}}
    path.write_text(json.dumps(good))
    with pytest.raises(InputError, match="malformed latency"):
        read_bench(path)


@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS the kit would really run")
def test_bench_device_says_it_needs_macos(tmp_path: Path) -> None:
    import plan_programs as pp
    from click.testing import CliRunner

    from converter.commands import main

    package = pp.save(pp.mlp(4), tmp_path / "m.mlpackage")
    result = CliRunner().invoke(
        main, ["bench-device", str(package), "--out", str(tmp_path / "b.json")]
    )
    assert result.exit_code == 2
    assert "never run on this platform" in result.output
    assert not (tmp_path / "b.json").exists()
