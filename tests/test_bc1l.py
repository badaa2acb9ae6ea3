"""The BC1L decoder computes the checkpoint's function (SPEC section 2), on tiny perturbed models.

The reference here is transformers itself, read through forward hooks written in this file (not
through `parity.reference`), on each sequence *unpadded* at positions 0..n-1; the BC1L module
runs the same tokens left-padded in a window of 16.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiny_models import (
    LENGTH,
    PAD_ID,
    VOCAB,
    Tiny,
    build_module,
    build_tiny,
    one_torch_thread,
    random_sequences,
    tiny_hf_model,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from converter.tasks.text_generation import choose_scales
from graph_passes.archs import adapt
from graph_passes.decoder import BC1LDecoder, chunk_sizes
from graph_passes.masks import MASKED, causal_mask, key_mask_from_padding
from graph_passes.norms import RMSNorm
from graph_passes.prescale import choose_prescale
from graph_passes.rope import Rope
from graph_passes.spec import CanonicalModel
from parity.decoder_gates import check_decoder, module_inputs
from parity.fixtures import Batch, build_fixtures, make_batches
from parity.reference import run_reference
from parity.thresholds import Thresholds

TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


def rel(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    c, r = candidate.double(), reference.double()
    return float((c - r).norm() / r.norm())


def hf_run(model: torch.nn.Module, ids: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer outputs (n, D) and logits (n, V) of transformers on the unpadded sequence."""
    states: list[torch.Tensor] = []

    def hook(_: torch.nn.Module, __: object, out: object) -> None:
        h = out[0] if isinstance(out, tuple) else out
        states.append(h[0].detach().clone())  # type: ignore[index]

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        for h in handles:
            h.remove()
    assert len(states) == len(model.model.layers)
    return states, logits


_CACHE: dict[tuple[object, ...], Tiny] = {}


