"""The static predictor against published compute-plan dumps (docs/placement-rules.md s. 3), its
global-before-op order, the neighbour rule, per-chip differences and the rule table itself."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import plan_programs as pp
import pytest

from converter.placement.chips import CHIPS, chip
from converter.placement.ops import op_table
from converter.placement.predict import place_op, predict_function, program_facts
from converter.placement.rules import (
    ALL_RULES,
    CALIBRATIONS,
    RULES,
    Context,
    ProgramFacts,
    calibration_status,
)
from converter.placement.static import static_report


def placed(prog: Any, chip_name: str = "M1", units: str = "CPU_AND_NE") -> dict[str, Any]:
    """op name -> Placement for the program's main function."""
    f = op_table(prog).functions[0]
    return {
        op.name: p
        for op, p in zip(f.ops, predict_function(f, chip(chip_name), units), strict=True)  # type: ignore[arg-type]
    }


def devices(prog: Any, chip_name: str = "M1") -> dict[str, str]:
    return {name: p.device for name, p in placed(prog, chip_name).items()}


# ------------------------------------------------------------- counter-examples from dumps


def test_d1_casts_integer_ops_and_gather_go_to_the_cpu_while_the_rest_stays_on_the_ne() -> None:
    d = devices(pp.decoder_with_int_ops())
    cpu = {"in_cast", "out_cast", "int_add", "mask_ge", "select", "gather"}
    assert {n for n, dev in d.items() if dev == "CPU"} == cpu
    ne_types = Counter(n.split("_")[-1] for n, dev in d.items() if dev == "NE")
    assert ne_types["linear"] == 3 and ne_types["norm"] == 3
    assert d["scores"] == d["probs"] == d["cat"] == "NE"


def test_d1_every_op_of_an_fp32_program_lands_off_the_ne() -> None:
    p = placed(pp.mlp(4, "fp32"))
    assert {x.device for x in p.values()} == {"CPU"}
    # Decided by the dtype, not by the graph being small.
    assert {x.rule.id for x in p.values()} == {"R-FP32"}


def test_d2_lfm2_like_program_keeps_everything_but_the_token_gather_and_cast_on_the_ne() -> None:
    d = devices(pp.lfm2_like())
    assert {n for n, dev in d.items() if dev != "NE"} == {"embed_gather", "embed_cast"}
    ne_types = {n for n, dev in d.items() if dev == "NE"}
    assert {"norm_mean", "norm_rsqrt", "act", "scores", "probs", "padded", "tiled"} <= ne_types


def test_d4_topk_and_the_ops_consuming_its_indices_go_to_the_cpu() -> None:
    d = devices(pp.topk_head())
    assert {n for n, dev in d.items() if dev == "CPU"} == {
        "topk",
        "idx_expand",
        "idx_tile",
        "picked",
    }
    assert all(d[f"layers_{i}_conv"] == "NE" for i in range(4))


def test_d5_a_tiny_fp32_matmul_and_its_casts_all_prefer_the_cpu() -> None:
    p = placed(pp.tiny_fp32_matmul())
    assert [x.device for x in p.values()] == ["CPU", "CPU", "CPU"]


@pytest.mark.parametrize("layers", [1, 2])
def test_a_one_or_two_layer_fp16_graph_stays_on_the_cpu(layers: int) -> None:
    p = placed(pp.mlp(layers))
    assert {x.device for x in p.values()} == {"CPU"}
    assert {x.rule.id for x in p.values()} == {"R-TINY"}


def test_a_four_layer_fp16_mlp_is_ne_resident() -> None:
    assert set(devices(pp.mlp(4)).values()) == {"NE"}


def test_an_anec_style_bc1l_block_is_all_on_the_ne() -> None:
    p = placed(pp.bc1l_block())
    assert {x.device for x in p.values()} == {"NE"}
    assert {x.confidence for x in p.values()} == {"high"}


# ---------------------------------------------------------------- order, neighbours, limits


def test_global_rules_decide_before_op_rules_and_the_agreeing_op_rule_is_kept() -> None:
    gather = placed(pp.lfm2_like())["embed_gather"]
    assert gather.rule.id == "R-INT"  # global dtype rule first
    assert gather.also is not None and gather.also.id == "O-GATHER"
    assert "on the host" in gather.fix and "embeddings" in gather.fix


