"""The chip table: what `converter.placement.chips` fills in for a chip must agree with its
limits.
"""

from __future__ import annotations

from converter.placement.chips import CHIPS, STRICTEST, VARIANTS, chip, chips_for, cost_chips
from converter.placement.decode import PADDING_SOURCE


def test_the_table_lists_every_chip_once_in_order() -> None:
    assert list(CHIPS) == ["M1", "M2", "M3", "M4", "A17 Pro", "M5"]  # placement chips
    assert [c.name for c in chips_for("iOS")] == ["A17 Pro"]
    assert chip("a17pro") is CHIPS["A17 Pro"]
    strictest = CHIPS[STRICTEST]
    assert all(strictest.max_spatial <= c.max_spatial for c in CHIPS.values())


def test_int8_figure_is_the_fp16_one_exactly_where_there_is_no_fast_path() -> None:
    for c in CHIPS.values():
        fp16, int8 = c.fp16_tflops, c.int8_tops
        same = (int8.value, int8.low, int8.high) == (fp16.value, fp16.low, fp16.high)
        assert same is not c.int8_fast_path, c.name
        assert int8.unit == "TOPS" and fp16.unit == "TFLOP/s"
        if not c.int8_fast_path:
            assert "no int8 fast path" in int8.source, c.name


def test_every_figure_has_a_unit_a_source_and_a_range_around_its_value() -> None:
    units = {
        "fp16_tflops": "TFLOP/s",
        "int8_tops": "TOPS",
        "weight_stream_gbps": "GB/s",
        "dispatch_ms": "ms",
        "cpu_gflops": "GFLOP/s",
        "cpu_gbps": "GB/s",
    }
    for c in cost_chips():
        for key, unit in units.items():
            figure = c.to_json()[key]
            assert figure["unit"] == unit and figure["source"], (c.name, key)
            assert figure["low"] <= figure["value"] <= figure["high"], (c.name, key)


def test_variants_are_priced_with_their_base_chips_ne_and_placed_as_it() -> None:
    assert [c.name for c in cost_chips()] == [
        "M1", "M2", "M3", "M4", "M4 Max", "A17 Pro", "M5", "M5 Max",
    ]  # fmt: skip
    assert {n: v.variant_of for n, v in VARIANTS.items()} == {"M4 Max": "M4", "M5 Max": "M5"}
    for v in VARIANTS.values():
        base = CHIPS[v.placement_chip]
        assert v.name not in CHIPS and base.placement_chip == base.name
        limits = ("platform", "max_spatial", "max_channels", "model_budget_bytes")
        flags = ("native_trig", "texture_engine", "int8_fast_path")
        assert all(getattr(v, k) == getattr(base, k) for k in (*limits, *flags)), v.name
        assert v.weight_stream_gbps.value > base.weight_stream_gbps.value  # the Max memory


def test_a_decode_rate_exactly_where_one_was_measured_with_its_source() -> None:
    rated = {c.name: c.decode_gweights for c in cost_chips() if c.decode_gweights is not None}
    assert set(rated) == {"M4 Max", "M5 Max"}
    assert rated["M4 Max"].value == 130.0 and "anemll-bench issue 1" in rated["M4 Max"].source
    m5max = rated["M5 Max"]
    assert (m5max.value, m5max.low, m5max.high) == (150.0, 125.0, 155.0)
    assert "RESULTS_M5_MAX_INT8" in m5max.source
    for c in cost_chips():
        figure = c.to_json()["decode_gweights"]
        if c.name in rated:
            assert figure["unit"] == "G weights/s" and figure["low"] <= figure["value"]
        else:
            assert figure == "not measured: no weight-decode bound", c.name


def test_index_padding_is_off_where_a_measurement_says_so_and_sourced_everywhere() -> None:
    off = {c.name for c in cost_chips() if not c.index_padding}
    assert off == {"M4", "M4 Max"}
    for c in cost_chips():
        assert c.index_padding_source, c.name
        if c.name in off:
            assert "anemll-bench issue" in c.index_padding_source
        else:
            assert PADDING_SOURCE in c.index_padding_source
