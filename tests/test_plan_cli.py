"""``anec plan-inspect``: tables, JSON, HTML, recorded plans, measurements, gates, exit codes,
and the evidence label of every section."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import plan_programs as pp
import plan_standins as ps
import pytest
from click.testing import CliRunner, Result

from converter.commands import main
from converter.evidence.labels import Evidence
from converter.placement.dump import write_dump
from converter.placement.inspect import load_table


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-cli")
    artifact = root / "block"
    artifact.mkdir()
    return {
        "block": pp.save(pp.bc1l_block(), artifact / "block.mlpackage"),
        "topk": pp.save(pp.topk_head(), root / "topk.mlpackage"),
    }


# The dumps and measurements here are stand-ins (no Mac records them): the test-only switch.
pytestmark = pytest.mark.usefixtures("stand_in_evidence")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan-inspect", *args])


def _softmax_on_cpu_dump(package: Path, path: Path) -> Path:
    softmax = next(op for op in load_table(package).ops() if op.op_type == "softmax")
    write_dump(path, ps.recorded(package, ps.ne_except(softmax.outputs[0].name)))
    return path


def _bench_file(package: Path, path: Path) -> Path:
    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.placement.device_bench import BENCH_FORMAT, power_summary

    def unit(samples: list[float]) -> dict[str, Any]:
        return {"samples_ms": samples, "power": power_summary([300.0])}

    path.write_text(
        json.dumps(
            {
                "format": BENCH_FORMAT,
                "evidence": "observed",
                "package": package.name,
                "content_sha256": mlpackage_content_hash(package),
                "recorded": {"origin": "stand-in"},
                "results": {"CPU_ONLY": unit([4.0, 5.0, 6.0]), "CPU_AND_NE": unit([1.0, 1.5])},
            }
        )
    )
    return path


def test_the_table_lists_every_op_with_device_and_rule(packages: dict[str, Path]) -> None:
    result = run(str(packages["block"].parent))  # an artifact directory
    assert result.exit_code == 0, result.output
    out = result.output
    assert "evidence: static (uncalibrated)" in out
    for op in load_table(packages["block"]).ops():
        assert op.name in out
    for rule in ("O-CONV", "O-MM", "O-SOFTMAX", "O-SHAPE"):
        assert rule in out
    assert "no op breaks NE residency" in out
    assert "evidence: predicted" in out and "not a measurement" in out


def test_breakers_are_named_with_reason_and_fix(packages: dict[str, Path]) -> None:
    result = run(str(packages["topk"]), "--no-ops")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # long lines wrap
    assert "breaks NE residency: #9 topk" in out
    assert "take top-k or the argmax on the host" in out


def _evidence_labels(node: Any, path: str = "") -> list[tuple[str, str]]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "evidence":
                found.append((path, value))
            else:
                found += _evidence_labels(value, f"{path}/{key}")
    elif isinstance(node, list):
        for item in node:
            found += _evidence_labels(item, path)
    return found


def test_every_section_carries_its_own_evidence_label(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    package = packages["block"]
    dump = _softmax_on_cpu_dump(package, tmp_path / "plan.json")
    bench = _bench_file(package, tmp_path / "bench.json")
    result = run(str(package), "--json", "--from-plan", str(dump), "--observed", str(bench))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["packages"][0]
    expected = {
        "static": "static",
        "compute_plan": "compute-plan",
        "predicted": "predicted",
        "observed": "observed",
    }
    labels = _evidence_labels(doc)
    assert {p.split("/")[1] for p, _ in labels} == set(expected)
    for path, value in labels:
        assert value == expected[path.split("/")[1]], f"{path} says {value}"
    assert {v for _, v in labels} <= {e.value for e in Evidence}
    assert doc["static"]["calibration"] == "uncalibrated"
    assert doc["compute_plan"]["calibration"] is None
    assert doc["agreement"]["static_evidence"] == "static"
    assert doc["agreement"]["plan_evidence"] == "compute-plan"
    assert all("a model" in f["note"] for f in doc["predicted"]["floors"])


def test_the_text_report_labels_each_section(packages: dict[str, Path], tmp_path: Path) -> None:
    package = packages["block"]
    dump = _softmax_on_cpu_dump(package, tmp_path / "plan.json")
    bench = _bench_file(package, tmp_path / "bench.json")
    result = run(str(package), "--no-ops", "--from-plan", str(dump), "--observed", str(bench))
    assert result.exit_code == 0, result.output
    out = result.output
    static_at = out.index("evidence: static (uncalibrated)")
    plan_at = out.index("evidence: compute-plan")
    predicted_at = out.index("evidence: predicted")
    observed_at = out.index("evidence: observed")
    assert static_at < plan_at < predicted_at < observed_at
    # The predicted section never calls its figures measured.
    predicted = out[predicted_at:observed_at]
    assert "not a measurement" in predicted and "measured" not in predicted
    assert "agreement of static (chip M1) with compute-plan" in out


def test_html_is_self_contained_and_labelled(packages: dict[str, Path], tmp_path: Path) -> None:
    html_file = tmp_path / "r.html"
    result = run(str(packages["topk"]), "--no-ops", "--html", str(html_file))
    assert result.exit_code == 0, result.output
    html = html_file.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") >= 2
    assert "<script" not in html and "src=" not in html and "<link" not in html
    assert "static · uncalibrated" in html and 'class="badge predicted"' in html
    assert "FLOP share by device" in html and "NE segment(s)" in html
    assert "topk" in html and "take top-k or the argmax on the host" in html


def test_compare_shows_two_packages_side_by_side(packages: dict[str, Path]) -> None:
    result = run("--compare", str(packages["block"]), str(packages["topk"]), "--json")
    assert result.exit_code == 0, result.output
    metrics = {m["name"]: m for m in json.loads(result.output)["comparison"]["metrics"]}
    # topk, the ops on its indices and the int16 casts coremltools inserts around them.
    assert metrics["off_ne_ops"]["a"] == 0 and metrics["off_ne_ops"]["b"] >= 4
    assert "topk (R-INT)" in metrics["off_ne"]["b"]
    assert metrics["off_ne_ops"]["evidence"].startswith("static (uncalibrated")
    assert metrics["floor_ms M4"]["evidence"] == "predicted"
    assert metrics["live_ops"]["evidence"] == "program"
    text = run("--compare", str(packages["block"]), str(packages["topk"]))
    assert text.exit_code == 0 and "side by side" in text.output


def test_gates_pass_and_fail_with_exit_codes(packages: dict[str, Path], tmp_path: Path) -> None:
    gates = ["--gate-ne-flop-share", "0.999", "--gate-max-ne-segments", "1", "--no-ops"]
    ok = run(str(packages["block"]), *gates)
    assert ok.exit_code == 0, ok.output
    assert "plan_min_ne_flop_share (static, uncalibrated at M1): 1 >= 0.999: pass" in ok.output
    bad = run(str(packages["topk"]), *gates)
    assert bad.exit_code == 1
    assert "error: plan_max_ne_segments (static, uncalibrated at M1): 2 <= 1: FAIL" in (bad.output)
    # With a recorded plan the gate is checked on the plan, and says so.
    dump = _softmax_on_cpu_dump(packages["block"], tmp_path / "plan.json")
    on_plan = run(str(packages["block"]), *gates, "--from-plan", str(dump))
    assert on_plan.exit_code == 1
    assert "plan_max_ne_segments (compute-plan): 2 <= 1: FAIL" in on_plan.output


def test_bad_input_exits_2(packages: dict[str, Path], tmp_path: Path) -> None:
    assert run(str(tmp_path / "missing")).exit_code == 2
    assert run(str(tmp_path)).exit_code == 2  # a directory without a package
    assert run(str(packages["block"]), "--chip", "M9").exit_code == 2
    assert run().exit_code == 2
    both = run(str(packages["block"]), "--compare", str(packages["block"]), str(packages["topk"]))
    assert both.exit_code == 2
    other = tmp_path / "other.json"
    write_dump(other, ps.recorded(packages["topk"], ps.ne_except()))
    wrong = run(str(packages["block"]), "--from-plan", str(other))
    assert wrong.exit_code == 2 and "no plan for this package" in wrong.output


@pytest.mark.skipif(platform.system() == "Darwin", reason="--dump runs for real on macOS")
def test_dump_needs_macos(packages: dict[str, Path], tmp_path: Path) -> None:
    result = run(str(packages["block"]), "--dump", str(tmp_path / "d.json"))
    assert result.exit_code == 2 and "macOS" in result.output
    assert not (tmp_path / "d.json").exists()


def test_plan_inspect_output_starts_with_the_report(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """coremltools' import notes (unsupported scikit-learn, untested torch, eight missing
    macOS proxies) go to the log (here --log), not before the report on the terminal."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    log = tmp_path / "anec.log"
    env = dict(os.environ, PYTHONPATH=str(repo))
    package = packages["block"]
    command = [sys.executable, "-m", "converter.commands", "--log", str(log)]
    done = subprocess.run(
        [*command, "plan-inspect", str(package), "--no-ops"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # what a terminal shows, in order
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines[0] == str(package), done.stdout[:2000]
    assert "coremltools" not in done.stdout and "Failed to load" not in done.stdout
    assert "WARNING coremltools: Failed to load _MLModelProxy" in log.read_text()
