"""What the NE streams per call for each stored weight format (plan.streamed, a prediction):
palettes and per-channel integers are read at their stored size, per-block integers as the
dense fp16 weight they expand to at load, and the cost floor uses that figure."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from converter.placement.ops import op_table
from converter.placement.stream_rules import RULES, streamed_lines, streamed_section

ROWS, COLS = 64, 128  # a conv weight (ROWS, COLS, 1, 1)
DENSE = ROWS * COLS * 2


def _program(kind: str, layers: int = 1) -> Any:
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, COLS, 1, 8), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any) -> Any:
        ints = np.ones((ROWS, COLS, 1, 1), np.int8)
        if kind == "lut4":
            w = mb.constexpr_lut_to_dense(
                indices=np.zeros((ROWS, COLS, 1, 1), types.np_uint4_dtype),
                lut=np.arange(16, dtype=np.float16).reshape(1, 1, 1, 1, 16, 1),
            )
        elif kind == "int4-channel":
            w = mb.constexpr_blockwise_shift_scale(
                data=ints.astype(types.np_int4_dtype), scale=np.ones((ROWS, 1, 1, 1), np.float16)
            )
        elif kind == "int8-channel":
            w = mb.constexpr_blockwise_shift_scale(
                data=ints, scale=np.ones((ROWS, 1, 1, 1), np.float16)
            )
        else:  # int4 per block of 32 inputs
            w = mb.constexpr_blockwise_shift_scale(
                data=ints.astype(types.np_int4_dtype),
                scale=np.ones((ROWS, COLS // 32, 1, 1), np.float16),
            )
        y = mb.conv(x=x, weight=w, name="conv")
        for i in range(1, layers):  # square convs reading the same weight format
            y = mb.conv(x=mb.concat(values=[y, y], axis=1), weight=w, name=f"conv_{i}")
        return y

    return prog


@pytest.mark.parametrize(
    ("kind", "rule", "read"),
    [
        ("lut4", "S-LUT", ROWS * COLS // 2 + 16 * 2),
        ("int4-channel", "S-INT4-CHANNEL", ROWS * COLS // 2 + ROWS * 2),
        ("int8-channel", "S-INT8", ROWS * COLS + ROWS * 2),
        ("int4-block", "S-BLOCK", DENSE),
    ],
)
def test_each_format_is_read_as_its_rule_says(kind: str, rule: str, read: int) -> None:
    table = op_table(_program(kind))
    (f,) = table.functions
    conv = next(op for op in f.ops if op.name == "conv")
    assert conv.weight_bytes == read
    assert f.streamed[rule]["weights"] == 1 and f.streamed[rule]["streamed"] == read
    section = streamed_section(table)
    assert section["evidence"] == "predicted"
    assert section["functions"]["main"]["weight_bytes_read_per_call"] == read
    assert any(rule in line for line in streamed_lines(section))


def test_every_rule_names_its_source_and_the_floor_reads_the_streamed_bytes() -> None:
    from converter.placement.chips import CHIPS
    from converter.placement.cost import floor, work_of
    from converter.placement.static import static_report

    assert all(r.source and r.confidence in ("H", "M", "L") for r in RULES)
    chip = next(iter(CHIPS.values()))
    floors = {}
    for kind in ("int4-channel", "int4-block"):
        table = op_table(_program(kind))
        report = static_report(table, kind, "0" * 64, chip.name, "CPU_AND_NE", ())
        work = work_of(report.functions[0])
        floors[kind] = work.ne_weight_bytes + work.cpu_weight_bytes
        assert floor(report.functions[0], chip).ms > 0
    # the cost model reads what the rules say: the per-block weight dense, the other packed
    assert floors == {"int4-channel": ROWS * COLS // 2 + ROWS * 2, "int4-block": DENSE}


@pytest.mark.parametrize(("kind", "device", "rule"), [
    ("int4-block", "CPU", "O-BLOCKW"), ("int4-channel", "NE", "O-CONV"), ("lut4", "NE", "O-CONV"),
])  # fmt: skip
def test_a_conv_on_per_block_weights_is_predicted_off_the_ne(
    kind: str, device: str, rule: str
) -> None:
    """Per-block integers are GPU-oriented: the NE runs per-channel or per-tensor formats only
    (rule O-BLOCKW, with its sources); three convs, so the tiny-graph rule does not decide."""
    from converter.placement.chips import CHIPS
    from converter.placement.static import static_report

    table = op_table(_program(kind, layers=3))
    for chip in CHIPS.values():
        report = static_report(table, kind, "0" * 64, chip.name, "CPU_AND_NE", ())
        convs = [r for r in report.functions[0].rows if r.op_type == "conv"]
        assert len(convs) == 3
        assert all((r.device, r.rule) == (device, rule) for r in convs), convs