def _neighbour_program() -> Any:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 32, 1, 8), dtype=types.fp16),
            mb.TensorSpec(shape=(1, 8), dtype=types.int32),
        ],
        opset_version=pp._target(),
    )
    def prog(x: Any, ids: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 32)
        i = mb.add(x=ids, y=np.int32(2), name="int_add")
        f = mb.cast(x=i, dtype="fp16", name="to_fp16")
        lone = mb.mul(x=f, y=np.float16(0.5), name="lone_mul")
        back = mb.cast(x=lone, dtype="int32", name="to_int")
        return h, back

    return prog


def test_a_lone_ne_capable_op_between_cpu_ops_moves_to_the_cpu() -> None:
    p = placed(_neighbour_program())
    assert p["lone_mul"].device == "CPU"
    assert p["lone_mul"].rule.id == "R-SEG"
    assert all(p[f"layers_{i}_conv"].device == "NE" for i in range(3))


def test_an_ne_op_with_one_ne_neighbour_stays_even_next_to_cpu_ops() -> None:
    p = placed(pp.topk_head())
    assert p["topk"].device == "CPU"
    assert p["flat"].device == "NE"  # feeds the CPU topk, but its producer is on the NE


def test_control_flow_bodies_go_to_the_cpu() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 16, 1, 4), dtype=types.fp16),
            mb.TensorSpec(shape=(1,), dtype=types.bool),
        ],
        opset_version=pp._target(),
    )
    def prog(x: Any, flag: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 16)
        pred = mb.squeeze(x=flag, name="pred")
        return mb.cond(
            pred=pred,
            _true_fn=lambda: mb.mul(x=h, y=np.float16(2), name="inside_true"),
            _false_fn=lambda: mb.add(x=h, y=np.float16(1), name="inside_false"),
            name="branch",
        )

    p = placed(prog)
    assert p["inside_true"].device == "CPU" and p["inside_true"].rule.id == "R-CTRL"
    assert p["inside_false"].rule.id == "R-CTRL"
    assert p["layers_0_conv"].device == "NE"


def test_symbolic_shapes_leave_the_ne() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import get_new_symbol, types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 16, 1, get_new_symbol()), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        return pp.conv_chain(mb, x, 3, 16)

    p = placed(prog)
    assert {x.rule.id for x in p.values()} == {"R-DYN"}
    assert {x.device for x in p.values()} == {"CPU"}


def test_rank_above_five_leaves_the_ne_and_rank_five_does_not() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 16, 1, 8), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 16)
        r5 = mb.reshape(x=h, shape=[1, 2, 8, 1, 8], name="rank5")
        r6 = mb.reshape(x=r5, shape=[1, 2, 2, 4, 1, 8], name="rank6")
        return mb.relu(x=r6, name="relu6d")

    p = placed(prog)
    assert p["rank5"].device == "NE"
    assert p["rank6"].rule.id == "R-RANK" and p["relu6d"].device == "CPU"


def test_batch_above_one_on_an_activation_matmul_is_predicted_off_the_ne() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    def build(batch: int) -> Any:
        @mb.program(
            input_specs=[mb.TensorSpec(shape=(batch, 4, 8, 8), dtype=types.fp16)],
            opset_version=pp._target(),
        )
        def prog(x: Any) -> Any:
            h = x
            for i in range(3):
                h = mb.matmul(x=h, y=pp.w16(8, 8), name=f"layers_{i}_proj")
            return mb.matmul(x=h, y=h, transpose_y=True, name="act_matmul")

        return prog

    two = placed(build(2))
    assert two["act_matmul"].rule.id == "R-BATCH" and two["act_matmul"].device == "CPU"
    assert two["layers_0_proj"].device == "NE"  # constant weight: an ordinary projection
    assert placed(build(1))["act_matmul"].device == "NE"


# ------------------------------------------------------------------------ per-chip rules


def test_a_vocabulary_wide_head_is_cpu_up_to_m3_and_ne_from_m4() -> None:
    prog = pp.wide_head(49152)
    assert devices(prog, "M1")["lm_head"] == "CPU"
    assert placed(prog, "M3")["lm_head"].rule.id == "R-LMHEAD"
    assert devices(prog, "M4")["lm_head"] == "NE"
    assert devices(prog, "A17 Pro")["lm_head"] == "NE"
    # Over 65536 no chip takes it.
    assert devices(pp.wide_head(70000), "M4")["lm_head"] == "CPU"


