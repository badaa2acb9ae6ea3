"""The MIL level has teeth below the torch level: a conversion bug planted as a MIL graph pass
(run by coremltools after its own passes, so torch never sees it) is caught by the MIL-level
gate while torch-level parity of the same module still passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import Tiny, build_tiny

from converter.coreml.program import trace
from converter.coreml.targets import TARGETS
from converter.tasks.decoder_contract import tensor_contract
from graph_passes.markers import MarkerError, find_markers, mark_layer_outputs
from parity import conversion
from parity.decoder_gates import check_decoder
from parity.mil import UnsupportedOpError, load_package
from parity.report import conversion_to_text


def _replace(op: Any, build: Callable[[], Any]) -> None:
    """Put ``build()``'s result in place of ``op``'s output and remove ``op``."""
    block = op.enclosing_block
    with block:
        new = build()
    block.replace_uses_of_var_after_op(
        anchor_op=op, old_var=op.outputs[0], new_var=new, force_replace=True
    )
    block.remove_ops([op])


def swap_softmax_axis(program: Any) -> None:
    """Attention weights normalised over queries (axis 3) instead of keys (axis 1)."""
    from coremltools.converters.mil import Builder as mb

    for function in program.functions.values():
        for op in [op for op in function.operations if op.op_type == "softmax"]:
            _replace(op, lambda op=op: mb.softmax(x=op.x, axis=3, before_op=op))


def drop_conv_bias(program: Any) -> None:
    """Every conv loses its bias (Qwen2's q, k and v projections have one)."""
    from coremltools.converters.mil import Builder as mb

    for function in program.functions.values():
        for op in [op for op in function.operations if op.op_type == "conv"]:
            if op.bias is None:
                continue
            _replace(
                op,
                lambda op=op: mb.conv(
                    x=op.x,
                    weight=op.weight,
                    strides=op.strides,
                    pad_type=op.pad_type,
                    pad=op.pad,
                    dilations=op.dilations,
                    groups=op.groups,
                    before_op=op,
                ),
            )


def scale_norm_epsilon(program: Any) -> None:
    """The RMSNorm epsilon (the constant added to the sum of squares before rsqrt) x 100."""
    from coremltools.converters.mil import Builder as mb

    for function in program.functions.values():
        for op in [op for op in function.operations if op.op_type == "rsqrt"]:
            add = op.x.op
            assert add.op_type == "add" and add.y.val is not None and add.y.val.size == 1
            _replace(add, lambda add=add: mb.add(x=add.x, y=add.y.val * 100, before_op=add))


PASSES = {
    "swap_softmax_axis": swap_softmax_axis,
    "drop_conv_bias": drop_conv_bias,
    "scale_norm_epsilon": scale_norm_epsilon,
}


def _register() -> None:
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_registry import register_pass

    for name, fn in PASSES.items():
        cls = type(name, (AbstractGraphPass,), {"apply": lambda self, prog, fn=fn: fn(prog)})
        register_pass(namespace="anec_test", override=True)(cls)


def convert_with(module: Any, planted: str | None, out: Path, mark: bool = True) -> Path:
    """Convert like ``anec convert`` (fp16, macOS14), with one planted pass at the end."""
    import coremltools as ct
    import numpy as np

    _register()
    inputs, outputs = tensor_contract(module, "float16")
    traced = trace(module, inputs)
    if mark:
        mark_layer_outputs(traced, len(module.layers))
    pipeline = ct.PassPipeline.DEFAULT
    if planted is not None:
        pipeline.append_pass(f"anec_test::{planted}")
    dtype = {"int32": np.int32, "float16": np.float16}
    mlmodel = ct.convert(
        traced,
        inputs=[ct.TensorType(name=i.name, shape=i.shape, dtype=dtype[i.dtype]) for i in inputs],
        outputs=[ct.TensorType(name=o.name, dtype=np.float16) for o in outputs],
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT16,
        minimum_deployment_target=TARGETS["macOS14"].ct_target(),
        skip_model_load=True,
        pass_pipeline=pipeline,
    )
    package = out / f"{planted or 'clean'}-{'marked' if mark else 'unmarked'}.mlpackage"
    mlmodel.save(str(package))
    return package


@pytest.fixture(scope="module")
def qwen2() -> Tiny:
    tiny = build_tiny("qwen2")  # biases on q, k and v: a dropped bias changes the function
    torch_report = check_decoder(
        tiny.module, tiny.batches, tiny.references, tiny.embed_table, tiny.thresholds
    )
    assert torch_report.passed  # the torch level cannot see what coremltools does later
    return tiny


@pytest.mark.parametrize("planted", [None, *PASSES])
def test_a_conversion_bug_below_torch_is_caught_by_the_mil_gate(
    planted: str | None, qwen2: Tiny, tmp_path: Path
) -> None:
    tiny = qwen2

    package = convert_with(tiny.module, planted, tmp_path)
    report = tiny.check_program(package, ("fp32", "fp16"))
    gates = {(g.name, g.implementation): g for g in report.gates}
    per_layer = gates[("mil_fp32_layer_rel_error", "mil-fp32")]
    if planted is None:
        assert report.passed, [g for g in report.gates if not g.passed]
    else:
        assert not per_layer.passed, f"{planted}: MIL fp32 error only {per_layer.value:.3g}"
        # The first layer's output already differs: the bug is found where it is.
        fp32 = next(r for r in report.runs if r.implementation == "mil-fp32")
        assert fp32.layer_rel_error[0] > tiny.thresholds.mil_fp32_layer_rel_error
        print(f"{planted}: MIL fp32 layer errors {[f'{e:.2g}' for e in fp32.layer_rel_error]}")


def test_a_missing_layer_marker_is_a_failed_gate_naming_it(tmp_path: Path) -> None:
    tiny = build_tiny("llama")
    package = convert_with(tiny.module, None, tmp_path, mark=False)
    with pytest.raises(MarkerError, match="layer_0_out"):
        find_markers(load_package(package).functions["main"], len(tiny.module.layers))
    report = tiny.check_program(package, ("fp32",))
    gate = next(g for g in report.gates if g.name == "layer_markers_present")
    assert not gate.passed and "layer_0_out" in gate.detail
    assert not report.passed


def test_a_program_the_evaluator_cannot_prepare_is_a_failed_gate_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder's program with an op the evaluator has no kernel for fails the markers gate,
    as an encoder's does, instead of ending the conversion with a traceback."""
    tiny = build_tiny("llama")
    package = convert_with(tiny.module, None, tmp_path)

    def unsupported(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOpError("cumsum", "my_cumsum")

    monkeypatch.setattr(conversion, "Evaluator", unsupported)
    report = tiny.check_program(package)
    assert [(g.name, g.passed) for g in report.gates] == [("layer_markers_present", False)]
    assert "cumsum" in report.gates[0].detail and report.runs == []
    assert report.implementations["mil-fp32"].startswith("failed: ")
    assert "not run: no kernel for MIL op type 'cumsum'" in conversion_to_text(report)


def test_markers_survive_conversion_in_fp16_and_fp32(tmp_path: Path) -> None:
    from converter.coreml.program import to_mlprogram

    tiny = build_tiny("llama")
    inputs, outputs = tensor_contract(tiny.module, "float16")
    traced = trace(tiny.module, inputs)
    assert mark_layer_outputs(traced, 3) == ["layer_0_out", "layer_1_out", "layer_2_out"]
    for precision, suffix in (("float16", "_cast_fp16"), ("float32", "")):
        mlmodel = to_mlprogram(traced, inputs, outputs, TARGETS["macOS14"].ct_target(), precision)
        function = mlmodel._mil_program.functions["main"]
        assert find_markers(function, 3) == [f"layer_{i}_out{suffix}" for i in range(3)]


def test_marking_refuses_a_trace_with_the_wrong_number_of_layers() -> None:
    tiny = build_tiny("llama")
    traced = trace(tiny.module, tensor_contract(tiny.module, "float16")[0])
    with pytest.raises(MarkerError, match="expected layers"):
        mark_layer_outputs(traced, 4)


def test_the_core_ml_level_compares_as_the_mil_fp16_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Core ML level (macOS only) goes through the same comparison as the evaluator's
    profiles. Here Core ML is stood in by the evaluator's fp16 profile: the level must then
    report exactly the mil-fp16 level's logit error and position rows."""
    import coremltools as ct

    import parity.conversion
    from parity.mil import Evaluator

    tiny = build_tiny("llama")
    package = convert_with(tiny.module, None, tmp_path)
    program = load_package(package)  # before the stand-in: loading reads the spec via MLModel

    class EvaluatorAsCoreML:
        def __init__(self, path: str, compute_units: Any = None) -> None:
            assert path == str(package) and compute_units == ct.ComputeUnit.CPU_AND_NE
            self.evaluator = Evaluator(program, "fp16")

        def predict(self, feed: dict[str, Any]) -> dict[str, Any]:
            return self.evaluator.run(feed).outputs

    monkeypatch.setattr(parity.conversion, "availability", lambda: (True, "a stand-in"))
    monkeypatch.setattr(ct.models, "MLModel", EvaluatorAsCoreML)
    monkeypatch.setattr(parity.conversion, "load_package", lambda path: program)
    report = tiny.check_program(package, ("fp16",))
    fp16 = next(r for r in report.runs if r.implementation == "mil-fp16")
    assert report.runtime is not None and report.runtime.positions
    assert report.runtime.logits_rel_error == fp16.logits_rel_error > 0
    assert report.runtime.positions == fp16.positions
    assert report.runtime.finite and report.runtime.layer_rel_error == []
