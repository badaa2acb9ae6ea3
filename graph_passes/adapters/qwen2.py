"""Qwen2 / Qwen2.5: biases on q, k and v (not on o); sliding-window attention is refused."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from converter.errors import InputError
from graph_passes.adapters.llama_family import config_value, map_decoder
from graph_passes.spec import CanonicalModel


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a transformers ``Qwen2Config`` and ``Qwen2ForCausalLM`` state dict."""
    # Judge the sliding window by its effect: transformers applies it only to layers whose
    # layer_types entry says so (use_sliding_window alone is not enough in transformers 5).
    layer_types: list[str] = list(config_value(config, "layer_types") or [])
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if sliding:
        raise InputError(
            f"config.layer_types: layers {sliding} use sliding-window attention "
            f"(sliding_window = {config_value(config, 'sliding_window')}); not implemented"
        )
    return map_decoder(
        config,
        state_dict,
        architecture="qwen2",
        qkv_bias=True,
        out_bias=False,
        mlp_bias=False,
    )
