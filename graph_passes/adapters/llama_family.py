"""Shared mapping for Llama-style decoders (pre-norm RMSNorm, RoPE, GQA, SwiGLU).

The architecture files (`llama.py`, `qwen2.py`) say which optional features their config
turns on; this module reads the config *object*, maps every tensor, and refuses anything it
does not implement by name instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from converter.errors import InputError
from graph_passes.adapters.weights import WeightReader
from graph_passes.spec import (
    AttentionSpec,
    CanonicalModel,
    LayerSpec,
    MlpSpec,
    NormSpec,
    TransformerSpec,
)


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` or ``default``; transformers configs are attribute bags."""
    return getattr(config, key, default)


def require(config: object, key: str, expected: object, why: str) -> None:
    """Fail naming ``key`` unless the config's effective value equals ``expected``."""
    value = config_value(config, key, expected)
    if value != expected:
        raise InputError(f"config.{key} = {value!r}: {why}; only {expected!r} is implemented")


def rope_theta(config: object) -> float:
    """RoPE theta, from ``rope_parameters`` (transformers 5) or ``rope_theta`` (older)."""
    params = config_value(config, "rope_parameters")
    if isinstance(params, Mapping):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise InputError(
                f"config.rope_parameters.rope_type = {rope_type!r}: RoPE scaling is not "
                "implemented; only 'default' RoPE is supported"
            )
        if "rope_theta" not in params:
            raise InputError("config.rope_parameters: no 'rope_theta' given")
        return float(params["rope_theta"])
    scaling = config_value(config, "rope_scaling")
    if scaling:
        raise InputError(f"config.rope_scaling = {scaling!r}: RoPE scaling is not implemented")
    theta = config_value(config, "rope_theta")
    if theta is None:
        raise InputError("config: neither rope_parameters nor rope_theta is set")
    return float(theta)


def map_decoder(
    config: object,
    state_dict: Mapping[str, torch.Tensor],
    *,
    architecture: str,
    qkv_bias: bool,
    out_bias: bool,
    mlp_bias: bool,
) -> CanonicalModel:
    """Map a Llama-style ``*ForCausalLM`` config and state dict to a `CanonicalModel`."""
    require(config, "hidden_act", "silu", "the MLP activation")
    d_model = int(config_value(config, "hidden_size"))
    n_heads = int(config_value(config, "num_attention_heads"))
    n_kv = int(config_value(config, "num_key_value_heads", n_heads) or n_heads)
    head_dim = int(config_value(config, "head_dim", None) or d_model // n_heads)
    inter = int(config_value(config, "intermediate_size"))
    vocab = int(config_value(config, "vocab_size"))
    n_layers = int(config_value(config, "num_hidden_layers"))
    eps = float(config_value(config, "rms_norm_eps"))
    tied = bool(config_value(config, "tie_word_embeddings", False))
    theta = rope_theta(config)
    if n_heads % n_kv:
        raise InputError(
            f"config.num_key_value_heads = {n_kv} does not divide num_attention_heads = {n_heads}"
        )
    if head_dim % 2:
        raise InputError(f"config.head_dim = {head_dim}: split-half RoPE needs an even head_dim")

    norm = NormSpec(kind="rms", eps=eps)
    attn = AttentionSpec(
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=theta,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
    )
    mlp = MlpSpec(kind="swiglu", intermediate_size=inter, bias=mlp_bias)
    layer = LayerSpec(attention=attn, mlp=mlp, input_norm=norm, post_attention_norm=norm)
    spec = TransformerSpec(
        architecture=architecture,
        hidden_size=d_model,
        vocab_size=vocab,
        layers=tuple(layer for _ in range(n_layers)),
        final_norm=norm,
        tied_embeddings=tied,
    )

    r = WeightReader(state_dict, architecture)
    w: dict[str, torch.Tensor] = {
        "embed.weight": r.take("model.embed_tokens.weight", (vocab, d_model))
    }
    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    for i in range(n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        projections = {
            "attn.q": ("self_attn.q_proj", (q_out, d_model), qkv_bias),
            "attn.k": ("self_attn.k_proj", (kv_out, d_model), qkv_bias),
            "attn.v": ("self_attn.v_proj", (kv_out, d_model), qkv_bias),
            "attn.o": ("self_attn.o_proj", (d_model, q_out), out_bias),
            "mlp.gate": ("mlp.gate_proj", (inter, d_model), mlp_bias),
            "mlp.up": ("mlp.up_proj", (inter, d_model), mlp_bias),
            "mlp.down": ("mlp.down_proj", (d_model, inter), mlp_bias),
        }
        for name, (hf_name, shape, has_bias) in projections.items():
            w[dst + name + ".weight"] = r.take(src + hf_name + ".weight", shape)
            if has_bias:
                w[dst + name + ".bias"] = r.take(src + hf_name + ".bias", (shape[0],))
        w[dst + "input_norm.weight"] = r.take(src + "input_layernorm.weight", (d_model,))
        w[dst + "post_attn_norm.weight"] = r.take(
            src + "post_attention_layernorm.weight", (d_model,)
        )
    w["final_norm.weight"] = r.take("model.norm.weight", (d_model,))
    if tied:
        if "lm_head.weight" in state_dict:
            # transformers lists the tied head under its own name; it must be the same table.
            if not torch.equal(
                state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]
            ):
                raise InputError(
                    "config.tie_word_embeddings is true but tensor 'lm_head.weight' differs "
                    "from 'model.embed_tokens.weight'"
                )
            r.skip("lm_head.weight")
    else:
        w["lm_head.weight"] = r.take("lm_head.weight", (vocab, d_model))
    r.finish()
    return CanonicalModel(spec=spec, weights=w)