def tiny(arch: str, inputs: str = "token-ids", **overrides: object) -> Tiny:
    key = (arch, inputs, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        _CACHE[key] = build_tiny(arch, inputs, **overrides)  # type: ignore[arg-type]
    return _CACHE[key]


def assert_matches_transformers(t: Tiny, module: BC1LDecoder | None = None) -> float:
    """Every layer's state at every real position within TOLERANCE; returns the worst error."""
    module = module or t.module
    worst = 0.0
    for batch in t.batches:
        x, key_mask = module_inputs(module, batch, t.embed_table, torch.float32)
        with torch.no_grad():
            states = module.run_layers(x, key_mask)
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            ref_states, _ = hf_run(t.model, fixture.token_ids)
            for i, (state, ref) in enumerate(zip(states, ref_states, strict=True)):
                err = rel(state[r, :, 0, LENGTH - n :].T, ref)
                assert err <= TOLERANCE, f"{fixture.name} layer {i}: {err:.2e}"
                worst = max(worst, err)
    return worst


ARCH_INPUTS = [(a, i) for a in ("llama", "qwen2") for i in ("token-ids", "embeddings")]


@pytest.mark.parametrize(("arch", "inputs"), ARCH_INPUTS)
def test_layer_states_match_transformers_with_left_padding(arch: str, inputs: str) -> None:
    t = tiny(arch, inputs)
    lengths = {len(f.token_ids) for f in t.fixtures}
    assert min(lengths) < LENGTH and LENGTH in lengths  # padded and full windows both covered
    assert_matches_transformers(t)


@pytest.mark.parametrize(("arch", "inputs"), ARCH_INPUTS)
def test_last_position_logits_match_in_chunks(arch: str, inputs: str) -> None:
    t = tiny(arch, inputs)
    module = t.module
    assert module.io.logit_positions == 1
    assert module.chunk_sizes == [128, 128, 44]
    for batch in t.batches:
        x, key_mask = module_inputs(module, batch, t.embed_table, torch.float32)
        with torch.no_grad():
            chunks = module(x, key_mask)
        # The vocabulary on the last axis (manifest schema 3).
        assert [tuple(c.shape) for c in chunks] == [(3, 1, 1, 128), (3, 1, 1, 128), (3, 1, 1, 44)]
        logits = torch.cat(chunks, dim=3)[:, 0, 0, :]
        for r, fixture in enumerate(batch.fixtures):
            _, ref_logits = hf_run(t.model, fixture.token_ids)
            err = rel(logits[r], ref_logits[-1])
            assert err <= TOLERANCE, f"{fixture.name}: {err:.2e}"
            assert logits[r].argmax() == ref_logits[-1].argmax()


def test_lm_head_chunks_concatenate_to_the_unchunked_logits() -> None:
    t = tiny("qwen2")  # untied head: the chunks split lm_head.weight
    assert not t.canonical.spec.tied_embeddings
    batch = t.batches[0]
    x, key_mask = module_inputs(t.module, batch, t.embed_table, torch.float32)
    outputs = {}
    for chunk in (128, 100, 300, 1024):
        module = t.rebuild(lm_head_chunk=chunk, logit_positions=LENGTH)
        assert sum(module.chunk_sizes) == VOCAB
        with torch.no_grad():
            outputs[chunk] = torch.cat(module(x, key_mask), dim=3)
    assert outputs[128].shape == (3, LENGTH, 1, VOCAB)
    for chunk in (100, 300, 1024):
        torch.testing.assert_close(outputs[chunk], outputs[128], rtol=1e-6, atol=1e-6)


def test_chunk_sizes() -> None:
    assert chunk_sizes(300, 128) == [128, 128, 44]
    assert chunk_sizes(300, 100) == [100, 100, 100]
    assert chunk_sizes(300, 16384) == [300]
    assert chunk_sizes(151936, 16384) == [16384] * 9 + [4480]


def test_logit_positions_slice_the_last_window_positions() -> None:
    t = tiny("llama")
    batch = t.batches[0]
    x, key_mask = module_inputs(t.module, batch, t.embed_table, torch.float32)
    every = t.rebuild(logit_positions=LENGTH)
    last4 = t.rebuild(logit_positions=4)
    with torch.no_grad():
        all_logits = torch.cat(every(x, key_mask), dim=3)
        tail = torch.cat(last4(x, key_mask), dim=3)
    torch.testing.assert_close(tail, all_logits[:, LENGTH - 4 :], rtol=1e-6, atol=1e-6)


# ---- GQA ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_gqa_variants_match_transformers(arch: str, kv_heads: int) -> None:
    # kv == heads (plain multi-head) and kv == 1 (multi-query); kv == 2 is covered above.
    t = tiny(arch, num_key_value_heads=kv_heads)
    assert t.canonical.spec.layers[0].attention.group_size == 4 // kv_heads
    assert_matches_transformers(t)


def test_query_head_reads_kv_head_h_over_group() -> None:
    """Swap the two kv heads in the weights: the match breaks, so the mapping is really tested."""
    t = tiny("qwen2")  # 4 query heads, 2 kv heads, q/k/v biases
    d = 16
    weights = dict(t.canonical.weights)
    for name in ("k", "v"):
        for kind in ("weight", "bias"):
            key = f"layers.0.attn.{name}.{kind}"
            w = weights[key]
            weights[key] = torch.cat([w[d:], w[:d]])
    swapped = t.rebuild(CanonicalModel(t.canonical.spec, weights))
    with pytest.raises(AssertionError, match="layer 0"):
        assert_matches_transformers(t, swapped)

    # Independent per-head computation of layer 0's attention: head h uses kv head h // 2.
    batch = t.batches[0]
    fixture = batch.fixtures[0]
    n = len(fixture.token_ids)
    layer = t.module.layers[0]
    x, key_mask = module_inputs(t.module, batch, t.embed_table, torch.float32)
    with torch.no_grad():
        h = t.module.embed_bc1l(x)
        normed = layer.input_norm(h)
        mask = t.module.causal + key_mask.reshape(-1, LENGTH, 1, 1)
        got = layer.attention(normed, mask)[0, :, 0, LENGTH - n :].T  # (n, D) after o-proj

        cw = t.canonical.weights
        hx = normed[0, :, 0, LENGTH - n :].T  # (n, D)
        q = hx @ cw["layers.0.attn.q.weight"].T + cw["layers.0.attn.q.bias"]
        k = hx @ cw["layers.0.attn.k.weight"].T + cw["layers.0.attn.k.bias"]
        v = hx @ cw["layers.0.attn.v.weight"].T + cw["layers.0.attn.v.bias"]
        pos = torch.arange(n)
        outs = []
        for head in range(4):
            kv = head // 2
            qh = reference_rope(q[:, head * d : (head + 1) * d], 10000.0, pos)
            kh = reference_rope(k[:, kv * d : (kv + 1) * d], 10000.0, pos)
            scores = qh @ kh.T / d**0.5
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            outs.append(scores.softmax(-1) @ v[:, kv * d : (kv + 1) * d])
        want = torch.cat(outs, dim=-1) @ cw["layers.0.attn.o.weight"].T
    assert rel(got, want) <= TOLERANCE


# ---- RoPE -----------------------------------------------------------------------------------


def reference_rope(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """``x`` (..., L, d) rotated as transformers does it: ``x cos + rotate_half(x) sin``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.double() * emb.cos() + rotated.double() * emb.sin()).to(x.dtype)


@pytest.mark.parametrize(("heads", "d", "theta"), [(3, 8, 10000.0), (6, 16, 1e6), (1, 4, 500.0)])
def test_rope_is_split_half_per_head(heads: int, d: int, theta: float) -> None:
    torch.manual_seed(1)
    length = 12
    positions = torch.arange(length)
    x = torch.randn(2, heads, length, d)  # (B, n, L, d) as transformers holds q and k
    want = reference_rope(x, theta, positions)
    bc1l = x.permute(0, 1, 3, 2).reshape(2, heads * d, 1, length)  # (B, n*d, 1, L)
    got = Rope(d, theta, positions)(bc1l, heads)
    got = got.reshape(2, heads, d, length).permute(0, 1, 3, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The same against transformers' own apply_rotary_pos_emb with the reference tables.
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([positions.double()[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().float()[None], emb.sin().float()[None]
    hf_q, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(got, hf_q, rtol=1e-5, atol=1e-5)
    # Not a no-op: the rotation really moves channels between the halves of each head.
    assert (got - x).abs().max() > 0.1


def test_rope_shifted_positions_keep_relative_scores() -> None:
    # Left padding shifts positions; q.k of rotated vectors depends only on the difference.
    torch.manual_seed(2)
    d, length, shift = 16, 6, 5
    q, k = torch.randn(1, d, 1, length), torch.randn(1, d, 1, length)
    a = Rope(d, 10000.0, torch.arange(length))
    b = Rope(d, 10000.0, torch.arange(length) + shift)
    scores_a = torch.einsum("bcl,bcm->blm", a(q, 1)[:, :, 0], a(k, 1)[:, :, 0])
    scores_b = torch.einsum("bcl,bcm->blm", b(q, 1)[:, :, 0], b(k, 1)[:, :, 0])
    torch.testing.assert_close(scores_a, scores_b, rtol=1e-5, atol=1e-5)


# ---- RMSNorm and its prescale ---------------------------------------------------------------


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    y = x64 / torch.sqrt(x64.pow(2).mean(dim=1, keepdim=True) + eps)
    return (y * weight.double().reshape(1, -1, 1, 1)).float()


def large_input(channels: int = 64, positions: int = 5) -> torch.Tensor:
    """Ordinary values plus an attention-sink position: a few channels at |x| = 30000."""
    torch.manual_seed(3)
    x = torch.randn(1, channels, 1, positions) * 3.0
    x[0, :3, 0, 0] = torch.tensor([30000.0, -30000.0, 24000.0])
    x[0, :, 0, 1] *= 500.0  # a position of large, dense values: |x| up to ~5000
    return x


def test_rmsnorm_matches_the_definition() -> None:
    torch.manual_seed(4)
    w = 1.0 + 0.2 * torch.randn(64)
    x = torch.randn(2, 64, 1, 7) * 4.0
    torch.testing.assert_close(RMSNorm(w, 1e-5)(x), rms_reference(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    # eps matters at small inputs: a different eps is visibly different there.
    tiny_x = x * 1e-3
    assert rel(RMSNorm(w, 1e-5)(tiny_x), RMSNorm(w, 1e-3)(tiny_x)) > 1e-2


@pytest.mark.parametrize("k", [-2, 1, 4, 9, 12, 20])
def test_power_of_two_prescale_is_exact_in_fp32(k: int) -> None:
    torch.manual_seed(5)
    w = 1.0 + 0.2 * torch.randn(64)
    x = large_input()
    plain = RMSNorm(w, 1e-5)
    scaled = RMSNorm(w, 1e-5)
    scaled.set_prescale(2.0**k)
    torch.testing.assert_close(scaled(x), plain(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(plain(x), rms_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [3.0, 1.5, 0.0, -2.0, -0.5, 1000.0])
def test_prescale_must_be_a_positive_power_of_two(scale: float) -> None:
    norm = RMSNorm(torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="power of two"):
        norm.set_prescale(scale)


def test_choose_prescale() -> None:
    assert choose_prescale(0.0) == 1.0
    assert choose_prescale(64.0) == 1.0
    assert choose_prescale(64.5) == 2.0
    assert choose_prescale(30000.0) == 512.0  # 30000 / 512 = 58.6 <= 64
    # a dense position: L2 norm 12 * sqrt(576) = 288 -> 8 (288 / 8 = 36 <= 64)
    assert choose_prescale(288.0) == 8.0


def test_prescale_keeps_fp16_norm_of_large_inputs_finite_and_correct() -> None:
    torch.manual_seed(6)
    w = 1.0 + 0.2 * torch.randn(64)
    x = large_input()
    want = rms_reference(x, w, 1e-5)

    naive = RMSNorm(w, 1e-5).half()
    with torch.no_grad():
        y_naive = naive(x.half()).float()
    # x^2 = 9e8 overflows fp16: the sum of squares is inf, rsqrt(inf) = 0, and the sink
    # position collapses. torch gives 0 there (finite but wrong), not inf/NaN.
    assert not torch.isfinite((x.half() * x.half()).sum(dim=1)).all()
    bad = y_naive[..., 0]
    assert not torch.isfinite(bad).all() or rel(bad, want[..., 0]) > 0.5

    fixed = RMSNorm(w, 1e-5)
    fixed.set_prescale(choose_prescale(float(x.norm(dim=1).max())))
    fixed = fixed.half()
    with torch.no_grad():
        y = fixed(x.half()).float()
    assert torch.isfinite(y).all()
    assert rel(y, want) < 1e-2
    for position in range(x.shape[-1]):
        assert rel(y[..., position], want[..., position]) < 1e-2, position


def test_prescale_keeps_fp16_norm_of_dense_inputs_correct() -> None:
    # SmolLM2-sized hidden width; rms ~12, max ~45: ordinary residual-stream magnitudes.
    torch.manual_seed(7)
    channels = 576
    w = 1.0 + 0.2 * torch.randn(channels)
    x = (torch.randn(1, channels, 1, 4) * 12.0).clamp(-60.0, 60.0)
    norm = RMSNorm(w, 1e-5)
    # The prescale is chosen from the per-position L2 norm, the quantity whose square is stored.
    norm.set_prescale(choose_prescale(float(x.norm(dim=1).max())))
    with torch.no_grad():
        y = norm.half()(x.half()).float()
    assert rel(y, rms_reference(x, w, 1e-5)) < 1e-2


def test_norms_lists_every_norm_in_order() -> None:
    t = tiny("llama")
    names = [name for name, _ in t.module.norms()]
    assert names == [
        "layers.0.attn_norm",
        "layers.0.mlp_norm",
        "layers.1.attn_norm",
        "layers.1.mlp_norm",
        "layers.2.attn_norm",
        "layers.2.mlp_norm",
        "final_norm",
    ]


# ---- masks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "inputs"), ARCH_INPUTS)
def test_fp16_padded_rows_stay_finite(arch: str, inputs: str) -> None:
    t = tiny(arch, inputs)
    half = t.rebuild().half()
    padded = [b for b in t.batches if (b.attention_mask == 0).any()]
    assert padded
    for batch in padded:
        x, key_mask = module_inputs(half, batch, t.embed_table, torch.float16)
        with torch.no_grad():
            states = half.run_layers(x, key_mask)
            logits = half.head(states[-1])
        for i, s in enumerate(states):
            assert torch.isfinite(s).all(), f"layer {i}"
        assert all(torch.isfinite(c).all() for c in logits)


def test_fp16_mask_sum_does_not_overflow() -> None:
    causal = causal_mask(LENGTH).half()
    key = key_mask_from_padding(torch.tensor([[0] * 10 + [1] * 6])).half()
    combined = causal + key.reshape(1, LENGTH, 1, 1)
    assert torch.isfinite(combined).all()
    assert float(combined.min()) == 2 * MASKED
    # Fully masked rows (padded queries) still give a finite softmax.
    assert torch.isfinite(torch.softmax(combined + torch.randn_like(combined), dim=1)).all()


def test_causal_mask_layout_is_key_by_query() -> None:
    m = causal_mask(4)[0, :, 0, :]  # [key, query]
    assert m[0, 3] == 0.0 and m[3, 0] == MASKED and m[2, 2] == 0.0


def test_changing_the_padding_changes_the_key_mask() -> None:
    t = tiny("llama")
    ids = t.fixtures[0].token_ids  # 5 tokens
    shorter = ids[1:]
    (a,) = make_batches([t.fixtures[0]], 1, LENGTH, 0)
    b = Batch(
        a.fixtures,
        torch.tensor([[0] * (LENGTH - len(shorter)) + list(shorter)]),
        torch.tensor([[0] * (LENGTH - len(shorter)) + [1] * len(shorter)]),
    )
    mask_a = key_mask_from_padding(a.attention_mask)
    mask_b = key_mask_from_padding(b.attention_mask)
    assert not torch.equal(mask_a, mask_b)
    assert int((mask_a == MASKED).sum()) == LENGTH - len(ids)
    assert int((mask_b == MASKED).sum()) == LENGTH - len(shorter)
    assert set(mask_a.unique().tolist()) == {0.0, MASKED}


def test_key_mask_is_applied_and_padding_content_is_invisible() -> None:
    t = tiny("qwen2")
    batch = t.batches[0]
    n = len(batch.fixtures[0].token_ids)
    assert n < LENGTH
    x, key_mask = module_inputs(t.module, batch, t.embed_table, torch.float32)
    other_pad = batch.input_ids.masked_fill(batch.attention_mask == 0, 7)
    with torch.no_grad():
        base = t.module.run_layers(x, key_mask)[-1][0, :, 0, LENGTH - n :]
        repadded = t.module.run_layers(other_pad, key_mask)[-1][0, :, 0, LENGTH - n :]
        unmasked = t.module.run_layers(x, torch.zeros_like(key_mask))[-1][0, :, 0, LENGTH - n :]
    torch.testing.assert_close(repadded, base, rtol=0, atol=1e-5)
    assert rel(unmasked, base) > 1e-2  # without the key mask, padding leaks into real rows


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_rewrite_leaves_the_loaded_model_as_it_was(arch: str) -> None:
    """The canonical weights are the loaded model's own fp32 tensors (no copy: one fp32
    checkpoint less in the rewrite step), so nothing from adapting to the fp16 twin of the
    torch parity level may write into them: the parity reference is run on that model after
    the rewrite. Gemma 3 with an inflated gain also takes the stream-scaling path."""
    model = tiny_hf_model(arch)
    if arch == "gemma3":
        with torch.no_grad():
            model.model.layers[1].post_feedforward_layernorm.weight.mul_(30000.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    canonical = adapt(model.config, model.state_dict())
    embed = model.get_input_embeddings().weight
    assert canonical.weights["embed.weight"].data_ptr() == embed.data_ptr()
    fixtures = build_fixtures([], random_sequences(7), None, LENGTH, VOCAB, True)
    batches = make_batches(fixtures, 3, LENGTH, PAD_ID)
    io = build_module(canonical, "embeddings").io
    module, scaling, _ = choose_scales(canonical, io, batches)
    assert scaling.identity is (arch == "llama")
    if scaling.identity:  # unscaled matrices are the checkpoint's own storage, not copies
        down = model.model.layers[0].mlp.down_proj.weight
        assert module.layers[0].mlp.down.weight.data_ptr() == down.data_ptr()
        assert module.lm_head[0].weight.data_ptr() == model.lm_head.weight.data_ptr()
    references = {f.name: run_reference(model, f.token_ids) for f in fixtures}
    check_decoder(module, batches, references, module.host_embedding_table(), Thresholds())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
