"""De-quantize a GGUF decoder's weights straight into its transformers model.

transformers' GGUF path (``from_pretrained(gguf_file=...)``) parses the whole header with
``gguf.GGUFReader`` for the config and again for the weights, decoding every metadata array
(the 49,152-entry vocabulary and its merges) each time, and maps tensor names by searching
gguf's name table for every parameter: most of SmolLM2's load time (cProfile of
``anec convert``: 55 of 108 s in the readers, 20 s in the name search, 4 s de-quantizing).
Here the header is read by ``converter.checkpoints.weightfiles.read_gguf`` (which skips the
arrays), each
tensor is de-quantized from the memory-mapped file by the same ``gguf.quants.dequantize``
transformers calls, and the same q/k row permutation is undone, so the weights are
bit-identical to transformers' (tests/test_gguf_weights.py).

Only the architectures in ``_LAYOUTS`` take this path; others go through transformers. Gemma's
norm weights, stored as ``1 + w`` by llama.cpp, get their 1 taken off as transformers does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.checkpoints.weightfiles import read_gguf

# GGUF name -> transformers name, outside the layers and per layer (``blk.N.<key>``).
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3's four norms a layer (gguf's name map): ffn_norm is the pre-MLP norm there.
_GEMMA3 = {
    **_LAYER,
    **_QK_NORMS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


@dataclass(frozen=True)
class Layout:
    """How llama.cpp stored one architecture's tensors."""

    layer: Mapping[str, str]  # GGUF per-layer name -> transformers name
    permuted: bool  # q and k rows interleaved (transformers' LlamaTensorProcessor undoes it)
    # Taken off every norm weight: Gemma's ``(1 + w)`` norms are stored as ``1 + w``
    # (transformers' Gemma2TensorProcessor subtracts 1 from every "norm.weight").
    norm_offset: float = 0.0


# GGUF architecture -> layout (qwen2 / qwen3 files are stored unpermuted).
_LAYOUTS = {
    "llama": Layout(_LAYER, permuted=True),
    "qwen2": Layout(_LAYER, permuted=False),
    "qwen3": Layout({**_LAYER, **_QK_NORMS}, permuted=False),
    "gemma3": Layout(_GEMMA3, permuted=False, norm_offset=1.0),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def supported(path: Path) -> bool:
    """True when this module can load the GGUF file's architecture."""
    return read_gguf(path).architecture in _LAYOUTS


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The transformers parameter name of a GGUF tensor (None: transformers skips it too)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    layer = _LAYOUTS[architecture].layer
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in layer:
        return f"model.layers.{match.group(1)}.{layer[match.group(2)]}"
    return None


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (transformers' ``_reverse_permute_weights``)."""
    dim = weights.shape[0] // heads // 2
    w = weights.reshape(heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _raw(
    file: np.ndarray, offset: int, nbytes: int, qtype: Any, shape: tuple[int, ...]
) -> np.ndarray:
    """A tensor's bytes typed and shaped as ``gguf.GGUFReader`` hands them to dequantize."""
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    plain = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8}
    plain |= {Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
    data = file[offset : offset + nbytes]
    if qtype in plain:
        return data.view(plain[qtype]).reshape(shape)
    return data.reshape(quant_shape_to_byte_shape(shape, qtype))


def read_state_dict(path: Path, config: Any) -> dict[str, torch.Tensor]:
    """Every tensor transformers would load from the GGUF file, de-quantized to fp32 and
    keyed by its transformers name (tensors it has no name for are skipped, as it does)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    table = read_gguf(path)
    architecture = str(table.architecture)
    layout = _LAYOUTS[architecture]
    permuted = layout.permuted
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state: dict[str, torch.Tensor] = {}
    file = np.memmap(path, dtype=np.uint8, mode="r")  # unmapped when the last view goes
    for info in table.tensors.values():
        name = hf_name(info.name, architecture)
        if name is None or info.offset is None:
            continue
        qtype = GGMLQuantizationType[info.dtype]
        weights = dequantize(_raw(file, info.offset, info.nbytes, qtype, info.shape), qtype)
        if permuted and ".attn_q." in info.name:
            weights = _unpermute(weights, heads)
        elif permuted and ".attn_k." in info.name:
            weights = _unpermute(weights, kv_heads)
        if layout.norm_offset and "norm.weight" in name:
            weights = weights - layout.norm_offset
        weights = np.asarray(weights, dtype=np.float32)
        if np.may_share_memory(weights, file):  # an fp32 tensor stored as it is
            weights = np.copy(weights)  # no tensor keeps the file mapped
        state[name] = torch.from_numpy(weights)
    return state


def load_model(path: Path, config: Any, model_class: Any) -> tuple[Any, dict[str, Any]]:
    """The fp32 model with the GGUF file's weights, and a loading report shaped like
    transformers' ``output_loading_info`` (for ``check_loading_info``)."""
    from transformers.initialization import no_init_weights

    state = read_state_dict(path, config)
    # Random initialisation of weights that the file then overwrites is skipped, as
    # transformers' own from_pretrained skips it: a parameter the file lacks is reported as
    # missing below and refused (check_loading_info). Buffers (RoPE frequencies) are still
    # computed. On SmolLM2 the initialisation was 58 of the 430 s that loading took in a
    # profile on the loaded machine.
    with no_init_weights():
        model = model_class.from_config(config, dtype=torch.float32)
    # init_weights ties the LM head to the embeddings, and no_init_weights skips it too.
    model.tie_weights()
    expected = model.state_dict()
    mismatched = [
        (name, tuple(t.shape), tuple(expected[name].shape))
        for name, t in state.items()
        if name in expected and t.shape != expected[name].shape
    ]
    unexpected = sorted(set(state) - set(expected))
    if mismatched or unexpected:
        info = {"missing_keys": set(), "unexpected_keys": set(unexpected)}
        return model, info | {"mismatched_keys": set(mismatched), "error_msgs": []}
    # assign: the model takes the de-quantized tensors themselves, so its own (never
    # touched, so never resident) parameters are dropped instead of being filled with a copy:
    # one fp32 checkpoint in memory, not two.
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # the LM head follows the embeddings it was tied to
    loaded = {t.data_ptr() for t in state.values()}
    after = model.state_dict()
    # A tied parameter (lm_head.weight = embed_tokens.weight) is loaded through its twin.
    missing = {n for n in result.missing_keys if after[n].data_ptr() not in loaded}
    info = {"missing_keys": missing, "unexpected_keys": set(), "mismatched_keys": set()}
    return model, info | {"error_msgs": []}
