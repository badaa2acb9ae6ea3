"""Coverage of the MIL evaluator, defined by what anec emits.

Every program in ``mil_programs.PROGRAMS`` (architectures, recipe options, compression
variants) is built from a tiny perturbed checkpoint; every op and every semantic attribute
value in it must have a kernel. The uncompressed programs must also match the BC1L module per
layer in the ``fp32`` profile and pass the fp16 gates; the compressed ones must decode every
weight exactly as coremltools does.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from mil_programs import PROGRAMS, Programs

from parity.conversion import check_conversion
from parity.mil import KERNELS, Evaluator, load_package, signature, unsupported, walk_ops
from parity.mil.program import CONST_OP_PREFIX

# The op types the issue names explicitly, whether or not today's programs hold them.
REQUIRED = {
    "conv", "matmul", "einsum", "linear", "softmax", "layer_norm", "reduce_sum", "reduce_mean",
    "reduce_max", "reduce_min", "reduce_prod", "reduce_sum_square", "reduce_l2_norm", "add",
    "sub", "mul", "real_div", "pow", "sqrt", "rsqrt", "exp", "log", "erf", "gelu", "silu",
    "tanh", "sigmoid", "relu", "reshape", "transpose", "concat", "split", "slice_by_index",
    "slice_by_size", "squeeze", "expand_dims", "tile", "pad", "gather", "cast", "select",
    "quantize", "dequantize", "constexpr_lut_to_dense", "constexpr_affine_dequantize",
    "constexpr_blockwise_shift_scale", "read_state", "coreml_update_state", "slice_update",
    "reduce_argmax", "topk",
}  # fmt: skip
COMPRESSION = ("lut", "int8", "w8a8")
ENCODERS = [name for name in PROGRAMS if "bert" in name]
COMPRESSED = [name for name in PROGRAMS if any(k in name for k in COMPRESSION)]
CACHED = [name for name in PROGRAMS if "-kv-" in name]
DECODERS = [name for name in PROGRAMS if name not in ENCODERS + COMPRESSED + CACHED]


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Programs:
    return Programs(Path(tmp_path_factory.mktemp("mil_programs")))


def test_the_ops_the_issue_names_have_kernels() -> None:
    assert REQUIRED - set(KERNELS) == set()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_op_and_attribute_value_in_the_program_has_a_kernel(
    programs: Programs, name: str
) -> None:
    missing = []
    for _, op in walk_ops(load_package(programs[name].package)):
        reason = None if op.op_type == "const" else unsupported(op)
        if reason is not None:
            missing.append(f"{signature(op)} (op {op.name!r}): {reason}")
    assert not missing, "\n".join(missing)
    kinds = {**dict.fromkeys(ENCODERS, "encoder"), **dict.fromkeys(COMPRESSED, "compressed")}
    assert programs[name].kind == {**kinds, **dict.fromkeys(CACHED, "kv")}.get(name, "decoder")


def test_the_programs_exercise_every_form_anec_emits(programs: Programs) -> None:
    seen: dict[str, set[str]] = defaultdict(set)
    for name in PROGRAMS:
        for _, op in walk_ops(load_package(programs[name].package)):
            if op.op_type != "const":
                seen[signature(op)].add(name)
    print("\n".join(f"{s}  <- {len(seen[s])} program(s)" for s in sorted(seen)))
    forms = set(seen)
    assert "softmax(axis=1)" in forms  # the key axis of BC1L scores
    assert {"cast(dtype=fp16, x.dtype=fp32)", "gather(axis=0, batch_dims=0)"} <= forms
    lut = {s for s in forms if s.startswith("constexpr_lut_to_dense")}
    assert any("shape=yes" in s for s in lut) and any("shape=-" in s for s in lut)
    types = {s.split("(")[0] for s in forms}
    assert {"constexpr_affine_dequantize", "constexpr_blockwise_shift_scale"} <= types
    assert {"quantize", "dequantize"} <= types  # w8a8 activations
    assert {"read_state", "coreml_update_state"} <= types  # a cached decoder's state
    assert {"reduce_argmax", "topk"} <= types  # io.output argmax / topk


@pytest.mark.parametrize("name", DECODERS)
def test_program_matches_the_bc1l_module_per_layer_and_passes_fp16_gates(
    programs: Programs, name: str
) -> None:
    built = programs[name]
    assert built.tiny is not None and built.module is not None
    tiny = built.tiny
    report = check_conversion(
        built.package,
        built.module,
        tiny.batches,
        tiny.references,
        tiny.embed_table,
        tiny.thresholds,
        built.precision,
        profiles=("fp32", "fp16"),
    )
    assert report.passed, [g for g in report.gates if not g.passed]
    assert len(report.markers) == len(built.module.layers)


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_weights_decode_as_coremltools_decodes_them(
    programs: Programs, name: str
) -> None:
    program = load_package(programs[name].package)
    evaluator = Evaluator(program, "fp16")
    ops = [op for _, op in walk_ops(program) if op.op_type.startswith(CONST_OP_PREFIX)]
    assert ops
    for op in ops:
        theirs = np.asarray(op.materialized_val_inference(), dtype=np.float32)
        ours = evaluator.constant(op.outputs[0].name)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{op.op_type} {op.name}")
    base = programs[name].base
    assert base is not None and base.tiny is not None
    batch = base.tiny.batches[0]
    result = evaluator.run(
        {
            "input_ids": batch.input_ids.numpy().astype(np.int32),
            "key_mask": np.where(batch.attention_mask.numpy() > 0, 0.0, -1e4),
        }
    )
    assert all(np.isfinite(v).all() for v in result.outputs.values())


@pytest.mark.parametrize("name", CACHED)
def test_every_function_of_a_cached_package_runs_and_passes_the_cache_gates(
    programs: Programs, name: str
) -> None:
    from parity.kv_gates import check_kv
    from parity.kv_session import MilFunctions, session_for
    from parity.reference import continuation

    built = programs[name]
    assert built.tiny is not None and built.functions is not None
    program = load_package(built.package)
    assert sorted(program.functions) == ["decode", "extend", "prefill"]
    first = built.functions["decode"]
    mil = MilFunctions(program, "fp16", list(built.functions), first.cache_shape())
    table = built.tiny.embed_table.numpy()

    def make_session():  # type: ignore[no-untyped-def]
        runner, states = mil.session()
        return session_for(built.functions, runner, states, lambda ids: table[ids])

    fixture = built.tiny.fixtures[0]
    result = check_kv(make_session, [continuation(built.tiny.model, fixture, 16)], "prefill", 4,
                      "mil-fp16", 0.03)  # fmt: skip
    assert result.passed, [g.text() for g in result.gates if not g.passed]
