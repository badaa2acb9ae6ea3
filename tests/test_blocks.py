"""The building blocks of the shared model description, each on a synthetic description
against a straightforward torch reference written here in (L, D) layout.

Blocks: post-norms (placement "both", Gemma's four norms per layer), GeGLU with tanh GELU,
``(1 + w)`` RMSNorm scaling, per-head q/k RMSNorm, causal sliding windows (transformers'
exclusive convention, next to the encoders' inclusive band), an embedding scale (also in the
table a host gathers from), a checkpoint attention scale, partial rotary. Each test also shows
its teeth: the neighbouring wrong variant of the block misses the reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tiny_models import one_torch_thread
from transformers.masking_utils import sliding_window_causal_mask_function

from graph_passes.decoder import BC1LDecoder, DecoderIO
from graph_passes.masks import MASKED, causal_window_mask, folded_band_mask
from graph_passes.model import Block
from graph_passes.spec import (
    AttentionSpec,
    CanonicalModel,
    LayerSpec,
    MlpSpec,
    NormSpec,
    TransformerSpec,
)

D, HEADS, KV, HEAD_DIM, INTER, LENGTH = 32, 4, 2, 16, 48, 12
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


# ---- the reference: one layer in (L, D) layout, written out ---------------------------------


def ref_norm(x: torch.Tensor, w: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + spec.eps)
    return (y * (spec.weight_offset + w.double())).float()


def ref_rope(x: torch.Tensor, theta: float, rotary: int) -> torch.Tensor:
    """x (L, d): the first ``rotary`` channels rotated split-half, the rest passed through."""
    pos = torch.arange(x.shape[0], dtype=torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    r, rest = x[:, :rotary].double(), x[:, rotary:]
    half = rotary // 2
    rotated = torch.cat([-r[:, half:], r[:, :half]], dim=-1)
    return torch.cat([(r * emb.cos() + rotated * emb.sin()).float(), rest], dim=-1)


def visible(q: int, k: int, a: AttentionSpec) -> bool:
    if a.causal and k > q:
        return False
    if a.window is None:
        return True
    if a.window_rule == "causal-exclusive":
        return k > q - a.window
    return abs(q - k) <= a.window


ACT = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def ref_layer(spec: LayerSpec, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One layer on x (L, D), from the description alone."""
    a, p = spec.attention, "layers.0."

    def norm(name: str, s: NormSpec | None, v: torch.Tensor) -> torch.Tensor:
        return v if s is None else ref_norm(v, w[p + name + ".weight"], s)

    def attention(h: torch.Tensor) -> torch.Tensor:
        q, k, v = (h @ w[f"{p}attn.{n}.weight"].T for n in "qkv")
        n = h.shape[0]
        mask = torch.tensor([[visible(i, j, a) for j in range(n)] for i in range(n)])
        outs = []
        for head in range(a.num_heads):
            g = head // a.group_size
            qh = q[:, head * a.head_dim : (head + 1) * a.head_dim]
            kh = k[:, g * a.head_dim : (g + 1) * a.head_dim]
            if a.qk_norm is not None:
                qh = ref_norm(qh, w[p + "attn.q_norm.weight"], a.qk_norm)
                kh = ref_norm(kh, w[p + "attn.k_norm.weight"], a.qk_norm)
            qh = ref_rope(qh, a.rope_theta, a.rotary_channels)
            kh = ref_rope(kh, a.rope_theta, a.rotary_channels)
            scale = a.scale if a.scale is not None else 1 / math.sqrt(a.head_dim)
            scores = (qh @ kh.T) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            outs.append(scores.softmax(-1) @ v[:, g * a.head_dim : (g + 1) * a.head_dim])
        return torch.cat(outs, dim=-1) @ w[p + "attn.o.weight"].T

    def mlp(h: torch.Tensor) -> torch.Tensor:
        gate, up = h @ w[p + "mlp.gate.weight"].T, h @ w[p + "mlp.up.weight"].T
        return (ACT[spec.mlp.act](gate) * up) @ w[p + "mlp.down.weight"].T

    h = x + norm("attn_out_norm", spec.attention_out_norm,
                 attention(norm("attn_norm", spec.attention_norm, x)))  # fmt: skip
    return h + norm("mlp_out_norm", spec.mlp_out_norm, mlp(norm("mlp_norm", spec.mlp_norm, h)))


