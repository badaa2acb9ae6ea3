"""The chip table: what `converter.plan.chips` fills in for a chip must agree with its limits."""

from __future__ import annotations

from converter.plan.chips import CHIPS, STRICTEST, chip, chips_for


def test_the_table_lists_every_chip_once_in_order() -> None:
    assert list(CHIPS) == ["M1", "M2", "M3", "M4", "A17 Pro", "M5"]
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
    for c in CHIPS.values():
        for key, unit in units.items():
            figure = c.to_json()[key]
            assert figure["unit"] == unit and figure["source"], (c.name, key)
            assert figure["low"] <= figure["value"] <= figure["high"], (c.name, key)
