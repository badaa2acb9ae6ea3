"""The BC1L encoder computes the checkpoint's function (SPEC section 2) on tiny perturbed BERT
and ModernBERT models: adapters, LayerNorm, masks, batch folding, tails.

The reference is transformers itself on each sequence unpadded; the BC1L module runs the same
tokens right-padded in folded (B, L) batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from encoder_models import (
    THRESHOLDS,
    TinyEncoder,
    build_encoder,
    hf_model,
    tiny_config,
)
from tiny_models import one_torch_thread

from graph_passes.archs import ENCODER_ADAPTERS, adapt_encoder
from graph_passes.encoder import BC1LEncoder, EncoderIO, fold, real_weights, unfold
from graph_passes.layer_norm import FP16_EPS_FLOOR, LayerNorm
from graph_passes.masks import MASKED, folded_band_mask, key_mask_from_padding
from parity.encoder_gates import check_encoder, encoder_inputs
from parity.measure import folded_rows

TOLERANCE = 1e-5
OUTPUTS = ["last-hidden-state", "sentence-embedding", "logits"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


_CACHE: dict[tuple[object, ...], TinyEncoder] = {}


def tiny(arch: str, output: str = "last-hidden-state", **kw: object) -> TinyEncoder:
    key = (arch, output, tuple(sorted(kw.items())))
    if key not in _CACHE:
        config_kw = {k: v for k, v in kw.items() if k not in ("batch", "length", "lengths")}
        build_kw = {k: v for k, v in kw.items() if k in ("batch", "length", "lengths")}
        _CACHE[key] = build_encoder(tiny_config(arch, **config_kw), output, **build_kw)  # type: ignore[arg-type]
    return _CACHE[key]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- the whole module against transformers --------------------------------------------------


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
@pytest.mark.parametrize("output", OUTPUTS)
def test_every_layer_and_output_match_transformers_with_right_padding(
    arch: str, output: str
) -> None:
    t = tiny(arch, output)
    assert any((b.attention_mask == 0).any() for b in t.batches)  # padded rows covered
    report, rows = check_encoder(t.module, t.batches, t.references, THRESHOLDS)
    assert report.passed, [g for g in report.gates if not g.passed]
    assert all(row.fp32_rel_error <= TOLERANCE for row in report.layers)
    assert len(rows) == len(t.fixtures)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_batch_folding_gives_each_sample_its_own_result(batch: int) -> None:
    t = tiny("modernbert", lengths=(5, 16, 9))
    module = BC1LEncoder(t.canonical, EncoderIO(batch, 16, "token-ids", "last-hidden-state"))
    ids = torch.zeros(batch, 16, dtype=torch.int64)
    mask = torch.zeros(batch, 16, dtype=torch.int64)
    fixtures = t.fixtures[:batch]
    for r, f in enumerate(fixtures):
        ids[r, : len(f.token_ids)] = torch.tensor(f.token_ids)
        mask[r, : len(f.token_ids)] = 1
    with torch.no_grad():
        out = module(ids, key_mask_from_padding(mask))
    for r, f in enumerate(fixtures):
        n = len(f.token_ids)
        with torch.no_grad():
            want = t.model(input_ids=torch.tensor([f.token_ids])).last_hidden_state[0]
        assert rel(out[r, :n], want) <= TOLERANCE


def test_samples_do_not_see_each_other() -> None:
    # Changing sample 1's tokens leaves sample 0's outputs bit-identical: the block-diagonal
    # mask removes other samples' keys exactly (exp(-1e4) is 0).
    t = tiny("bert")
    batch = t.batches[0]
    inputs = encoder_inputs(t.module, batch, torch.float32)
    other = batch.input_ids.clone()
    other[1:, :4] = torch.tensor([7, 8, 9, 10])
    with torch.no_grad():
        a = t.module(*inputs)
        b = t.module(other, *inputs[1:])
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[1], b[1])


def test_right_padding_amount_does_not_change_real_outputs() -> None:
    t = tiny("modernbert", lengths=(5, 9, 12))
    ids = t.fixtures[0].token_ids
    outs = []
    for length in (8, 12, 16):
        module = BC1LEncoder(t.canonical, EncoderIO(1, length, "token-ids", "last-hidden-state"))
        x = torch.zeros(1, length, dtype=torch.int64)
        x[0, : len(ids)] = torch.tensor(ids)
        m = torch.zeros(1, length, dtype=torch.int64)
        m[0, : len(ids)] = 1
        with torch.no_grad():
            outs.append(module(x, key_mask_from_padding(m))[0, : len(ids)])
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-5)


# ---- adapters ---------------------------------------------------------------------------------


def test_adapters_registered() -> None:
    assert set(ENCODER_ADAPTERS) == {"bert", "modernbert"}


def test_modernbert_spec_reads_the_config_object() -> None:
    config = tiny_config("modernbert", num_hidden_layers=6, local_rope_theta=5000.0)
    spec = adapt_encoder(config, hf_model(config, False).state_dict()).spec
    kinds = [(layer.attention.window, layer.attention.rope_theta) for layer in spec.layers]
    assert kinds == [(None, 160000.0), (4, 5000.0), (4, 5000.0)] * 2
    assert spec.layers[0].attention_norm is None  # the identity norm before layer 0
    assert all(layer.attention_norm is not None for layer in spec.layers[1:])
    assert spec.layers[0].placement == "pre" and spec.final_norm is not None
    assert spec.embedding.norm_reads_token_row_alone
    assert spec.layers[0].mlp.kind == "geglu" and spec.layers[0].mlp_norm.bias


def test_mmbert_shape_theta_is_160000_for_both_layer_types() -> None:
    from encoder_models import real_shape_config

    config = real_shape_config("mmbert-base-shape", num_hidden_layers=3, vocab_size=64)
    spec = adapt_encoder(config, hf_model(config, False).state_dict()).spec
    assert [layer.attention.rope_theta for layer in spec.layers] == [160000.0] * 3
    assert [layer.attention.window for layer in spec.layers] == [None, 64, 64]


def test_bert_spec_and_weights() -> None:
    t = tiny("bert", "logits")
    spec = t.canonical.spec
    assert spec.layers[0].placement == "post" and spec.final_norm is None
    assert not spec.layers[0].attention.rope and spec.layers[0].attention.qkv_bias
    assert not spec.embedding.norm_reads_token_row_alone
    assert spec.classifier is not None and spec.classifier.pooling == "cls"
    sd = t.model.state_dict()
    w = t.canonical.weights
    assert torch.equal(w["head.dense.weight"], sd["bert.pooler.dense.weight"])
    assert torch.equal(
        w["layers.1.attn_norm.bias"], sd["bert.encoder.layer.1.attention.output.LayerNorm.bias"]
    )


def test_modernbert_fused_projections_split_in_order() -> None:
    t = tiny("modernbert")
    sd, w = t.model.state_dict(), t.canonical.weights
    wqkv = sd["layers.1.attn.Wqkv.weight"]
    assert torch.equal(torch.cat([w[f"layers.1.attn.{n}.weight"] for n in "qkv"]), wqkv)
    wi = sd["layers.1.mlp.Wi.weight"]
    assert torch.equal(w["layers.1.mlp.gate.weight"], wi[:96])  # GELU reads the first half
    assert torch.equal(w["layers.1.mlp.up.weight"], wi[96:])


def test_swapped_gate_and_up_is_caught() -> None:
    t = tiny("modernbert")
    w = dict(t.canonical.weights)
    for i in range(4):
        w[f"layers.{i}.mlp.gate.weight"], w[f"layers.{i}.mlp.up.weight"] = (
            w[f"layers.{i}.mlp.up.weight"],
            w[f"layers.{i}.mlp.gate.weight"],
        )
    from graph_passes.spec import EncoderModel

    report, _ = check_encoder(
        t.rebuild(EncoderModel(t.canonical.spec, w)), t.batches, t.references, THRESHOLDS
    )
    assert not report.passed and report.first_diverging_layer == 0


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [
        ("bert", "hidden_act", "gelu_new"),
        ("modernbert", "hidden_activation", "gelu_pytorch_tanh"),
    ],
)
def test_tanh_gelu_is_refused(arch: str, key: str, value: str) -> None:
    from converter.errors import InputError

    config = tiny_config(arch, **{key: value})
    with pytest.raises(InputError, match=key):
        adapt_encoder(config, hf_model(config, False).state_dict())


def test_unmapped_tensor_is_refused() -> None:
    from converter.errors import InputError

    t = tiny("bert")
    sd = dict(t.model.state_dict())
    sd["encoder.layer.0.extra.weight"] = torch.zeros(3)
    with pytest.raises(InputError, match="extra"):
        adapt_encoder(t.model.config, sd)


# ---- LayerNorm --------------------------------------------------------------------------------


def ln_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    mu = x64.mean(dim=1, keepdim=True)
    var = ((x64 - mu) ** 2).mean(dim=1, keepdim=True)
    y = (x64 - mu) / torch.sqrt(var + eps)
    return (y * w.double().reshape(1, -1, 1, 1) + b.double().reshape(1, -1, 1, 1)).float()


@pytest.mark.parametrize("k", [0, 3, 8, 14])
def test_layer_norm_matches_definition_with_any_prescale(k: int) -> None:
    torch.manual_seed(0)
    w, b = 1 + 0.2 * torch.randn(48), 0.3 * torch.randn(48)
    x = torch.randn(2, 48, 1, 5) * 3 + 2
    x[0, :4, 0, 0] = torch.tensor([3000.0, -2000.0, 2500.0, 100.0])
    norm = LayerNorm(w, b, 1e-5)
    norm.set_prescale(2.0**k)
    torch.testing.assert_close(norm(x), ln_reference(x, w, b, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        norm(x),
        torch.nn.functional.layer_norm(x.transpose(1, 3), (48,), w, b, 1e-5).transpose(1, 3),
        rtol=1e-5,
        atol=1e-5,
    )


def test_layer_norm_epsilon_is_the_original() -> None:
    torch.manual_seed(1)
    w, b = torch.ones(16), torch.zeros(16)
    x = torch.randn(1, 16, 1, 3) * 1e-3  # small variance: eps is visible
    a, c = LayerNorm(w, b, 1e-5)(x), LayerNorm(w, b, 1e-3)(x)
    assert rel(a, ln_reference(x, w, b, 1e-5)) < 1e-5
    assert rel(a, c) > 1e-2


def test_fp16_epsilon_floor_keeps_constant_rows_finite() -> None:
    # BERT's 1e-12 is 0 in fp16; a constant (e.g. zero) row would then be 0 * rsqrt(0) = NaN.
    norm = LayerNorm(torch.ones(8), torch.zeros(8), 1e-12)
    assert float(norm.scaled_eps.half()) == 0.0
    norm.set_eps_floor(FP16_EPS_FLOOR)
    half = norm.half()
    y = half(torch.zeros(1, 8, 1, 2, dtype=torch.float16))
    assert torch.isfinite(y).all()
    assert float(half.scaled_eps) == FP16_EPS_FLOOR


def test_layer_norm_fp16_with_prescale_survives_large_activations() -> None:
    torch.manual_seed(2)
    w, b = 1 + 0.2 * torch.randn(384), 0.3 * torch.randn(384)
    x = torch.randn(1, 384, 1, 4) * 30
    x[0, 5, 0, 1] = 20000.0
    want = ln_reference(x, w, b, 1e-12)
    naive = LayerNorm(w, b, 1e-12)
    naive.set_eps_floor(FP16_EPS_FLOOR)
    with torch.no_grad():
        bad = naive.half()(x.half()).float()
    assert not torch.isfinite(bad).all() or rel(bad, want) > 0.1
    fixed = LayerNorm(w, b, 1e-12)
    fixed.set_prescale(1024.0)
    fixed.set_eps_floor(FP16_EPS_FLOOR)
    with torch.no_grad():
        good = fixed.half()(x.half()).float()
    assert rel(good, want) < 1e-2


# ---- masks and layout helpers -----------------------------------------------------------------


def test_folded_band_mask_is_block_diagonal_and_inclusive() -> None:
    m = folded_band_mask(2, 10, 3)[0, :, 0, :]  # [key, query]
    assert m[2, 5] == 0.0 and m[1, 5] == MASKED  # |q-k| = 3 kept, 4 excluded
    assert m[12, 15] == 0.0 and m[5, 15] == MASKED  # other sample excluded
    assert torch.equal(m, m.T)
    g = folded_band_mask(2, 10, None)[0, :, 0, :]
    assert g[0, 9] == 0.0 and g[0, 10] == MASKED


def test_fold_unfold_roundtrip_and_real_weights() -> None:
    x = torch.randn(3, 5, 4)
    assert torch.equal(unfold(fold(x), 3, 5), x)
    assert torch.equal(fold(x)[0, :, 0, 5 + 2], x[1, 2])
    km = key_mask_from_padding(torch.tensor([[1, 1, 0]])).half()
    assert real_weights(km).tolist() == [[1.0, 1.0, 0.0]]


def test_folded_rows_reads_each_sample_block() -> None:
    h = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 1, 12)
    assert torch.equal(folded_rows(4)(h, 1, 2), h[0, :, 0, 4:6].T)


def test_padded_fp16_rows_are_finite_for_every_layer() -> None:
    from parity.encoder_gates import fp16_module

    t = tiny("bert", "sentence-embedding")
    half = fp16_module(t.module)
    for batch in t.batches:
        ids, types, km = encoder_inputs(half, batch, torch.float16)
        with torch.no_grad():
            states = half.run_layers(half.embed(ids, types), km)
        assert all(torch.isfinite(s).all() for s in states)


def test_layer_norm_program_has_no_batch_norm_with_its_own_epsilon() -> None:
    # coremltools fuses "mul by a constant, then add a constant" into batch_norm(variance=1,
    # epsilon=1e-5), silently scaling by 1/sqrt(1 + 1e-5); the module's op order avoids it.
    import coremltools as ct

    from converter.coreml.program import TensorIO, live_ops, to_mlprogram, trace

    norm = LayerNorm(torch.rand(16) + 0.5, torch.randn(16), 1e-12)
    norm.set_eps_floor(FP16_EPS_FLOOR)
    inputs = [TensorIO("x", (1, 16, 1, 8), "float16", "")]
    outputs = [TensorIO("y", (1, 16, 1, 8), "float16", "")]
    program = to_mlprogram(trace(norm, inputs), inputs, outputs, ct.target.macOS14, "float16")
    ops = live_ops(program)
    assert "batch_norm" not in ops and ops["rsqrt"] == 1


def test_real_weights_are_exact_in_the_emitted_program(tmp_path: Path) -> None:
    """Padded slots weigh exactly 0 and real ones exactly 1 in the converted program too:
    coremltools turns a division by MASKED into a product with fp16(1/MASKED), which gave
    padded slots a weight of -1.66e-4 wherever the product is not rounded back to 1 (an fp32
    program; the fp32 level of every sentence-embedding program)."""
    from converter.coreml.program import TensorIO, save_package, to_mlprogram, trace
    from converter.coreml.targets import TARGETS
    from parity.mil import Evaluator, load_package

    class Weights(torch.nn.Module):
        def forward(self, key_mask: torch.Tensor) -> torch.Tensor:
            return real_weights(key_mask)

    mask = key_mask_from_padding(torch.tensor([[1] * 5 + [0] * 3, [1] * 8]))
    for precision in ("float16", "float32"):
        io = [TensorIO("key_mask", (2, 8), precision, "")]  # type: ignore[arg-type]
        out = [TensorIO("weights", (2, 8), precision, "")]  # type: ignore[arg-type]
        target = TARGETS["macOS14"].ct_target()
        mlmodel = to_mlprogram(trace(Weights(), io), io, out, target, precision)  # type: ignore[arg-type]
        package = save_package(mlmodel, tmp_path / f"{precision}.mlpackage")
        feed = mask.numpy().astype("float16" if precision == "float16" else "float32")
        for profile in ("fp32", "fp16"):
            evaluator = Evaluator(load_package(package), profile)
            got = evaluator.run({"key_mask": feed}).outputs["weights"]
            assert (got == (feed == 0)).all(), (precision, profile, got)
