"""What the plan knows of a compressed weight (plan.decode, a prediction): index width and
LUT granularity read from the MIL constexprs, and the weight-decode term those feed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from converter.placement.chips import VARIANTS
from converter.placement.cost import floor
from converter.placement.ops import op_table
from converter.placement.static import static_report

ROWS, COLS = 64, 128  # a conv weight (ROWS, COLS, 1, 1)


def _program(weight: str, bits: int = 4, palettes: int = 1, layers: int = 1) -> Any:
    """``layers`` convs on one weight stored as ``weight``: "lut" (``palettes`` along the
    output channels), "int8" per channel, or "int4-block" (per block of 32 inputs)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, COLS, 1, 8), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any) -> Any:
        if weight == "lut":
            dtype = np.uint8 if bits == 8 else getattr(types, f"np_uint{bits}_dtype")
            w = mb.constexpr_lut_to_dense(
                indices=np.zeros((ROWS, COLS, 1, 1), dtype),
                lut=np.zeros((palettes, 1, 1, 1, 2**bits, 1), np.float16),
            )
        elif weight == "int8":
            w = mb.constexpr_blockwise_shift_scale(
                data=np.ones((ROWS, COLS, 1, 1), np.int8),
                scale=np.ones((ROWS, 1, 1, 1), np.float16),
            )
        else:
            w = mb.constexpr_blockwise_shift_scale(
                data=np.ones((ROWS, COLS, 1, 1), types.np_int4_dtype),
                scale=np.ones((ROWS, COLS // 32, 1, 1), np.float16),
            )
        y = mb.conv(x=x, weight=w, name="conv")
        for i in range(1, layers):  # each conv reads (and decodes) the same weight again
            y = mb.conv(x=mb.concat(values=[y, y], axis=1), weight=w, name=f"conv_{i}")
        return y

    return prog


def _conv(prog: Any) -> Any:
    return next(op for op in op_table(prog).functions[0].ops if op.name == "conv")


@pytest.mark.parametrize(
    ("palettes", "group", "name", "opt_ms"),
    [
        (1, None, "per-tensor", 14.76),
        (ROWS // 8, 8, "group 8", 15.49),
        (ROWS // 4, 4, "group 4", 17.07),
        (ROWS // 2, 2, "group 2", 30.72),
        (ROWS, 1, "per-channel", 59.11),
        (ROWS // 32, 32, "group 32", 14.76),  # between per tensor and group 8: the cheaper
    ],
)
def test_lut_granularity_is_read_from_the_palette_shape(
    palettes: int, group: int | None, name: str, opt_ms: float
) -> None:
    (d,) = _conv(_program("lut", 4, palettes)).decoded
    assert (d.rule, d.index_bits, d.group, d.granularity) == ("S-LUT", 4, group, name)
    assert d.weights == ROWS * COLS
    assert d.relative_cost == pytest.approx(opt_ms / 14.76)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_the_index_width_is_read_from_the_indices_dtype(bits: int) -> None:
    conv = _conv(_program("lut", bits))
    (d,) = conv.decoded
    assert d.index_bits == bits and d.stored_bytes == conv.weight_bytes


def test_per_channel_int8_is_decoded_and_a_per_block_weight_is_not() -> None:
    (d,) = _conv(_program("int8")).decoded
    assert (d.rule, d.weights, d.index_bits, d.relative_cost) == ("S-INT8", ROWS * COLS, None, 1)
    assert _conv(_program("int4-block")).decoded == ()  # expanded to fp16 at load (S-BLOCK)


def test_the_floor_decodes_the_weights_the_op_table_found() -> None:
    """Three convs (so the tiny-graph rule does not decide) on one per-channel LUT4 weight."""
    m5max = VARIANTS["M5 Max"]
    table = op_table(_program("lut", 4, ROWS, layers=3))
    report = static_report(table, "p", "h", m5max.placement_chip, other_chips=())
    convs = [r for r in report.functions[0].rows if r.op_type == "conv"]
    assert [r.device for r in convs] == ["NE"] * 3
    assert all(r.decoded[0].granularity == "per-channel" for r in convs)
    rate = m5max.decode_gweights.value * 1e9  # type: ignore[union-attr]
    expected = 3 * ROWS * COLS * (59.11 / 14.76) / rate * 1e3
    assert floor(report.functions[0], m5max).components_ms["ne_decode"] == pytest.approx(expected)


def _square_lut4_chain(channels: int = 4096, layers: int = 3) -> Any:
    """``layers`` square 1x1 convs on one per-tensor LUT4 weight: 50 M weights decoded per
    call, enough that neither dispatch nor copies set the floor."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, channels, 1, 1), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any) -> Any:
        w = mb.constexpr_lut_to_dense(
            indices=np.zeros((channels, channels, 1, 1), types.np_uint4_dtype),
            lut=np.linspace(-1, 1, 16, dtype=np.float16).reshape(1, 1, 1, 1, 16, 1),
        )
        for i in range(layers):
            x = mb.conv(x=x, weight=w, name=f"layers_{i}_conv")
        return x

    return prog


def test_plan_inspect_names_the_weight_decode_bound_in_text_html_and_json(tmp_path: Path) -> None:
    import coremltools as ct
    from click.testing import CliRunner

    from converter.commands import main

    package = tmp_path / "lut4.mlpackage"
    ct.convert(
        _square_lut4_chain(),
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    ).save(str(package))
    runner = CliRunner()
    doc = json.loads(runner.invoke(main, ["plan-inspect", str(package), "--json"]).output)
    floors = {f["chip"]: f for f in doc["packages"][0]["predicted"]["floors"]}
    decoded = 3 * 4096 * 4096
    for name in ("M4 Max", "M5 Max"):
        rate = VARIANTS[name].decode_gweights.value * 1e9  # type: ignore[union-attr]
        assert floors[name]["bound"] == "weight-decode", name
        assert floors[name]["components_ms"]["ne_decode"] == pytest.approx(decoded / rate * 1e3)
    assert floors["M4"]["bound"] == "weights" and floors["M4"]["components_ms"]["ne_decode"] == 0
    text = runner.invoke(main, ["plan-inspect", str(package), "--no-ops"]).output
    assert any("M4 Max" in line and "weight-decode" in line for line in text.splitlines())
    html_file = tmp_path / "r.html"
    runner.invoke(main, ["plan-inspect", str(package), "--html", str(html_file)])
    assert "<td>M5 Max</td>" in html_file.read_text()
    assert "<td>weight-decode</td>" in html_file.read_text()
