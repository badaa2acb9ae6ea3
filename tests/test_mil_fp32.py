"""The one MIL fp32 check (`parity.mil_fp32`): the worst relative error per layer, of the
outputs and overall, with where it was seen, and the one gate every model kind records."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.mil_fp32 import Fp32Check, Pair

WANT = np.array([3.0, 4.0])  # ||want|| = 5


def test_the_worst_is_kept_per_layer_for_the_outputs_and_overall() -> None:
    pairs = [
        Pair(WANT + [0.05, 0.0], WANT, "a, layer 0", 0),  # 0.01
        Pair(WANT + [0.5, 0.0], WANT, "b, layer 1", 1),  # 0.1
        Pair(WANT + [0.1, 0.0], WANT, "c, layer 0", 0),  # 0.02
        Pair(WANT + [0.25, 0.0], WANT, "a, logits"),  # 0.05
    ]
    check = Fp32Check.of(2, pairs)
    assert check.layer_rel_error == pytest.approx([0.02, 0.1])
    assert check.layers[0].where == "c, layer 0"
    assert check.output.value == pytest.approx(0.05) and check.output.where == "a, logits"
    gate = check.gate(0.05, "detail")
    assert not gate.passed and gate.value == pytest.approx(0.1) and gate.where == "b, layer 1"
    assert gate.gate.name == "mil_fp32_layer_rel_error" and gate.gate.level == "mil-fp32"


def test_a_non_finite_value_is_infinitely_wrong_and_nan_is_never_hidden() -> None:
    check = Fp32Check.of(1, [Pair(np.array([np.inf, 0.0]), WANT, "layer 0", 0)])
    assert check.layer_rel_error == [math.inf] and not check.gate(1.0, "").passed
    nan_want = Fp32Check.of(1, [Pair(WANT, np.array([np.nan, 1.0]), "nan", 0),
                                Pair(WANT * 2, WANT, "big", 0)])  # fmt: skip
    assert math.isnan(nan_want.overall.value) and nan_want.overall.where == "nan"


def test_lost_layers_make_every_layer_and_the_gate_infinite() -> None:
    check = Fp32Check.of(3, [Pair(WANT, WANT, "logits")], layers_lost=True)
    assert check.layer_rel_error == [math.inf] * 3
    assert check.output.value == 0.0  # the outputs are still compared
    assert check.gate(1e-5, "").value == math.inf


def test_an_exact_program_passes_at_zero() -> None:
    check = Fp32Check.of(1, [Pair(WANT.astype(np.float32), WANT, "layer 0", 0)])
    assert check.gate(1e-5, "").value == 0.0 and check.gate(1e-5, "").passed
