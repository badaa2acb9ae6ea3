"""The cached functions get the window program's per-layer MIL fp32 gate: prefill, decode and
extend of an emitted package, each call against the cached module in fp64 (`parity.kv_mil`).
A bug coremltools could make in one function (a norm epsilon x 100 in decode only) fails the
gate at that function's first layer, while the torch module (and so every torch-level gate)
is untouched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_models import Tiny, build_tiny, one_torch_thread

from converter.coreml.program import SPEC_FILE, canonicalize_spec
from converter.coreml.targets import TARGETS
from converter.tasks.kv_contract import function_calls
from converter.tasks.kv_convert import convert_singles
from converter.tasks.kv_parity import cached_fp32_check
from converter.tasks.text_generation_kv import WEIGHTS, combine_measured
from graph_passes.cached_decoder import CachedDecoder, cached_functions
from parity.gate_registry import GateResult
from parity.mil import load_package
from parity.mil.program import loads_sharing_equal_constants, walk_ops
from parity.mil_level import MilSubject, run_mil_level
from parity.reference import Continuation, continuation

THRESHOLD = 1e-5


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Tiny, dict[str, CachedDecoder], Path, list[Continuation], dict[str, Path]]:
    """A tiny Llama's state-style package (fp16), two fixtures' continuations and the
    single-function packages it was combined from (``emit_functions`` without the cleanup)."""
    tiny = build_tiny("llama", batch=1)
    functions = cached_functions(tiny.module, "state", 64, function_calls(8, 4))
    folder = tmp_path_factory.mktemp("kvmil")
    target = TARGETS["macOS15"].ct_target()
    singles, _ = convert_singles(functions, "float16", "float16", target, folder / "singles")
    package = folder / "tiny.mlpackage"
    combine_measured(singles, package)
    conts = [continuation(tiny.model, f, 12) for f in tiny.fixtures[:2]]
    return tiny, functions, package, conts, singles


@pytest.fixture(scope="module")
def emitted(
    built: tuple[Tiny, dict[str, CachedDecoder], Path, list[Continuation], dict[str, Path]],
) -> tuple[Tiny, dict[str, CachedDecoder], Path, list[Continuation]]:
    return built[:4]


def test_combining_holds_each_weight_once_and_saves_coremltools_bytes(
    built: Any, tmp_path: Path
) -> None:
    """Combining loads the single-function packages with equal weights as one array (three
    copies of every weight before), and saves the bytes coremltools' own combining saves."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    package, singles = built[2], built[4]
    theirs = tmp_path / "theirs.mlpackage"
    descriptor = ct.utils.MultiFunctionDescriptor()
    for name, path in singles.items():
        descriptor.add_function(str(path), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = "decode"
    ct.utils.save_multifunction(descriptor, str(theirs))
    canonicalize_spec(theirs)
    for part in (SPEC_FILE, WEIGHTS):
        assert (package / part).read_bytes() == (theirs / part).read_bytes(), part

    def loaded(path: Path) -> dict[str, np.ndarray]:
        spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
        program = load(spec, spec.specificationVersion, str(path / WEIGHTS.parent))
        return {op.name: op.outputs[0].val for _, op in walk_ops(program) if op.op_type == "const"}

    apart = [loaded(p) for p in singles.values()]
    with loads_sharing_equal_constants():
        together = [loaded(p) for p in singles.values()]
    big = [n for n, v in together[0].items() if getattr(v, "size", 0) > 1000]
    assert len(big) > 10 and all(n in t for t in together for n in big)
    assert all(t[n] is together[0][n] for t in together for n in big)
    assert not any(a[n] is apart[0][n] for a in apart[1:] for n in big)
    for a, t in zip(apart, together, strict=True):
        for n in big:
            np.testing.assert_array_equal(t[n], a[n])


def test_the_functions_of_a_package_hold_each_weight_once(emitted: Any) -> None:
    """Prefill, decode and extend name the same weight blobs: loaded, each blob is one array
    (coremltools' own loader made one per function), with coremltools' values."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    package = emitted[2]
    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    weights = package / "Data" / "com.apple.CoreML" / "weights"
    theirs = load(spec, spec.specificationVersion, file_weights_dir=str(weights))

    def weights_of(program: Any) -> dict[tuple[str, str], np.ndarray]:
        return {
            (name, op.name): op.outputs[0].val
            for name, op in walk_ops(program)
            if op.op_type == "const" and getattr(op.outputs[0].val, "size", 0) > 1000
        }

    ours, expected = weights_of(load_package(package)), weights_of(theirs)
    assert ours.keys() == expected.keys() and len(ours) > 30
    for key, value in ours.items():
        np.testing.assert_array_equal(value, expected[key])
    by_name: dict[str, list[np.ndarray]] = {}
    for (_, op_name), value in ours.items():
        by_name.setdefault(op_name, []).append(value)
    shared = [values for values in by_name.values() if len(values) == 3]
    assert len(shared) > 10
    assert all(v is values[0] for values in shared for v in values)


def check(
    emitted: tuple[Tiny, dict[str, CachedDecoder], Path, list[Continuation]],
    mutate: Callable[[Any], None] = lambda program: None,
    weights: dict[str, np.ndarray] | None = None,
) -> dict[str, GateResult]:
    tiny, functions, package, conts = emitted
    program = load_package(package)
    mutate(program)
    table = tiny.embed_table.numpy()
    run = cached_fp32_check([program], [functions], conts, table, "float16", weights=weights)
    level = run_mil_level(MilSubject(lambda progress: run, list, THRESHOLD))
    return {g.name: g for g in level.gates}


def test_every_call_of_every_function_matches_the_module_per_layer(emitted: Any) -> None:
    gates = check(emitted)
    assert gates["layer_markers_present"].passed
    per_layer = gates["mil_fp32_layer_rel_error"]
    assert per_layer.passed and per_layer.value < THRESHOLD, per_layer.text()
    # each fixture's prompt prefilled, then one decode and one extend call each
    assert "decode 2, extend 2" in per_layer.detail, per_layer.detail


def scale_epsilon_in(function_name: str) -> Callable[[Any], None]:
    """The RMSNorm epsilon (added to the mean square before rsqrt) x 100, in one function."""

    def mutate(program: Any) -> None:
        from coremltools.converters.mil import Builder as mb

        function = program.functions[function_name]
        for op in [op for op in function.operations if op.op_type == "rsqrt"]:
            add = op.x.op
            block = add.enclosing_block
            with block:
                new = mb.add(x=add.x, y=add.y.val * 100, before_op=add)
            block.replace_uses_of_var_after_op(
                anchor_op=add, old_var=add.outputs[0], new_var=new, force_replace=True
            )
            block.remove_ops([add])

    return mutate


@pytest.mark.parametrize("function", ["decode", "extend"])
def test_a_bug_in_one_function_fails_the_gate_at_its_first_layer(
    emitted: Any, function: str
) -> None:
    per_layer = check(emitted, scale_epsilon_in(function))["mil_fp32_layer_rel_error"]
    assert not per_layer.passed, per_layer.text()
    assert f"{function} call" in per_layer.where and "layer 0" in per_layer.where, per_layer.where


def test_a_variant_s_decoded_weights_are_what_the_module_is_given(emitted: Any) -> None:
    """A compressed variant's functions are compared with the module holding its decoded
    weights: given a weight the program does not hold (layer 1's down projection, 1 % off),
    the gate fails; given the program's own values, it passes."""
    tiny, functions, _, _ = emitted
    name = "layers.1.mlp.down.weight"
    held = tiny.module.get_parameter(name).detach().half()
    same = check(emitted, weights={name: held.numpy()})["mil_fp32_layer_rel_error"]
    assert same.passed, same.text()
    off = check(emitted, weights={name: (held * 1.01).numpy()})["mil_fp32_layer_rel_error"]
    assert not off.passed and "layer 0" not in off.where, off.text()
