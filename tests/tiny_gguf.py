"""Tiny decoder GGUF files written with the `gguf` library, as llama.cpp's converter writes them.

Tensor names come from gguf's own name map (``get_tensor_name_map``, the table llama.cpp's
``convert_hf_to_gguf.py`` and transformers' GGUF loader both use); Llama's q/k rows are
interleaved (llama.cpp's ``permute``), Gemma's ``(1 + w)`` norm weights are stored as ``1 + w``
(llama.cpp adds the 1 when converting), matrices are Q8_0 and vectors F32. The metadata holds
what llama.cpp writes for a text decoder and no tokenizer (fixtures give token ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

# transformers model_type -> llama.cpp architecture (llama.cpp's name for each model).
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleaving for Llama (``LlamaModel.permute``)."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _metadata(writer: Any, config: Any) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    params = config.rope_parameters
    if config.model_type == "gemma3_text":
        writer.add_rope_freq_base(params["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(params["rope_theta"])


def write_decoder_gguf(model: nn.Module, path: Path, quantized: bool = True) -> Path:
    """Write ``model`` (a transformers ``*ForCausalLM``) as a GGUF file at ``path`` (matrices
    F32 instead of Q8_0 unless ``quantized``)."""
    from gguf import (
        MODEL_ARCH,
        MODEL_ARCH_NAMES,
        GGMLQuantizationType,
        GGUFWriter,
        get_tensor_name_map,
        quantize,
    )

    config = model.config
    arch_name = GGUF_ARCH[config.model_type]
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch_name)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch_name)
    _metadata(writer, config)
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        weights = tensor.detach().float().numpy()
        if arch == MODEL_ARCH.LLAMA and base.endswith("q_proj"):
            weights = _permute(weights, config.num_attention_heads)
        elif arch == MODEL_ARCH.LLAMA and base.endswith("k_proj"):
            weights = _permute(weights, config.num_key_value_heads)
        if arch == MODEL_ARCH.GEMMA3 and "norm" in base:
            weights = weights + 1.0
        name = f"{names.get_name(base)}.{suffix}"
        if quantized and weights.ndim == 2 and weights.shape[1] % 32 == 0:
            writer.add_tensor(
                name,
                quantize(weights, GGMLQuantizationType.Q8_0),
                raw_dtype=GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(name, np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
