"""Adapters: every tensor mapped, spec fields read from the config, hard errors by name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from tiny_models import one_torch_thread, tiny_config, tiny_hf_model

from converter.errors import InputError
from graph_passes.archs import ADAPTERS, adapt
from graph_passes.spec import CanonicalModel

PROJECTIONS = {
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


def expected_mapping(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, str]:
    """Canonical name -> checkpoint name for every tensor of a Llama-style state dict."""
    mapping = {
        "embed.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if not tied:
        mapping["lm_head.weight"] = "lm_head.weight"
    for key in state_dict:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
        if not m:
            continue
        i, middle, kind = m.groups()
        if middle == "input_layernorm":
            mapping[f"layers.{i}.attn_norm.{kind}"] = key
        elif middle == "post_attention_layernorm":
            mapping[f"layers.{i}.mlp_norm.{kind}"] = key
        else:
            canon = {v: k for k, v in PROJECTIONS.items()}[middle]
            mapping[f"layers.{i}.{canon}.{kind}"] = key
    return mapping


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)]
)
def test_every_tensor_is_mapped_unchanged(arch: str, tied: bool) -> None:
    model = tiny_hf_model(arch, tie_word_embeddings=tied)
    sd = model.state_dict()
    canonical = adapt(model.config, sd)
    mapping = expected_mapping(sd, tied)
    assert set(canonical.weights) == set(mapping)
    for canon, src in mapping.items():
        assert canonical.weights[canon].dtype == torch.float32
        assert torch.equal(canonical.weights[canon], sd[src]), canon
    # Every checkpoint tensor is accounted for; with tied heads, lm_head.weight is the table.
    used = set(mapping.values()) | ({"lm_head.weight"} if tied else set())
    assert used == set(sd)
    if arch == "qwen2":
        assert "layers.0.attn.q.bias" in canonical.weights
        assert "layers.0.attn.o.bias" not in canonical.weights


def test_fp32_weights_are_taken_without_a_copy() -> None:
    """No second fp32 checkpoint in memory during the rewrite (tests/test_bc1l.py checks
    that nothing writes into the shared tensors); other dtypes are widened to fp32."""
    model = tiny_hf_model("llama")
    sd = model.state_dict()
    canonical = adapt(model.config, sd)
    assert canonical.weights["final_norm.weight"].data_ptr() == sd["model.norm.weight"].data_ptr()
    half = adapt(model.config, {k: v.half() for k, v in sd.items()})
    assert half.weights["final_norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_spec_fields_follow_the_config(arch: str) -> None:
    theta = 12345.0 if arch == "llama" else 1_000_000.0
    model = tiny_hf_model(arch, rope_parameters={"rope_type": "default", "rope_theta": theta})
    config = model.config
    assert config.rope_parameters["rope_theta"] == theta
    spec = adapt(config, model.state_dict()).spec
    assert spec.architecture == arch
    assert spec.hidden_size == 64
    assert spec.vocab_size == 300
    assert spec.num_layers == config.num_hidden_layers == 3
    assert spec.tied_embeddings is bool(config.tie_word_embeddings)
    assert spec.final_norm.kind == "rms"
    assert spec.final_norm.eps == config.rms_norm_eps
    assert spec.final_norm.weight_offset == 0.0
    for layer in spec.layers:
        a = layer.attention
        assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
        assert a.group_size == 2
        assert a.rope_theta == theta
        assert a.causal
        assert a.qkv_bias is (arch == "qwen2")
        assert a.out_bias is False
        assert layer.input_norm.eps == layer.post_attention_norm.eps == config.rms_norm_eps
        assert layer.mlp.kind == "swiglu"
        assert layer.mlp.intermediate_size == 128
        assert layer.mlp.bias is False


def test_eps_differs_between_the_two_tiny_models() -> None:
    # Guards the test above: the two architectures really carry different epsilons.
    assert tiny_config("llama").rms_norm_eps == 1e-5
    assert tiny_config("qwen2").rms_norm_eps == 1e-6


def test_llama_attention_and_mlp_bias_are_mapped() -> None:
    model = tiny_hf_model("llama", attention_bias=True, mlp_bias=True)
    canonical = adapt(model.config, model.state_dict())
    layer = canonical.spec.layers[0]
    assert layer.attention.qkv_bias and layer.attention.out_bias and layer.mlp.bias
    for name in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"):
        assert f"layers.2.{name}.bias" in canonical.weights


def test_untied_head_maps_lm_head_weight() -> None:
    model = tiny_hf_model("llama", tie_word_embeddings=False)
    sd = model.state_dict()
    canonical = adapt(model.config, sd)
    assert not canonical.spec.tied_embeddings
    assert torch.equal(canonical.weights["lm_head.weight"], sd["lm_head.weight"])
    assert not torch.equal(canonical.lm_head_weight(), canonical.weights["embed.weight"])


def test_tied_head_is_not_duplicated() -> None:
    model = tiny_hf_model("llama", tie_word_embeddings=True)
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # transformers lists the tied head under its own name
    canonical = adapt(model.config, sd)
    assert canonical.spec.tied_embeddings
    assert "lm_head.weight" not in canonical.weights
    assert canonical.lm_head_weight() is canonical.weights["embed.weight"]


def test_tied_head_that_differs_from_the_table_is_refused() -> None:
    model = tiny_hf_model("llama", tie_word_embeddings=True)
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    with pytest.raises(InputError, match=r"'lm_head\.weight'"):
        adapt(model.config, sd)


def test_tied_state_dict_without_lm_head_key_is_fine() -> None:
    model = tiny_hf_model("qwen2", tie_word_embeddings=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert isinstance(adapt(model.config, sd), CanonicalModel)


# ---- hard errors that name the key ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_extra_unmapped_tensor_is_refused_by_name(arch: str) -> None:
    model = tiny_hf_model(arch)
    sd = dict(model.state_dict())
    sd["model.layers.0.mystery.weight"] = torch.zeros(3)
    with pytest.raises(InputError, match=r"model\.layers\.0\.mystery\.weight"):
        adapt(model.config, sd)


def test_many_unmapped_tensors_are_counted() -> None:
    model = tiny_hf_model("llama")
    sd = dict(model.state_dict())
    for i in range(10):
        sd[f"extra.{i}"] = torch.zeros(1)
    with pytest.raises(InputError, match=r"and 2 more"):
        adapt(model.config, sd)


@pytest.mark.parametrize(
    ("arch", "key"),
    [
        ("llama", "model.layers.1.mlp.up_proj.weight"),
        ("llama", "model.norm.weight"),
        ("llama", "model.embed_tokens.weight"),
        ("qwen2", "model.layers.0.self_attn.q_proj.bias"),
        ("qwen2", "model.layers.2.post_attention_layernorm.weight"),
    ],
)
def test_missing_tensor_is_refused_by_name(arch: str, key: str) -> None:
    model = tiny_hf_model(arch)
    sd = {k: v for k, v in model.state_dict().items() if k != key}
    with pytest.raises(InputError, match=re.escape(repr(key)) + " is missing"):
        adapt(model.config, sd)


def test_missing_untied_lm_head_is_refused_by_name() -> None:
    model = tiny_hf_model("llama", tie_word_embeddings=False)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(InputError, match=r"'lm_head\.weight' is missing"):
        adapt(model.config, sd)


@pytest.mark.parametrize(
    ("key", "shape"),
    [
        ("model.layers.0.self_attn.k_proj.weight", (64, 64)),  # MHA shape under a GQA config
        ("model.layers.2.self_attn.v_proj.bias", (64,)),
        ("model.layers.1.input_layernorm.weight", (65,)),
        ("model.embed_tokens.weight", (301, 64)),
    ],
)
def test_wrong_shape_is_refused_by_name(key: str, shape: tuple[int, ...]) -> None:
    model = tiny_hf_model("qwen2")
    sd = dict(model.state_dict())
    sd[key] = torch.zeros(shape)
    with pytest.raises(
        InputError, match=re.escape(repr(key)) + r" has shape " + re.escape(str(shape))
    ):
        adapt(model.config, sd)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_rope_scaling_is_refused(arch: str, rope: dict[str, object]) -> None:
    model = tiny_hf_model(arch, rope_parameters=dict(rope))
    with pytest.raises(InputError, match=rf"rope_parameters\.rope_type = '{rope['rope_type']}'"):
        adapt(model.config, model.state_dict())


def test_hidden_act_gelu_is_refused() -> None:
    model = tiny_hf_model("llama", hidden_act="gelu")
    with pytest.raises(InputError, match=r"config\.hidden_act = 'gelu'"):
        adapt(model.config, model.state_dict())


def test_qwen2_sliding_window_layers_are_refused() -> None:
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    model = tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(InputError, match=r"config\.layer_types: layers \[1, 2\] .*sliding"):
        adapt(model.config, model.state_dict())


def test_qwen2_sliding_window_flag_without_sliding_layers_is_accepted() -> None:
    # All layers below max_window_layers: transformers applies no window, so nothing to refuse.
    model = tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=3)
    assert "sliding_attention" not in model.config.layer_types
    adapt(model.config, model.state_dict())


def test_unsupported_model_type_lists_the_supported_ones() -> None:
    config = SimpleNamespace(model_type="gpt2")
    with pytest.raises(InputError, match=r"config\.model_type.*'gpt2'") as err:
        adapt(config, {})
    assert f"supported: {', '.join(sorted(ADAPTERS))}" in str(err.value)
    assert "llama" in str(err.value) and "qwen2" in str(err.value)


def test_legacy_rope_theta_attribute_and_rope_scaling() -> None:
    # Older configs carry rope_theta / rope_scaling as attributes instead of rope_parameters.
    model = tiny_hf_model("llama")
    legacy = SimpleNamespace(
        **{
            k: getattr(model.config, k)
            for k in (
                "model_type",
                "hidden_act",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "num_hidden_layers",
                "rms_norm_eps",
                "tie_word_embeddings",
            )
        }
    )
    legacy.rope_theta = 500000.0
    spec = adapt(legacy, model.state_dict()).spec
    assert spec.layers[0].attention.rope_theta == 500000.0
    legacy.rope_scaling = {"rope_type": "linear", "factor": 8.0}  # llama3 is implemented
    with pytest.raises(InputError, match=r"config\.rope_scaling.*'linear' is not implemented"):
        adapt(legacy, model.state_dict())
