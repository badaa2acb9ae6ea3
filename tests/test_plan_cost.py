"""The cost model: the floor formula, per-chip placement, ranges, and its label."""

from __future__ import annotations

import plan_programs as pp
import pytest

from converter.plan.chips import CHIPS, chip
from converter.plan.cost import cost_section, floor
from converter.plan.ops import op_table
from converter.plan.static import static_report


def test_the_floor_is_the_larger_of_compute_and_weight_streaming_plus_the_rest() -> None:
    m4 = chip("M4")
    report = static_report(op_table(pp.bc1l_block()), "p", "h", "M4", other_chips=())
    f = floor(report.functions[0], m4)
    s = report.functions[0].summary
    compute = s.flops_ne / (m4.fp16_tflops.value * 1e12) * 1e3
    weights = s.weight_bytes_ne / (m4.weight_stream_gbps.value * 1e9) * 1e3
    copies = (s.boundary_bytes + s.input_bytes) / (m4.weight_stream_gbps.value * 1e9) * 1e3
    outputs = s.output_bytes / (m4.weight_stream_gbps.value * 1e9) * 1e3
    expected = max(compute, weights) + copies + outputs + m4.dispatch_ms.value
    assert f.ms == pytest.approx(expected)
    assert f.components_ms["cpu"] == 0.0
    assert f.bound == "dispatch"  # a tiny program: one launch outweighs its work
    assert f.low_ms <= f.ms <= f.high_ms


def test_each_chip_is_priced_with_its_own_placement() -> None:
    table = op_table(pp.wide_head())
    placements = [
        (c, static_report(table, "p", "h", c.name, other_chips=())) for c in CHIPS.values()
    ]
    section = cost_section(placements)
    by_chip = {f["chip"]: f for f in section["floors"]}
    # The 49152-wide head is on the CPU on M1 (R-LMHEAD) and on the NE on M4.
    assert by_chip["M1"]["components_ms"]["cpu"] > 0
    assert by_chip["M4"]["components_ms"]["cpu"] == 0
    assert by_chip["M1"]["bound"] == "cpu" and by_chip["M4"]["bound"] != "cpu"
    assert set(by_chip) == set(CHIPS)


def test_every_floor_is_labelled_predicted_and_called_a_model() -> None:
    report = static_report(op_table(pp.bc1l_block()), "p", "h", "M1", other_chips=())
    section = cost_section([(chip("M1"), report)])
    assert section["evidence"] == "predicted" and "not a measurement" in section["note"]
    assert section["placement_from"] == ["static"]
    for f in section["floors"]:
        assert f["evidence"] == "predicted" and "a model" in f["note"]
    for c in section["chips"].values():
        for key in ("fp16_tflops", "int8_tops", "weight_stream_gbps", "dispatch_ms"):
            figure = c[key]
            assert figure["source"] and figure["low"] <= figure["value"] <= figure["high"]


def test_int8_activations_use_the_int8_figure_only_where_it_is_faster() -> None:
    report = static_report(op_table(pp.bc1l_block()), "p", "h", "M4", other_chips=())
    fp16 = floor(report.functions[0], chip("M4"))
    w8a8 = floor(report.functions[0], chip("M4"), w8a8=True)
    assert w8a8.components_ms["ne_compute"] < fp16.components_ms["ne_compute"]
    m1 = floor(report.functions[0], chip("M1"), w8a8=True)
    assert (
        m1.components_ms["ne_compute"]
        == floor(report.functions[0], chip("M1")).components_ms["ne_compute"]
    )
