"""The device-margin profile: reported per-op deviations, added with seeded signs to the listed
op types only, only where their input is in the row's range; deterministic per seed."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from mil_ops import program

from parity.mil import Evaluator
from parity.mil.deviations import DEVIATIONS, SEEDS, Deviation
from parity.mil.numerics import round_fp16
from parity.mil.profiles import DEVICE_MARGIN, FP16_ACC

# Inputs in every bin of the table: |x| < 0.5, 0.5..2 (no figure), >= 2, and both signs.
X = np.array([0.0, 0.1, -0.3, 0.49, 0.5, -1.0, 1.99, 2.0, -3.0, 6.0] * 40, np.float32)


def _silu_then_sigmoid(x: Any) -> Any:
    from coremltools.converters.mil import Builder as mb

    # Two outputs: silu (a row in the table) and sigmoid (none: never perturbed).
    return mb.silu(x=x, name="act"), mb.sigmoid(x=x, name="gate")


def _run(profile: Any, seed: int = 0, x: np.ndarray = X) -> tuple[list[np.ndarray], Evaluator]:
    evaluator = Evaluator(program(_silu_then_sigmoid, x), profile, seed=seed)
    outputs = list(evaluator.run({"x": x}).outputs.values())
    return outputs, evaluator


def test_the_table_is_sourced_and_labelled_reported() -> None:
    assert {row.op_type for row in DEVIATIONS} == {"silu"}  # the only op with a figure
    for row in DEVIATIONS:
        assert row.evidence.startswith("reported by ") and "measured" not in row.evidence
        assert "anemll-forge" in row.source and row.reading
        assert row.bound > 0 and row.low < row.high
    assert len(SEEDS) >= 3 and len(set(SEEDS)) == len(SEEDS)


def test_silu_moves_by_the_bound_in_range_only_and_sigmoid_never() -> None:
    (act, gate), evaluator = _run(DEVICE_MARGIN)
    (act0, gate0), _ = _run(FP16_ACC)
    np.testing.assert_array_equal(gate, gate0)  # no row for sigmoid
    delta = (act - act0).astype(np.float64)
    magnitude = np.abs(X)
    near, far = magnitude < 0.5, magnitude >= 2.0
    middle = ~near & ~far
    assert (delta[middle] == 0).all()  # no sourced figure between 0.5 and 2
    # +-bound, up to the fp16 rounding of the result (half an ulp of either value).
    ulp = np.spacing(np.maximum(np.abs(act), np.abs(act0)).astype(np.float16)).astype(np.float64)
    for rows, bound in ((near, 1.1e-3), (far, 3.0e-4)):
        assert (np.abs(np.abs(delta[rows]) - bound) <= ulp[rows]).all()
    assert (delta[near] > 0).any() and (delta[near] < 0).any()  # both signs drawn
    assert evaluator.perturbation is not None
    assert evaluator.perturbation.ops == {"act"}
    assert evaluator.perturbation.elements == int((near | far).sum())


def test_same_seed_same_bits_other_seed_other_signs() -> None:
    (first, _), _ = _run(DEVICE_MARGIN, seed=SEEDS[1])
    (again, _), _ = _run(DEVICE_MARGIN, seed=SEEDS[1])
    (other, _), _ = _run(DEVICE_MARGIN, seed=SEEDS[2])
    assert first.tobytes() == again.tobytes()
    assert first.tobytes() != other.tobytes()


def test_reseed_between_runs_gives_each_seeds_own_bits() -> None:
    evaluator = Evaluator(program(_silu_then_sigmoid, X), DEVICE_MARGIN, seed=0)
    by_seed = {}
    for seed in (2, 0, 2):
        evaluator.reseed(seed)
        by_seed.setdefault(seed, []).append(evaluator.run({"x": X}).outputs["act"].tobytes())
    assert by_seed[2][0] == by_seed[2][1]
    (fresh, _), _ = _run(DEVICE_MARGIN, seed=0)
    assert by_seed[0][0] == fresh.tobytes()


def test_one_row_alone_perturbs_its_range_only() -> None:
    far_only = replace(DEVICE_MARGIN, deviations=(DEVIATIONS[1],))
    (act, _), _ = _run(far_only)
    (act0, _), _ = _run(FP16_ACC)
    changed = act != act0
    assert not changed[np.abs(X) < 2.0].any() and changed[np.abs(X) >= 2.0].any()


def test_a_row_reads_its_range_on_the_input_not_the_output() -> None:
    # silu(-3) = -0.142: its output is near zero, its input is not.
    row = Deviation("silu", 0.25, 0.0, 0.5, "test", "reported by test", "test")
    profile = replace(DEVICE_MARGIN, deviations=(row,))
    x = np.full(8, -3.0, np.float32)
    (act, _), _ = _run(profile, x=x)
    expected = round_fp16(np.float32(-3.0) / (1 + np.exp(np.float32(3.0))))
    np.testing.assert_allclose(act, expected, atol=1e-3)
    assert math.isinf(DEVIATIONS[1].high) and DEVIATIONS[1].name == "silu |x|>=2"
