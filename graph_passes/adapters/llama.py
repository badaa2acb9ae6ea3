"""Llama (SmolLM2, Llama 2/3 without RoPE scaling): optional attention and MLP biases."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.adapters.llama_family import config_value, map_decoder
from graph_passes.spec import CanonicalModel


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``LlamaConfig`` and ``LlamaForCausalLM`` state dict."""
    attention_bias = bool(config_value(config, "attention_bias", False))
    return map_decoder(
        config,
        state_dict,
        architecture="llama",
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        mlp_bias=bool(config_value(config, "mlp_bias", False)),
    )
