"""The model copies a variant's parity step makes: cast without a full-precision copy first,
and fp64 one piece at a time (the fp32 program check's reference)."""

from __future__ import annotations

import copy

import torch
from tiny_models import build_tiny

from parity.decoder_gates import module_inputs, run_module
from parity.model_copies import cast_copy, in_float64, with_weights


def test_cast_copy_matches_a_cast_of_a_deep_copy_and_shares_nothing() -> None:
    module = build_tiny("qwen2", "embeddings").module
    ours = cast_copy(module, torch.float16)
    theirs = copy.deepcopy(module).to(torch.float16)
    for (name, a), (_, b) in zip(
        [*ours.named_parameters(), *ours.named_buffers()],
        [*theirs.named_parameters(), *theirs.named_buffers()],
        strict=True,
    ):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    for a, b in zip(ours.parameters(), module.parameters(), strict=True):
        assert a.data_ptr() != b.data_ptr()
        assert isinstance(a, torch.nn.Parameter)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # the source untouched
    assert not ours.training


def test_with_weights_sets_the_named_weights_in_the_copy_only() -> None:
    module = build_tiny("llama", "embeddings").module
    name = "layers.0.mlp.down.weight"
    value = torch.full_like(module.get_parameter(name), 0.5).numpy()
    before = module.get_parameter(name).clone()
    twin = with_weights(module, {name: value.astype("float16")}, torch.float16)
    assert twin.get_parameter(name).dtype == torch.float16
    assert torch.all(twin.get_parameter(name) == 0.5)
    assert torch.equal(module.get_parameter(name), before)


def test_in_float64_runs_like_a_whole_fp64_copy_and_leaves_fp32() -> None:
    tiny = build_tiny("qwen3", "embeddings")
    module = tiny.module
    x, mask = module_inputs(module, tiny.batches[0], tiny.embed_table, torch.float32)
    _, want = run_module(copy.deepcopy(module).double(), x.double(), mask.double())
    seen: list[torch.dtype] = []
    hook = module.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with in_float64(module):
        _, got = run_module(module, x.double(), mask.double())
    hook.remove()
    assert seen == [torch.float64]
    assert got.dtype == torch.float64
    assert torch.equal(got, want)
    assert all(
        t.dtype == torch.float32
        for t in [*module.parameters(), *module.buffers()]
        if t.is_floating_point()
    )
    assert not module.layers[0]._forward_pre_hooks  # no hook left behind


def test_float64_program_copy_runs_like_set_weights_on_program_constants() -> None:
    import numpy as np

    from parity.model_copies import float64_program_copy, program_constants, set_weights

    tiny = build_tiny("qwen2", "embeddings")
    module = tiny.module
    before = {n: t.clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    rng = np.random.default_rng(0)
    down, up = "layers.0.mlp.down.weight", "layers.1.mlp.gate_up.weight"
    weights = {  # an int8-like fp32 decoding and a palette's exact fp16 values
        down: rng.standard_normal(tuple(module.get_parameter(down).shape)).astype(np.float32),
        up: rng.standard_normal(tuple(module.get_parameter(up).shape)).astype(np.float16),
    }
    x, mask = module_inputs(module, tiny.batches[0], tiny.embed_table, torch.float32)
    x, mask = x.half().double(), mask.half().double()
    whole = set_weights(program_constants(module), weights)
    with in_float64(whole):
        _, want = run_module(whole, x, mask)
    for others_in_fp16 in (True, False):
        ours = float64_program_copy(module, dict(weights), others_in_fp16)
        assert ours.get_parameter(up).dtype == torch.float16  # shared, not widened
        assert ours.get_parameter(down).data_ptr() == weights[down].ctypes.data
        dtypes = {n: t.dtype for n, t in [*ours.named_parameters(), *ours.named_buffers()]}
        with in_float64(ours):
            _, got = run_module(ours, x, mask)
        assert torch.equal(got, want)
        assert dtypes == {n: t.dtype for n, t in [*ours.named_parameters(), *ours.named_buffers()]}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert torch.equal(tensor, before[name]), name  # the source untouched
