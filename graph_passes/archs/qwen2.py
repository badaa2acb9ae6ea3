"""Qwen2 / Qwen2.5: a Llama-style decoder with biases on q, k and v (not on o)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import require, rope_theta
from graph_passes.archs.decoders import LLAMA_ROWS, map_decoder, read_shape, refuse_sliding_layers
from graph_passes.archs.registry import Architecture
from graph_passes.spec import AttentionSpec, CanonicalModel, LayerSpec, MlpSpec, NormSpec


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``Qwen2Config`` and ``Qwen2ForCausalLM`` state dict."""
    refuse_sliding_layers(config)
    require(config, "hidden_act", "silu", "the MLP activation")
    shape = read_shape(config)
    norm = NormSpec(kind="rms", eps=shape.eps)
    attention = AttentionSpec(
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rope_theta=rope_theta(config),
        qkv_bias=True,
        out_bias=False,
    )
    mlp = MlpSpec(kind="swiglu", intermediate_size=shape.intermediate)
    layer = LayerSpec(attention=attention, mlp=mlp, attention_norm=norm, mlp_norm=norm)
    return map_decoder(
        state_dict,
        architecture="qwen2",
        shape=shape,
        table=LLAMA_ROWS,
        flags={"qkv_bias": True, "out_bias": False, "mlp_bias": False},
        layers=[layer] * shape.layers,
        final_norm=norm,
    )


ARCH = Architecture(
    name="qwen2",
    family="decoder",
    model_types=("qwen2",),
    classes=("Qwen2ForCausalLM",),
    tasks=("text-generation",),
    refuses=(
        "sliding-window layers (layer_types 'sliding_attention')",
        "hidden_act other than silu",
        "rope_parameters / rope_scaling other than default RoPE",
    ),
    adapt=adapt,
)