# ---- synthetic descriptions ------------------------------------------------------------------


def layer_spec(
    attn: dict[str, Any] | None = None, mlp: dict[str, Any] | None = None, **layer: Any
) -> LayerSpec:
    """A pre-norm SwiGLU layer, GQA 4/2, with the given attention, MLP and layer fields."""
    norm = NormSpec(kind="rms", eps=1e-6)
    attention = AttentionSpec(HEADS, KV, HEAD_DIM, 10000.0, False, False, **(attn or {}))
    mlp_spec = MlpSpec(kind="swiglu", intermediate_size=INTER)
    if mlp:
        mlp_spec = dataclasses.replace(mlp_spec, **mlp)
    fields: dict[str, Any] = {"attention_norm": norm, "mlp_norm": norm, **layer}
    return LayerSpec(attention=attention, mlp=mlp_spec, **fields)


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight a layer may read, perturbed off 0 and 1."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    p = "layers.0."
    w = {
        p + "attn.q.weight": r(HEADS * HEAD_DIM, D),
        p + "attn.k.weight": r(KV * HEAD_DIM, D),
        p + "attn.v.weight": r(KV * HEAD_DIM, D),
        p + "attn.o.weight": r(D, HEADS * HEAD_DIM),
        p + "mlp.gate.weight": r(INTER, D),
        p + "mlp.up.weight": r(INTER, D),
        p + "mlp.down.weight": r(D, INTER),
        p + "attn.q_norm.weight": 1 + r(HEAD_DIM),
        p + "attn.k_norm.weight": 1 + r(HEAD_DIM),
    }
    for name in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"):
        w[p + name + ".weight"] = 1 + r(D)
    return w


