"""The opt-in device-margin level (issue 23, item 3): worst over seeds per position, its gate
from the recipe key, nothing without the key; real conversions of the tiny Llama."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError
from tiny_models import one_torch_thread, run_anec, save_tiny_llama, tiny_recipe, write_tiny_recipe

from parity.device_margin import DeviceMargin, margin_gate, margin_rows, worst_over_seeds
from parity.metrics import PositionRow
from parity.mil.deviations import DEVIATIONS
from parity.mil.profiles import DEVICE_MARGIN, PROFILES

KEY = "device_margin_argmax_agreement"
LEVEL = "mil-device-margin"


def _row(position: int, kept: bool, dprob: float, fixture: str = "f") -> PositionRow:
    return PositionRow(fixture, "unpadded", 4, position, 0.5, 0.1, kept, dprob, 0.0, 1.0)


def test_the_worst_seed_is_a_flip_first_then_the_larger_dprob() -> None:
    per_seed = {
        0: [_row(0, True, 0.01), _row(1, True, 0.02), _row(2, True, math.nan)],
        1: [_row(0, False, 0.001), _row(1, True, 0.05), _row(2, True, 0.3)],
        2: [_row(0, True, 0.2), _row(1, True, 0.03), _row(2, True, 0.1)],
    }
    worst = worst_over_seeds(per_seed)
    assert worst[("f", 0)][0] == 1  # the flip, though its |dp| is the smallest
    assert worst[("f", 1)][0] == 1  # the largest |dp| of kept argmaxes
    assert worst[("f", 2)][0] == 0  # NaN counts as worst
    fp16, acc = [_row(0, True, 0.0005), _row(1, True, 0.01)], [_row(1, True, 0.045)]
    rows = margin_rows(per_seed, fp16, acc)
    assert [r.worst_seed for r in rows] == [1, 1, 0]
    assert rows[1].dprob_growth == pytest.approx(0.04)
    assert rows[1].deviation_growth == pytest.approx(0.005)  # the deviations' own share
    assert math.isnan(rows[2].dprob_growth)  # no fp16 row there: no growth claimed
    assert math.isnan(rows[0].deviation_growth)
    found = DeviceMargin((0, 1, 2), DEVIATIONS, rows)
    assert [r.position for r in found.flipped] == [0] and found.agreement == pytest.approx(2 / 3)
    assert found.max_growth is rows[1]
    result = margin_gate(found, 1.0)
    assert not result.passed and result.where == "f@0" and result.level == LEVEL
    assert margin_gate(found, 0.5).passed


def test_the_key_is_a_decoders_and_refused_elsewhere(tmp_path: Path) -> None:
    import yaml

    from converter.recipe import validate_recipe

    base = yaml.safe_load(tiny_recipe(tmp_path, gates={KEY: 0.9}))
    assert validate_recipe(base).gates.device_margin_argmax_agreement == 0.9
    with pytest.raises(ValidationError, match="without a cache"):
        validate_recipe({**base, "target": "macOS15", "cache": {"style": "state"}})
    with pytest.raises(ValidationError, match="does not apply to task sentence-similarity"):
        validate_recipe({**base, "task": "sentence-similarity", "io": {}})
    for bad in (0, 1.5, "1.0"):
        with pytest.raises(ValidationError, match=KEY):
            validate_recipe({**base, "gates": {KEY: bad}})


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("device_margin")
    save_tiny_llama(root / "ckpt")
    return root


def _convert(root: Path, name: str, gates: dict[str, float]) -> tuple[int, Path, dict]:
    recipe = write_tiny_recipe(root / f"{name}.yaml", root / "ckpt", name, gates=gates)
    result = run_anec("convert", recipe, "--out", root / name, "--json")
    folder = root / name / (name if result.exit_code == 0 else f"{name}.failed")
    return result.exit_code, folder, json.loads((folder / "parity.json").read_text())


def _margin_gates(doc: dict) -> list[dict]:
    return [g for g in doc["gates"] if g["name"] == KEY]


@pytest.fixture(scope="module")
def opted(root: Path) -> tuple[int, Path, dict]:
    return _convert(root, "opted", {KEY: 1.0})


def test_with_the_key_the_profile_runs_and_its_gate_is_recorded(
    opted: tuple[int, Path, dict],
) -> None:
    code, folder, doc = opted
    (gate,) = _margin_gates(doc)
    assert gate["implementation"] == LEVEL and gate["threshold"] == 1.0
    assert code == (0 if gate["passed"] else 1)
    runs = {r["implementation"]: r for r in doc["conversion"]["runs"]}
    found = runs[LEVEL]["device_margin"]
    assert found["seeds"] == [0, 1, 2]
    # The tiny Llama's SwiGLU is one silu per layer (coremltools fuses x * sigmoid(x)).
    assert found["op_counts"] == {"silu": 3} and found["perturbed_ops"] == 3
    assert all(d["evidence"].startswith("reported by") for d in found["deviations"])
    positions = found["positions"]
    assert len(positions) == len(runs["mil-fp16"]["positions"])
    acc = {(p["fixture"], p["position"]): p["abs_dprob"] for p in runs["mil-fp16-acc"]["positions"]}
    for p in positions:
        assert p["dprob_growth"] == pytest.approx(p["abs_dprob"] - p["fp16_abs_dprob"])
        assert p["fp16_acc_abs_dprob"] == acc[(p["fixture"], p["position"])]
    text = (folder / "parity.txt").read_text()
    assert "device margin:" in text and "deviation silu |x|<0.5: +-0.0011" in text
    assert "Device margin (reported NE deviations)" in (folder / "parity.html").read_text()


def test_deviations_it_cannot_absorb_fail_the_gate(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every silu output moved by +-50: the argmax cannot survive, a 1.0 gate cannot pass.
    huge = tuple(replace(d, bound=50.0, low=0.0, high=math.inf) for d in DEVIATIONS[:1])
    monkeypatch.setitem(PROFILES, DEVICE_MARGIN.name, replace(DEVICE_MARGIN, deviations=huge))
    code, folder, doc = _convert(root, "huge", {KEY: 1.0})
    (gate,) = _margin_gates(doc)
    assert code == 1 and not gate["passed"] and gate["value"] < 1.0
    assert folder.name == "huge.failed"
    assert all(g["passed"] for g in doc["gates"] if g["name"] != KEY)  # only this gate failed


@pytest.fixture(scope="module")
def plain(root: Path) -> tuple[int, Path, dict]:
    return _convert(root, "plain", {})


def test_without_the_key_nothing_runs_and_no_gate_is_recorded(
    plain: tuple[int, Path, dict],
) -> None:
    code, _, doc = plain
    assert code == 0 and not _margin_gates(doc)
    assert LEVEL not in {r["implementation"] for r in doc["conversion"]["runs"]}
    assert LEVEL not in {lv["implementation"] for lv in doc["levels"]}


def test_anec_parity_reruns_the_gate_and_refuses_the_profile_without_the_key(
    root: Path, opted: tuple[int, Path, dict], plain: tuple[int, Path, dict]
) -> None:
    code, folder, published = opted
    assert code == 0  # the tiny Llama keeps its argmax under the reported deviations
    result = run_anec("parity", folder, "--out", root / "again")
    assert result.exit_code == 0, result.output
    again = json.loads((root / "again" / "parity.json").read_text())
    (gate,) = _margin_gates(again)
    assert gate["value"] == _margin_gates(published)[0]["value"]  # same seeds, same bits
    same_set = next(g for g in again["gates"] if g["name"] == "same_gate_set")
    assert same_set["passed"], same_set["detail"]
    refused = run_anec("parity", plain[1], "--profile", "device-margin")
    assert refused.exit_code == 2 and KEY in refused.output
