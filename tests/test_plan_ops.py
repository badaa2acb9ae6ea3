"""The op table: FLOPs, weight bytes, 64-byte row padding, producers and layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import plan_programs as pp

from converter.placement.ops import Op, Tensor, assign_layers, layer_of, op_table
from converter.placement.report import summarize
from converter.placement.static import static_report


def by_name(prog: Any) -> dict[str, Op]:
    return {op.name: op for op in op_table(prog).functions[0].ops}


def test_flops_of_conv_linear_matmul_einsum_count_multiply_and_add() -> None:
    ops = by_name(pp.bc1l_block())
    assert ops["layers_0_conv"].flops == 2 * (64 * 16) * 64  # out elements x C_in
    assert ops["layers_0_relu"].flops == 64 * 16
    # score (1, 16, 1, 16) contracts d=32: 2 * 16 * 16 * 32
    assert ops["layers_3_score"].flops == 2 * 16 * 16 * 32
    assert ops["layers_3_softmax"].flops == 5 * 16 * 16
    assert ops["layers_3_kt"].flops == 0
    d1 = by_name(pp.decoder_with_int_ops())
    assert d1["layers_0_linear"].flops == 2 * (8 * 32) * 32
    assert d1["scores"].flops == 2 * (8 * 8) * 32  # (1, 8, 32) x (1, 8, 32)^T


def test_weight_bytes_are_the_constants_an_op_reads() -> None:
    ops = by_name(pp.decoder_with_int_ops())
    assert ops["layers_0_linear"].weight_bytes == (32 * 32 + 32) * 2  # weight + bias, fp16
    assert ops["gather"].weight_bytes == 50 * 32 * 2
    assert ops["layers_0_norm"].weight_bytes == 0
    assert ops["int_add"].weight_bytes == 0  # a scalar is a parameter, not a weight
    table = op_table(pp.decoder_with_int_ops())
    # Stored once: 3 x (weight + bias) + the gather table (+ tiny mask constants).
    stored = table.functions[0].weight_bytes_stored
    assert 3 * (32 * 32 + 32) * 2 + 50 * 32 * 2 <= stored < 3 * (32 * 32 + 32) * 2 + 6000


def test_compressed_weights_are_charged_to_their_consumer_at_their_stored_size() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        w = mb.constexpr_affine_dequantize(
            quantized_data=np.ones((64, 64, 1, 1), dtype=np.int8),
            zero_point=np.int8(0),
            scale=np.float16(0.1),
            axis=0,
            name="dequant",
        )
        return mb.conv(x=x, weight=w, name="qconv")

    ops = by_name(prog)
    assert not ops["dequant"].dispatchable
    assert ops["qconv"].weight_bytes >= 64 * 64  # int8 data, not the fp16 size
    assert ops["qconv"].weight_bytes < 64 * 64 * 2
    report = static_report(op_table(prog), "p", "h")
    rows = {r.name: r for r in report.functions[0].rows}
    assert rows["dequant"].device == "none" and rows["dequant"].rule == "R-CONST"
    assert report.functions[0].summary.ops == 1  # constexprs are not dispatchable


def test_rows_are_padded_to_64_bytes_on_the_last_axis() -> None:
    logits = Tensor("logits", (1, 16384, 1, 1), "fp16")
    assert logits.nbytes == 32768
    assert logits.aligned_nbytes == 16384 * 64  # 32x: one fp16 per 64-byte row
    wide = Tensor("h", (1, 576, 1, 64), "fp16")
    assert wide.aligned_nbytes == wide.nbytes
    assert logits.short_last_axis and not wide.short_last_axis
    assert Tensor("t", (1, 16), "fp16").short_last_axis  # 32 bytes of a 64-byte row
    assert Tensor("s", (1, None), "fp16").nbytes is None


def test_producers_consumers_and_function_boundaries() -> None:
    f = op_table(pp.bc1l_block()).functions[0]
    ops = {op.name: op for op in f.ops}
    score = ops["layers_3_score"]
    assert {f.ops[i].name for i in score.producers} == {"layers_3_kt", "layers_3_qk"}
    assert [f.ops[i].name for i in score.consumers] == ["layers_3_softmax"]
    assert ops["layers_0_conv"].reads_function_input
    assert ops["layers_3_out"].writes_function_output


def test_layers_come_from_weight_names_and_fill_the_ops_between() -> None:
    assert layer_of("layers_12_mlp_down_weight_to_fp16") == 12
    assert layer_of("model.layers.3.self_attn") == 3
    assert layer_of("players_2") is None and layer_of("op_121_cast_fp16") is None
    names = ["x", "layers_0_a", "mid", "layers_0_b", "gap", "layers_1_a", "shared", "tail"]
    ops = [Op("main", i, "add", n, [], [], {}, {}, 0, 0) for i, n in enumerate(names)]
    # "shared" reads a constant named after layer 0 (e.g. a RoPE table): ignored, not a step back.
    ops[6].consts["y"] = Tensor("layers_0_rope_cos", (4,), "fp16")
    ops.append(Op("main", 8, "add", "layers_1_end", [], [], {}, {}, 0, 0))
    assign_layers(ops)
    assert [op.layer for op in ops] == [None, 0, 0, 0, 1, 1, 1, 1, 1]


def test_summary_counts_segments_transitions_and_crossing_bytes() -> None:
    report = static_report(op_table(pp.topk_head()), "p", "h")
    s = report.functions[0].summary
    assert [seg.device for seg in s.segments] == ["NE", "CPU", "NE", "CPU"]
    assert s.ne_segments == 2 and s.transitions == 3
    # flat (1, 512) fp16 goes NE -> CPU into topk, boxes NE -> CPU into gather_along_axis.
    assert s.boundary_bytes == 512 * 2 + 256 * 64  # boxes (1, 256, 2): 4-byte rows padded
    assert s.breakers and all(r.device == "CPU" for r in s.breakers)
    assert summarize(op_table(pp.topk_head()).functions[0], report.functions[0].rows) == s


def test_the_table_reads_a_saved_package(tmp_path: Path) -> None:
    from parity.mil.program import load_package

    package = pp.save(pp.bc1l_block(), tmp_path / "b.mlpackage")
    table = op_table(load_package(package))
    types_ = [op.op_type for op in table.functions[0].ops]
    assert types_.count("conv") == 3 and types_.count("einsum") == 2
    assert sum(op.weight_bytes for op in table.ops()) == 3 * 64 * 64 * 2