def run_block(spec: LayerSpec, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The BC1L block on x (L, D) at positions 0..L-1 with its causal (window) mask."""
    n = x.shape[0]
    block = Block(spec, w, 0, torch.arange(n)).eval()
    a = spec.attention
    if a.window is not None and a.window_rule == "symmetric-inclusive":
        mask = folded_band_mask(1, n, a.window)
    else:
        mask = causal_window_mask(n, a.window)
    with torch.no_grad():
        out = block(x.T.reshape(1, D, 1, n), mask)
    return out[0, :, 0, :].T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(spec: LayerSpec, wrong: LayerSpec | None = None, margin: float = 100.0) -> None:
    """The block matches the reference of ``spec``; the reference of ``wrong`` (the
    neighbouring variant) misses it by ``margin`` tolerances, so the test would catch a swap."""
    w = random_weights()
    x = torch.randn(LENGTH, D, generator=torch.Generator().manual_seed(1)) * 2.0
    got = run_block(spec, w, x)
    assert rel(got, ref_layer(spec, w, x)) <= TOLERANCE
    if wrong is not None:
        assert rel(got, ref_layer(wrong, w, x)) > margin * TOLERANCE


# ---- the blocks --------------------------------------------------------------------------------


def test_plain_pre_norm_layer_matches_the_reference() -> None:
    check(layer_spec())


def test_post_norms_after_the_attention_and_mlp_branches() -> None:
    norm = NormSpec(kind="rms", eps=1e-6)
    both = layer_spec(placement="both", attention_out_norm=norm, mlp_out_norm=norm)
    check(both, wrong=layer_spec())
    # Four norms per layer, each named, in execution order.
    block = Block(both, random_weights(), 0, torch.arange(LENGTH))
    names = [n for n, _ in block.norms("layers.0")]
    assert names == ["layers.0.attn_norm", "layers.0.attn_out_norm", "layers.0.mlp_norm",
                     "layers.0.mlp_out_norm"]  # fmt: skip


def test_out_norms_need_placement_both() -> None:
    norm = NormSpec(kind="rms", eps=1e-6)
    with pytest.raises(ValueError, match="placement 'pre'"):
        layer_spec(attention_out_norm=norm, mlp_out_norm=norm)


def test_geglu_with_tanh_gelu_is_not_the_exact_gelu() -> None:
    tanh = layer_spec(mlp={"kind": "geglu", "activation": "gelu_tanh"})
    exact = layer_spec(mlp={"kind": "geglu"})
    assert exact.mlp.act == "gelu" and tanh.mlp.act == "gelu_tanh"
    # The two GELUs differ by at most ~5e-4 absolute: through the layer that is ~9e-5
    # relative here (measured), still 5x the tolerance, so a swap is caught.
    check(tanh, wrong=exact, margin=5)
    check(exact, wrong=tanh, margin=5)


def test_one_plus_w_norm_scaling() -> None:
    offset = NormSpec(kind="rms", eps=1e-6, weight_offset=1.0)
    check(layer_spec(attention_norm=offset, mlp_norm=offset), wrong=layer_spec())


def test_per_head_qk_norm() -> None:
    qk = NormSpec(kind="rms", eps=1e-6)
    spec = layer_spec(attn={"qk_norm": qk})
    check(spec, wrong=layer_spec())
    # With a (1 + w) q/k norm (Gemma) and a non-default scale folded into its gain.
    gemma_qk = NormSpec(kind="rms", eps=1e-6, weight_offset=1.0)
    scaled = layer_spec(attn={"qk_norm": gemma_qk, "scale": 0.0625})
    check(scaled, wrong=layer_spec(attn={"qk_norm": gemma_qk}))


def test_per_head_qk_norm_is_not_a_norm_over_all_heads() -> None:
    qk = NormSpec(kind="rms", eps=1e-6)
    spec = layer_spec(attn={"qk_norm": qk})
    block = Block(spec, random_weights(), 0, torch.arange(LENGTH))
    assert block.attention.q_norm is not None
    x = torch.randn(1, HEADS * HEAD_DIM, 1, LENGTH)
    x[:, :HEAD_DIM] *= 10.0  # one loud head: a norm over all heads would damp the others
    y = block.attention.q_norm(x)
    heads = y.reshape(HEADS, HEAD_DIM, LENGTH)
    w = random_weights()["layers.0.attn.q_norm.weight"] * block.attention.spec.score_scale
    for h in range(HEADS):
        xh = x.reshape(HEADS, HEAD_DIM, LENGTH)[h].T
        want = ref_norm(xh, w, qk).T
        torch.testing.assert_close(heads[h], want, rtol=1e-5, atol=1e-5)


def test_attention_scale_from_the_checkpoint() -> None:
    # Gemma 3: query_pre_attn_scalar 256 with head_dim 16 -> scale 1/16, not 1/4.
    check(layer_spec(attn={"scale": 256**-0.5}), wrong=layer_spec())


def test_partial_rotary() -> None:
    check(layer_spec(attn={"rotary_dim": 8}), wrong=layer_spec())


# ---- sliding windows: the two conventions -------------------------------------------------------


def test_causal_window_mask_is_transformers_exclusive_window() -> None:
    window = 4
    mask = causal_window_mask(LENGTH, window)[0, :, 0, :]  # [key, query]
    overlay = sliding_window_causal_mask_function(window)
    for q in range(LENGTH):
        for k in range(LENGTH):
            want = bool(overlay(0, 0, torch.tensor(q), torch.tensor(k)))
            assert (mask[k, q] == 0).item() is want, (q, k)
    # A window of 4 sees the query and the 3 keys before it: exclusive at distance 4.
    assert [k for k in range(LENGTH) if mask[k, 7] == 0] == [4, 5, 6, 7]
    # The encoders' band is inclusive: abs(q - k) <= 4 reaches 3..11 from query 7.
    band = folded_band_mask(1, LENGTH, window)[0, :, 0, :]
    assert [k for k in range(LENGTH) if band[k, 7] == 0] == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert float(causal_window_mask(LENGTH, None)[0, 5, 0, 4]) == MASKED  # future key


def test_causal_sliding_window_layer_off_by_one_shows_at_window_4() -> None:
    exclusive = layer_spec(attn={"window": 4, "window_rule": "causal-exclusive"})
    # The same layer with an inclusive causal window (q - 4 <= k) would see one key more.
    inclusive = layer_spec(attn={"window": 5, "window_rule": "causal-exclusive"})
    check(exclusive, wrong=inclusive)
    check(exclusive, wrong=layer_spec())  # and a global layer differs too


# ---- embedding scale --------------------------------------------------------------------------


def decoder(embed_scale: float, inputs: str, window: int | None = None) -> BC1LDecoder:
    norm = NormSpec(kind="rms", eps=1e-6, weight_offset=1.0)
    layer = layer_spec(
        {"window": window, "window_rule": "causal-exclusive"}, attention_norm=norm, mlp_norm=norm
    )
    spec = TransformerSpec("synthetic", D, 50, (layer,), norm, True, embed_scale=embed_scale)
    w = random_weights()
    g = torch.Generator().manual_seed(3)
    w["embed.weight"] = torch.randn(50, D, generator=g)
    w["final_norm.weight"] = torch.randn(D, generator=g) * 0.1
    io = DecoderIO(batch=1, length=LENGTH, inputs=inputs, logit_positions=LENGTH,  # type: ignore[arg-type]
                   lm_head_chunk=64)  # fmt: skip
    return BC1LDecoder(CanonicalModel(spec, w), io).eval()


def test_embedding_scale_in_the_module_and_in_the_host_table() -> None:
    scale = math.sqrt(D)
    ids = torch.randint(0, 50, (1, LENGTH), generator=torch.Generator().manual_seed(4))
    by_ids = decoder(scale, "token-ids")
    by_rows = decoder(scale, "embeddings")
    table = by_rows.host_embedding_table()
    raw = by_ids.lm_head[0].weight[:, :, 0, 0]  # the tied head reads the raw table
    # transformers: embed_tokens(ids) * embed_scale, an fp32 scalar: the same fp32 products.
    torch.testing.assert_close(table, raw * torch.tensor(scale), rtol=0, atol=0)
    keys = torch.zeros(1, LENGTH)
    with torch.no_grad():
        a = by_ids.run_layers(ids, keys)[-1]
        b = by_rows.run_layers(table[ids], keys)[-1]
        unscaled = by_rows.run_layers(raw[ids], keys)[-1]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The layer reads the scaled rows: the reference on scaled rows matches, unscaled does not.
    x = table[ids][0]
    want = ref_layer(by_ids.spec.layers[0], random_weights(), x)
    assert rel(a[0, :, 0, :].T, want) <= TOLERANCE
    assert rel(unscaled[0, :, 0, :].T, want) > 1e-2
    unit = decoder(1.0, "embeddings")
    torch.testing.assert_close(unit.host_embedding_table(), raw, rtol=0, atol=0)


def test_decoder_window_masks_follow_left_padding() -> None:
    # Left padding shifts slots; with the key mask the window still counts real positions.
    module = decoder(1.0, "embeddings", window=4)
    assert module.windows == [4]
    n, pad = 7, LENGTH - 7
    rows = torch.randn(1, LENGTH, D, generator=torch.Generator().manual_seed(5))
    keys = torch.tensor([[MASKED] * pad + [0.0] * n])
    with torch.no_grad():
        got = module.run_layers(rows, keys)[-1][0, :, 0, pad:].T
    want = ref_layer(module.spec.layers[0], random_weights(), rows[0, pad:])
    assert rel(got, want) <= TOLERANCE


def test_a_window_of_at_least_the_length_is_the_global_mask() -> None:
    rows = torch.randn(1, LENGTH, D, generator=torch.Generator().manual_seed(6))
    keys = torch.zeros(1, LENGTH)
    wide, narrow, full = (decoder(1.0, "embeddings", window=w) for w in (LENGTH, 4, None))
    assert wide.windows == [] and narrow.windows == [4]
    with torch.no_grad():
        a, b, c = (m.run_layers(rows, keys)[-1] for m in (wide, full, narrow))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rel(c, b) > 1e-2


def test_decoder_refuses_a_symmetric_window() -> None:
    layer = layer_spec({"window": 4, "window_rule": "symmetric-inclusive"})
    norm = NormSpec(kind="rms", eps=1e-6)
    spec = TransformerSpec("synthetic", D, 50, (layer,), norm, True)
    w = random_weights()
    w["embed.weight"], w["final_norm.weight"] = torch.randn(50, D), torch.ones(D)
    io = DecoderIO(1, LENGTH, "embeddings", 1, 64)
    with pytest.raises(ValueError, match="causal"):
        BC1LDecoder(CanonicalModel(spec, w), io)


def test_the_host_table_stays_fp32_and_is_shared_by_copies() -> None:
    import copy

    module = decoder(math.sqrt(D), "embeddings")
    twin = copy.deepcopy(module).half()
    assert twin.host_embedding_table() is module.host_embedding_table()
    assert module.host_embedding_table().dtype == torch.float32
