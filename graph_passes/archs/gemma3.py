"""Gemma 3 (text): ``Gemma3ForCausalLM`` / ``gemma3_text``.

Embeddings times sqrt(D) (also in the table a host gathers from; the tied LM head reads the
raw table); ``(1 + w)`` RMSNorm everywhere; four norms per layer: before and after the
attention, before and after the MLP (placement "both": ``post_attention_layernorm`` is the
norm of the attention *output*, not Llama's pre-MLP norm); GeGLU with tanh GELU
(``gelu_pytorch_tanh``); per-head ``(1 + w)`` q/k norms; scores scaled by
``query_pre_attn_scalar ** -0.5``; MQA / GQA; per ``layer_types`` either a causal sliding
window (transformers' exclusive ``q - window < k <= q``) with the local RoPE theta, or global
attention with the global theta.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value, layer_types, refuse_set, rope_parameters
from graph_passes.archs.decoders import QK_NORM_ROWS, map_decoder, read_shape
from graph_passes.archs.registry import Architecture
from graph_passes.archs.table import Row
from graph_passes.errors import InputError
from graph_passes.spec import AttentionSpec, CanonicalModel, LayerSpec, MlpSpec, NormSpec

L = "model.layers.{i}."
TABLE: tuple[Row, ...] = (
    Row("embed", "model.embed_tokens", ("V", "D")),
    Row("layers.{i}.attn_norm", L + "input_layernorm", ("D",)),
    Row("layers.{i}.attn.q", L + "self_attn.q_proj", ("Q", "D"), bias="bias"),
    Row("layers.{i}.attn.k", L + "self_attn.k_proj", ("KV", "D"), bias="bias"),
    Row("layers.{i}.attn.v", L + "self_attn.v_proj", ("KV", "D"), bias="bias"),
    Row("layers.{i}.attn.o", L + "self_attn.o_proj", ("D", "Q"), bias="bias"),
    *QK_NORM_ROWS,
    Row("layers.{i}.attn_out_norm", L + "post_attention_layernorm", ("D",)),
    Row("layers.{i}.mlp_norm", L + "pre_feedforward_layernorm", ("D",)),
    Row("layers.{i}.mlp.gate", L + "mlp.gate_proj", ("I", "D")),
    Row("layers.{i}.mlp.up", L + "mlp.up_proj", ("I", "D")),
    Row("layers.{i}.mlp.down", L + "mlp.down_proj", ("D", "I")),
    Row("layers.{i}.mlp_out_norm", L + "post_feedforward_layernorm", ("D",)),
    Row("final_norm", "model.norm", ("D",)),
    Row("lm_head", "lm_head", ("V", "D"), when="untied"),
)

_LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``Gemma3TextConfig`` and ``Gemma3ForCausalLM`` state dict."""
    refuse_set(config, "use_bidirectional_attention", "bidirectional attention")
    refuse_set(config, "attn_logit_softcapping", "attention logit soft-capping")
    refuse_set(config, "final_logit_softcapping", "final logit soft-capping")
    activation = config_value(config, "hidden_activation")
    if activation not in _ACTIVATIONS:
        raise InputError(
            f"config.hidden_activation = {activation!r}: only {sorted(_ACTIVATIONS)} are "
            "implemented"
        )
    shape = read_shape(config)
    bias = bool(config_value(config, "attention_bias", False))
    norm = NormSpec(kind="rms", eps=shape.eps, weight_offset=1.0)  # Gemma3RMSNorm: 1 + w
    params = config_value(config, "rope_parameters")
    if not isinstance(params, Mapping):
        raise InputError("config.rope_parameters: expected one entry per layer type")
    window = int(config_value(config, "sliding_window"))
    layers = []
    for layer_type in layer_types(config, shape.layers, _LAYER_TYPES):
        entry = params.get(layer_type)
        if not isinstance(entry, Mapping):
            raise InputError(f"config.rope_parameters[{layer_type!r}]: missing")
        sliding = layer_type == "sliding_attention"
        attention = AttentionSpec(
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            rope_theta=rope_parameters(entry, f"rope_parameters[{layer_type!r}]"),
            qkv_bias=bias,
            out_bias=bias,
            window=window if sliding else None,
            window_rule="causal-exclusive",
            scale=float(config_value(config, "query_pre_attn_scalar")) ** -0.5,
            qk_norm=norm,
        )
        mlp = MlpSpec(
            kind="geglu",
            intermediate_size=shape.intermediate,
            activation=_ACTIVATIONS[activation],  # type: ignore[arg-type]
        )
        layers.append(
            LayerSpec(
                attention=attention,
                mlp=mlp,
                attention_norm=norm,
                mlp_norm=norm,
                placement="both",
                attention_out_norm=norm,
                mlp_out_norm=norm,
            )
        )
    return map_decoder(
        state_dict,
        architecture="gemma3",
        shape=shape,
        table=TABLE,
        flags={"bias": bias},
        layers=layers,
        final_norm=norm,
        embed_scale=shape.hidden**0.5,  # transformers: hidden_size ** 0.5, as an fp32 tensor
    )


ARCH = Architecture(
    name="gemma3",
    family="decoder",
    model_types=("gemma3_text",),
    classes=("Gemma3ForCausalLM",),
    tasks=("text-generation",),
    refuses=(
        "hidden_activation other than gelu_pytorch_tanh / gelu",
        "RoPE scaling in rope_parameters (the 4B+ checkpoints' linear scaling)",
        "attn_logit_softcapping, final_logit_softcapping",
        "use_bidirectional_attention",
        "layer_types other than sliding_attention / full_attention",
    ),
    adapt=adapt,
)