def test_the_static_report_names_the_chips_that_differ() -> None:
    report = static_report(op_table(pp.wide_head()), "p", "h", "M1")
    head = next(r for r in report.functions[0].rows if r.name == "lm_head")
    assert head.device == "CPU"
    assert head.other_chips == {"M4": "NE", "A17 Pro": "NE", "M5": "NE"}
    assert report.chips["M1"]["off_ne_ops"] == 1 and report.chips["M4"]["off_ne_ops"] == 0


def test_sin_and_cos_are_cpu_on_m1_m2_and_ne_from_m3() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 16, 1, 8), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 16)
        s = mb.sin(x=h, name="sin")
        return mb.add(x=s, y=mb.cos(x=h, name="cos"), name="sum")

    assert devices(prog, "M2")["sin"] == "CPU"
    assert devices(prog, "M3")["sin"] == "NE" and devices(prog, "M3")["cos"] == "NE"


def test_kernel_width_fourteen_is_cpu_on_m1_only() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 16, 1, 64), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 16)
        return mb.conv(x=h, weight=pp.w16(16, 16, 1, 14), name="wide_kernel")

    assert devices(prog, "M1")["wide_kernel"] == "CPU"
    assert devices(prog, "M2")["wide_kernel"] == "NE"


def test_the_model_size_budget_is_1_gb_on_iphone_and_2_gb_on_a_mac() -> None:
    f = op_table(pp.bc1l_block()).functions[0]
    conv = f.ops[0]
    facts = program_facts(f)
    big = ProgramFacts(facts.compute_layers, int(1.5e9), facts.symbolic_inputs)
    on_phone = place_op(conv, Context(chip("A17 Pro"), "CPU_AND_NE", big))
    on_mac = place_op(conv, Context(chip("M4"), "CPU_AND_NE", big))
    assert on_phone.device == "CPU" and on_phone.rule.id == "R-SIZE"
    assert on_mac.device == "NE"


def test_compute_units_cpu_and_gpu_excludes_the_ne_and_all_caps_confidence() -> None:
    assert {p.device for p in placed(pp.bc1l_block(), units="CPU_AND_GPU").values()} == {"GPU"}
    everything = placed(pp.bc1l_block(), units="ALL")
    assert {p.device for p in everything.values()} == {"NE"}
    assert {p.confidence for p in everything.values()} == {"medium"}


# ----------------------------------------------------------------------- the table itself


def test_the_rule_table_is_complete_data() -> None:
    ids = [r.id for r in ALL_RULES]
    assert len(ids) == len(set(ids))
    for r in ALL_RULES:
        assert r.condition and r.sources and r.confidence in ("high", "medium", "low")
        if r.device not in ("NE", "none"):
            assert r.fix, f"{r.id} predicts {r.device} but says nothing about what to change"
        if r.chips is not None:
            assert r.chips <= set(CHIPS)
    # Program rules come before global rules, which come before op rules.
    stages = [r.stage for r in RULES]
    assert stages == sorted(stages, key=["program", "global", "op"].index)


def test_static_predictions_stay_uncalibrated_until_a_real_dump_is_recorded() -> None:
    assert CALIBRATIONS == ()
    assert calibration_status() == "uncalibrated"
    assert static_report(op_table(pp.bc1l_block()), "p", "h").calibration == "uncalibrated"


def test_cpu_op_rules_and_an_op_no_rule_knows() -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 16, 1, 8), dtype=types.fp16)],
        opset_version=pp._target(),
    )
    def prog(x: Any) -> Any:
        h = pp.conv_chain(mb, x, 3, 16)
        running = mb.cumsum(x=h, axis=3, name="running")
        cropped = mb.crop(x=h, crop_height=[0, 0], crop_width=[1, 1], name="cropped")
        return running, mb.argsort(x=h, axis=1, name="order"), cropped

    p = placed(prog)
    assert p["running"].rule.id == "O-CUMSUM" and p["running"].confidence == "low"
    assert p["order"].device == "CPU" and p["order"].rule.id == "R-INT"
    assert p["cropped"].rule.id == "R-UNKNOWN" and p["cropped"].device == "CPU"
    assert p["cropped"].confidence == "low" and p["cropped"].fix
