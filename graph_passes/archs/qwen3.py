"""Qwen3 (dense): a Llama-style decoder with per-head RMSNorm on q and k.

``q = rope(q_norm(Wq x))`` per head over head_dim channels (likewise k), before RoPE; the head
dim is its own config value (Qwen3-0.6B: 16 heads of 128, a q width of 2048 against a hidden
width of 1024). Optional biases on q, k, v and o (``attention_bias``); no MLP bias.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value, require, rope_theta
from graph_passes.archs.decoders import (
    LLAMA_ROWS,
    QK_NORM_ROWS,
    map_decoder,
    read_shape,
    refuse_sliding_layers,
)
from graph_passes.archs.registry import Architecture
from graph_passes.spec import AttentionSpec, CanonicalModel, LayerSpec, MlpSpec, NormSpec


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``Qwen3Config`` and ``Qwen3ForCausalLM`` state dict."""
    refuse_sliding_layers(config)
    require(config, "hidden_act", "silu", "the MLP activation")
    shape = read_shape(config)
    bias = bool(config_value(config, "attention_bias", False))
    norm = NormSpec(kind="rms", eps=shape.eps)
    attention = AttentionSpec(
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rope_theta=rope_theta(config),
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=norm,  # Qwen3RMSNorm(head_dim, eps=rms_norm_eps): w, not 1 + w
    )
    mlp = MlpSpec(kind="swiglu", intermediate_size=shape.intermediate)
    layer = LayerSpec(attention=attention, mlp=mlp, attention_norm=norm, mlp_norm=norm)
    return map_decoder(
        state_dict,
        architecture="qwen3",
        shape=shape,
        table=LLAMA_ROWS + QK_NORM_ROWS,
        flags={"qkv_bias": bias, "out_bias": bias, "mlp_bias": False},
        layers=[layer] * shape.layers,
        final_norm=norm,
    )


ARCH = Architecture(
    name="qwen3",
    family="decoder",
    model_types=("qwen3",),
    classes=("Qwen3ForCausalLM",),
    tasks=("text-generation",),
    refuses=(
        "sliding-window layers (layer_types 'sliding_attention')",
        "hidden_act other than silu",
        "rope_parameters / rope_scaling other than default RoPE",
    ),
    adapt=adapt,
)
