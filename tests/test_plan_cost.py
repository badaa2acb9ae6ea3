"""The cost model: the floor formula, per-chip placement, ranges, and its label."""

from __future__ import annotations

import plan_programs as pp
import pytest

from converter.placement.chips import CHIPS, VARIANTS, Chip, chip
from converter.placement.cost import cost_section, floor, work_of
from converter.placement.decode import DecodedWeight, granularity_cost
from converter.placement.ops import op_table
from converter.placement.report import FunctionReport, Row, Summary
from converter.placement.static import static_report


def chip_or_variant(name: str) -> Chip:
    """A placement chip or a cost-only variant (M4 Max, M5 Max) by name."""
    return VARIANTS[name] if name in VARIANTS else chip(name)


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


# ------------------------------------------------------------- the three NE bounds, pinned
# One NE op on synthetic plans: the floor is max(compute, bytes, decode) + one dispatch, each
# term computed here from the inputs and the chip's central figures.

W = 50_000_000  # weights of the synthetic layer: large enough that no dispatch dominates


def _function(
    flops: int, weight_bytes: int, decoded: tuple[DecodedWeight, ...] = ()
) -> FunctionReport:
    """A function of one NE op reading ``weight_bytes`` (and the compressed ``decoded``)."""
    row = Row(
        function="main",
        index=0,
        op_type="conv",
        name="conv",
        shape=[1],
        dtype="fp16",
        flops=flops,
        weight_bytes=weight_bytes,
        device="NE",
        rule="O-CONV",
        confidence="high",
        reason="",
        fix="",
        layer=None,
        decoded=list(decoded),
    )
    summary = Summary(
        ops=1, ops_ne=1, flops=flops, flops_ne=flops, weight_bytes=weight_bytes,
        weight_bytes_ne=weight_bytes, transitions=0, ne_segments=1, segments=[],
        boundary_bytes=0, input_bytes=0, output_bytes=0, unknown_flops_ops=0, layers=0,
        layers_all_ne=0, breakers=[],
    )  # fmt: skip
    return FunctionReport("main", [row], summary)


def _lut(bits: int, group: int | None = None) -> DecodedWeight:
    """W weights palettized to ``bits`` with ``group`` channels per palette (None: per tensor)."""
    names = {None: "per-tensor", 1: "per-channel"}
    return DecodedWeight(
        "S-LUT", W, W * bits // 8, bits, group, names.get(group, f"group {group}"),
        granularity_cost(group),
    )  # fmt: skip


def _ms(amount: float, per_second: float) -> float:
    return amount / per_second * 1e3


def test_a_compute_bound_function_is_priced_at_peak() -> None:
    m4max = chip_or_variant("M4 Max")
    flops = 20_000_000_000  # 20 GFLOP on 2 MB of fp16 weights
    f = floor(_function(flops, 2_000_000), m4max)
    assert f.bound == "compute"
    expected = _ms(flops, m4max.fp16_tflops.value * 1e12) + m4max.dispatch_ms.value
    assert f.ms == pytest.approx(expected)


def test_an_fp16_function_is_bytes_bound_even_where_a_decode_rate_is_known() -> None:
    m4max = chip_or_variant("M4 Max")
    f = floor(_function(2 * W, 2 * W), m4max)  # dense fp16: nothing to decode
    assert f.bound == "weights" and f.components_ms["ne_decode"] == 0.0
    expected = _ms(2 * W, m4max.weight_stream_gbps.value * 1e9) + m4max.dispatch_ms.value
    assert f.ms == pytest.approx(expected)


