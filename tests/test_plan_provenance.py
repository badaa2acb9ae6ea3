"""Compute-plan dumps and device measurements must say where they were recorded.

A file is ``compute-plan`` or ``observed`` evidence only with the macOS version, chip and
coremltools version of the Mac that recorded it; a test stand-in is refused unless the
test-only switch is set, and then every renderer (text, JSON, HTML) prints STAND-IN.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plan_programs as pp
import plan_standins as ps
import pytest
from click.testing import CliRunner, Result

from converter.commands import main
from converter.errors import InputError
from converter.pipeline.hashing import mlpackage_content_hash
from converter.placement.device_bench import BENCH_FORMAT, power_summary
from converter.placement.dump import RecordedPlan, write_dump
from converter.placement.provenance import STAND_IN_ENV, check_recorded

ON_A_MAC = {
    "origin": "macos",
    "macos": "14.5",
    "machine": "arm64",
    "chip": "Apple M4",
    "coremltools": "9.0",
    "date": "2026-11-30T12:00:00+00:00",
}
PROVENANCE = "recorded on macOS 14.5, Apple M4 (arm64), coremltools 9.0"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pp.save(pp.bc1l_block(), tmp_path_factory.mktemp("provenance") / "block.mlpackage")


def _evidence(package: Path, root: Path, recorded: dict[str, Any]) -> tuple[Path, Path]:
    """A compute-plan dump and a bench-device result for ``package`` with this record."""
    plan = ps.recorded(package, ps.ne_except())
    dump = write_dump(
        root / "plan.json", RecordedPlan(plan.content_sha256, plan.package, recorded, plan.plans)
    )
    bench = root / "bench.json"
    unit = {"samples_ms": [1.0, 1.2], "power": power_summary([])}
    bench.write_text(
        json.dumps(
            {
                "format": BENCH_FORMAT,
                "evidence": "observed",
                "package": package.name,
                "content_sha256": mlpackage_content_hash(package),
                "recorded": recorded,
                "results": {"CPU_ONLY": unit, "CPU_AND_NE": unit},
            }
        )
    )
    return dump, bench


def _inspect(package: Path, dump: Path, bench: Path, *args: str) -> Result:
    argv = ["plan-inspect", str(package), "--no-ops", "--from-plan", str(dump)]
    return CliRunner().invoke(main, [*argv, "--observed", str(bench), *args])


def _all_renderings(package: Path, dump: Path, bench: Path, html: Path) -> tuple[str, dict, str]:
    text = _inspect(package, dump, bench, "--html", str(html))
    assert text.exit_code == 0, text.output
    as_json = _inspect(package, dump, bench, "--json")
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)["packages"][0]
    return " ".join(text.output.split()), doc, html.read_text()


def test_recorded_evidence_prints_its_provenance_everywhere(package: Path, tmp_path: Path) -> None:
    dump, bench = _evidence(package, tmp_path, ON_A_MAC)
    text, doc, html = _all_renderings(package, dump, bench, tmp_path / "r.html")
    assert text.count(PROVENANCE) == 2  # the compute plan and the measurement
    for section in (doc["compute_plan"]["source"], doc["observed"]):
        assert section["provenance"].startswith(PROVENANCE) and section["stand_in"] is False
    assert html.count(PROVENANCE) == 2
    assert "STAND-IN" not in text + json.dumps(doc) + html


def test_a_stand_in_is_refused_without_the_test_only_switch(
    package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STAND_IN_ENV, raising=False)
    dump, bench = _evidence(package, tmp_path, {"origin": "stand-in"})
    result = _inspect(package, dump, bench)
    assert result.exit_code == 2, result.output
    assert "recorded.origin is 'stand-in'" in result.output and STAND_IN_ENV in result.output


@pytest.mark.usefixtures("stand_in_evidence")
def test_a_stand_in_accepted_for_tests_prints_stand_in_in_every_renderer(
    package: Path, tmp_path: Path
) -> None:
    dump, bench = _evidence(package, tmp_path, {"origin": "stand-in"})
    text, doc, html = _all_renderings(package, dump, bench, tmp_path / "r.html")
    assert text.count("STAND-IN") == 2
    for section in (doc["compute_plan"]["source"], doc["observed"]):
        assert section["provenance"].startswith("STAND-IN") and section["stand_in"] is True
    assert html.count("STAND-IN") == 2
    assert "recorded on macOS" not in text + html


@pytest.mark.parametrize("field", ["macos", "chip", "coremltools"])
def test_evidence_without_macos_chip_or_coremltools_version_is_refused(field: str) -> None:
    recorded = {k: v for k, v in ON_A_MAC.items() if k != field}
    with pytest.raises(InputError, match=rf"plan.json: recorded\.{field} is missing"):
        check_recorded(recorded, "plan.json")


@pytest.mark.parametrize("recorded", [None, {}, {"origin": "linux"}, "macos"])
def test_evidence_without_a_macos_origin_is_refused(recorded: Any) -> None:
    with pytest.raises(InputError, match="bench.json: "):
        check_recorded(recorded, "bench.json")


def test_the_old_fixture_record_is_refused_even_with_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the fixtures used to write: no origin, 'stand-in' as a chip name."""
    monkeypatch.setenv(STAND_IN_ENV, "1")
    with pytest.raises(InputError, match="recorded.origin is None"):
        check_recorded({"macos": "stand-in", "machine": "test", "chip": "stand-in"}, "plan.json")
