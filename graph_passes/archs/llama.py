"""Llama (SmolLM2, Llama 2 / 3 / 3.x): pre-norm RMSNorm, RoPE (with Llama 3.x frequency
rescaling, ``rope_type: llama3``), GQA, SwiGLU, optional biases."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value, require, rope_with_llama3
from graph_passes.archs.decoders import LLAMA_ROWS, map_decoder, read_shape
from graph_passes.archs.registry import Architecture
from graph_passes.spec import AttentionSpec, CanonicalModel, LayerSpec, MlpSpec, NormSpec


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``LlamaConfig`` and ``LlamaForCausalLM`` state dict."""
    require(config, "hidden_act", "silu", "the MLP activation")
    shape = read_shape(config)
    attention_bias = bool(config_value(config, "attention_bias", False))
    mlp_bias = bool(config_value(config, "mlp_bias", False))
    norm = NormSpec(kind="rms", eps=shape.eps)
    theta, scaling = rope_with_llama3(config)
    attention = AttentionSpec(
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rope_theta=theta,
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        rope_scaling=scaling,
    )
    mlp = MlpSpec(kind="swiglu", intermediate_size=shape.intermediate, bias=mlp_bias)
    layer = LayerSpec(attention=attention, mlp=mlp, attention_norm=norm, mlp_norm=norm)
    return map_decoder(
        state_dict,
        architecture="llama",
        shape=shape,
        table=LLAMA_ROWS,
        flags={"qkv_bias": attention_bias, "out_bias": attention_bias, "mlp_bias": mlp_bias},
        layers=[layer] * shape.layers,
        final_norm=norm,
    )


ARCH = Architecture(
    name="llama",
    family="decoder",
    model_types=("llama",),
    classes=("LlamaForCausalLM",),
    tasks=("text-generation",),
    refuses=(
        "hidden_act other than silu",
        "RoPE scaling other than llama3 (linear, dynamic, yarn, longrope, ...)",
        "num_key_value_heads not dividing num_attention_heads; odd head_dim",
    ),
    adapt=adapt,
)