def test_a_lut4_function_is_decode_bound_where_the_rate_was_measured() -> None:
    m4max, m5max = chip_or_variant("M4 Max"), chip_or_variant("M5 Max")
    for c in (m4max, m5max):
        f = floor(_function(2 * W, W // 2, (_lut(4),)), c)
        decode = _ms(W, c.decode_gweights.value * 1e9)  # type: ignore[union-attr]
        assert f.bound == "weight-decode", c.name
        assert f.ms == pytest.approx(decode + c.dispatch_ms.value), c.name
        assert f.components_ms["ne_weights"] < decode
        assert f.to_json()["bound"] == "weight-decode"


def test_no_decode_bound_on_a_chip_without_a_measured_rate() -> None:
    m4 = chip("M4")
    assert m4.decode_gweights is None
    f = floor(_function(2 * W, W // 2, (_lut(4),)), m4)
    assert f.bound == "weights" and f.components_ms["ne_decode"] == 0.0
    expected = _ms(W // 2, m4.weight_stream_gbps.value * 1e9) + m4.dispatch_ms.value
    assert f.ms == pytest.approx(expected)
    assert f.low_ms <= f.ms <= f.high_ms


def test_on_m5_max_every_lut_and_int8_cost_the_same() -> None:
    """The forge measurement the cap encodes: LUT4 .. LUT2 and int8 run at one rate."""
    m5max = chip_or_variant("M5 Max")
    int8 = DecodedWeight("S-INT8", W, W)
    floors = {
        "int8": floor(_function(2 * W, W, (int8,)), m5max).ms,
        **{f"lut{b}": floor(_function(2 * W, W * b // 8, (_lut(b),)), m5max).ms for b in (2, 4)},
    }
    assert floors["lut2"] == pytest.approx(floors["int8"]) == pytest.approx(floors["lut4"])
    fp16 = floor(_function(2 * W, 2 * W), m5max).ms
    assert fp16 > floors["int8"]


@pytest.mark.parametrize(
    ("group", "opt_ms"), [(None, 14.76), (8, 15.49), (4, 17.07), (2, 30.72), (1, 59.11)]
)
def test_lut_granularity_scales_bytes_and_decode_by_apples_table(
    group: int | None, opt_ms: float
) -> None:
    relative = opt_ms / 14.76  # Apple's OPT-1.3B LUT4 time over the per-tensor time
    lut = _lut(4, group)
    assert lut.relative_cost == pytest.approx(relative)
    m4, m5max = chip("M4"), chip_or_variant("M5 Max")
    bytes_bound = floor(_function(2 * W, W // 2, (lut,)), m4)
    expected = _ms(W // 2 * relative, m4.weight_stream_gbps.value * 1e9)
    assert bytes_bound.components_ms["ne_weights"] == pytest.approx(expected)
    decode = floor(_function(2 * W, W // 2, (lut,)), m5max).components_ms["ne_decode"]
    assert decode == pytest.approx(_ms(W * relative, m5max.decode_gweights.value * 1e9))  # type: ignore[union-attr]


def test_a_group_between_two_measured_sizes_costs_the_cheaper_one() -> None:
    assert granularity_cost(32) == 1.0  # larger than 8: per tensor's cost
    assert granularity_cost(3) == pytest.approx(17.07 / 14.76)  # group 4's, not group 2's


@pytest.mark.parametrize(("bits", "padded"), [(3, 4), (6, 8), (4, 4), (8, 8), (2, 2)])
def test_3_and_6_bit_indices_stream_like_4_and_8_where_the_chip_pads(
    bits: int, padded: int
) -> None:
    m1, m4 = chip("M1"), chip("M4")
    assert m1.index_padding and not m4.index_padding
    fn = _function(2 * W, W * bits // 8, (_lut(bits),))
    padded_ms = _ms(W * padded // 8, m1.weight_stream_gbps.value * 1e9)
    assert floor(fn, m1).components_ms["ne_weights"] == pytest.approx(padded_ms)
    # base M4: the measured LUT6 head streams its 6-bit bytes (anemll-bench issue 5)
    unpadded = _ms(W * bits // 8, m4.weight_stream_gbps.value * 1e9)
    assert floor(fn, m4).components_ms["ne_weights"] == pytest.approx(unpadded)


def test_the_section_carries_the_relative_costs_with_their_sources() -> None:
    report = static_report(op_table(pp.bc1l_block()), "p", "h", "M4", other_chips=())
    section = cost_section([(chip_or_variant("M4 Max"), report)])
    rel = section["relative_costs"]
    assert rel["evidence"] == "predicted"
    assert rel["lut_granularity"]["per-channel"] == pytest.approx(59.11 / 14.76, abs=1e-3)
    assert "opt-opt1_3" in rel["lut_granularity_source"]
    assert "M6" in rel["index_width_source"] and rel["index_width"]["3-bit"] == "times like 4-bit"
    assert "weight-decode rate" in section["formula"]
    rate = section["chips"]["M4 Max"]["decode_gweights"]
    assert rate["unit"] == "G weights/s" and "anemll-bench issue 1" in rate["source"]


def test_a_state_read_and_written_every_call_is_priced_as_copies() -> None:
    # A KV cache state: read as a function input (already in input_bytes) and written back.
    from dataclasses import replace

    plain = _function(2 * W, 2 * W)
    state = 12_000_000
    summary = replace(plain.summary, input_bytes=state, state_read_bytes=state,
                      state_write_bytes=state)  # fmt: skip
    stateful = FunctionReport("decode", plain.rows, summary)
    assert work_of(stateful).copy_bytes == work_of(plain).copy_bytes + 2 * state
    m1 = chip("M1")
    extra = floor(stateful, m1).ms - floor(plain, m1).ms
    assert extra == pytest.approx(_ms(2 * state, m1.weight_stream_gbps.value * 1e9))
