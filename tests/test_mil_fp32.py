"""The one MIL fp32 check (`parity.mil_fp32`): the worst relative error per layer, of the
outputs and overall, with where it was seen, and the gates every model kind records through
the one MIL level (`parity.mil_level`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from converter.evidence.recheck import published_gates
from graph_passes.markers import MarkerError
from parity.gate_registry import GateResult, gate
from parity.mil import UnsupportedOpError
from parity.mil_fp32 import MARKERS, Fp32Check, Pair
from parity.mil_level import Fp32Run, MilSubject, run_mil_level

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


def test_the_mil_level_records_the_same_gates_for_every_kind() -> None:
    """`run_mil_level`: a program the evaluator cannot prepare (an encoder's lost marker too)
    fails ``layer_markers_present``, as a decoder's lost marker does, claims no error figure
    for layers never compared and runs nothing more; one that runs records the markers gate,
    the fp32 gate, its own gates and then the fp16 gates, in that order."""
    ran: list[str] = []

    def more(progress: Any) -> list[GateResult]:
        ran.append("more")
        return []

    def fp16() -> list[GateResult]:
        ran.append("fp16")
        return [gate("mil-fp16", "finite_outputs").check(1.0)]

    def lost(progress: Any) -> Fp32Run:
        raise MarkerError("layer_1_out is not in the program")

    def unsupported(progress: Any) -> Fp32Run:
        raise UnsupportedOpError("cumsum", "my_cumsum")

    for cannot in (lost, unsupported):
        level = run_mil_level(MilSubject(cannot, fp16, 1e-5, more))
        assert [(g.gate.level, g.name, g.passed) for g in level.gates] == [
            ("mil-fp32", MARKERS, False)
        ]
        assert level.error and level.error in level.gates[0].detail and level.fp32 is None
    assert ran == []
    exact = Fp32Check.of(1, [Pair(WANT, WANT, "l0", 0)])
    level = run_mil_level(
        MilSubject(lambda progress: Fp32Run(exact, found="all"), fp16, 1e-5, more)
    )
    assert [(g.name, g.passed) for g in level.gates] == [
        (MARKERS, True), ("mil_fp32_layer_rel_error", True), ("finite_outputs", True)
    ]  # fmt: skip
    assert ran == ["more", "fp16"] and level.layer_rel_error == [0.0]
    # a decoder's lost marker: the level goes on (its logits are still compared), the markers
    # gate fails and every layer's error is inf
    lost_layers = Fp32Check.of(1, [], layers_lost=True)
    lost = Fp32Run(lost_layers, problem="layer_0_out lost")
    level = run_mil_level(MilSubject(lambda progress: lost, fp16, 1e-5))
    assert [g.passed for g in level.gates] == [False, False, True]
    assert level.gates[0].detail == "layer_0_out lost"


def test_a_gate_published_under_its_old_name_is_read_under_its_new_one(tmp_path: Path) -> None:
    """`anec parity` on an encoder published before the markers gate took one name for every
    kind expects the same gate set, not a missing and an extra gate."""
    names = ("evaluator_runs_program", "mil_fp32_layer_rel_error")
    doc = {"gates": [{"name": name, "implementation": "mil-fp32"} for name in names]}
    (tmp_path / "parity.json").write_text(json.dumps(doc))
    assert published_gates(tmp_path) == {
        ("layer_markers_present", "mil-fp32"), ("mil_fp32_layer_rel_error", "mil-fp32")
    }  # fmt: skip
