"""What Llama-style decoders share: their config reading and their weight-mapping table.

Llama, Qwen2, Qwen3 and Gemma 3 name their tensors the same way (``model.layers.{i}.self_attn
.q_proj``, ...); each architecture file picks the rows it has (biases, q/k norms, four norms)
and builds its layer description; `map_decoder` maps the weights and checks the tied head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from graph_passes.archs.config import config_value
from graph_passes.archs.table import Flag, Row, Skip, map_weights
from graph_passes.archs.weights import WeightReader
from graph_passes.errors import InputError
from graph_passes.spec import CanonicalModel, LayerSpec, NormSpec, TransformerSpec

L = "model.layers.{i}."

# Rows every Llama-style decoder has. Flags: qkv_bias, out_bias, mlp_bias, untied.
LLAMA_ROWS: tuple[Row | Skip, ...] = (
    Row("embed", "model.embed_tokens", ("V", "D")),
    Row("layers.{i}.attn_norm", L + "input_layernorm", ("D",)),
    Row("layers.{i}.attn.q", L + "self_attn.q_proj", ("Q", "D"), bias="qkv_bias"),
    Row("layers.{i}.attn.k", L + "self_attn.k_proj", ("KV", "D"), bias="qkv_bias"),
    Row("layers.{i}.attn.v", L + "self_attn.v_proj", ("KV", "D"), bias="qkv_bias"),
    Row("layers.{i}.attn.o", L + "self_attn.o_proj", ("D", "Q"), bias="out_bias"),
    Row("layers.{i}.mlp_norm", L + "post_attention_layernorm", ("D",)),
    Row("layers.{i}.mlp.gate", L + "mlp.gate_proj", ("I", "D"), bias="mlp_bias"),
    Row("layers.{i}.mlp.up", L + "mlp.up_proj", ("I", "D"), bias="mlp_bias"),
    Row("layers.{i}.mlp.down", L + "mlp.down_proj", ("D", "I"), bias="mlp_bias"),
    Row("final_norm", "model.norm", ("D",)),
    Row("lm_head", "lm_head", ("V", "D"), when="untied"),
)

# Per-head RMSNorm of q and k over head_dim channels (Qwen3, Gemma 3).
QK_NORM_ROWS: tuple[Row, ...] = (
    Row("layers.{i}.attn.q_norm", L + "self_attn.q_norm", ("head_dim",)),
    Row("layers.{i}.attn.k_norm", L + "self_attn.k_norm", ("head_dim",)),
)


@dataclass(frozen=True)
class DecoderShape:
    """The sizes a Llama-style config gives."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    eps: float
    tied: bool

    def dims(self) -> dict[str, int]:
        """Dimension names for the weight tables."""
        return {
            "D": self.hidden,
            "V": self.vocab,
            "I": self.intermediate,
            "Q": self.heads * self.head_dim,
            "KV": self.kv_heads * self.head_dim,
            "head_dim": self.head_dim,
        }


def read_shape(config: object) -> DecoderShape:
    """The sizes of a Llama-style config, checked for what the BC1L block needs."""
    d_model = int(config_value(config, "hidden_size"))
    n_heads = int(config_value(config, "num_attention_heads"))
    n_kv = int(config_value(config, "num_key_value_heads", n_heads) or n_heads)
    head_dim = int(config_value(config, "head_dim", None) or d_model // n_heads)
    if n_heads % n_kv:
        raise InputError(
            f"config.num_key_value_heads = {n_kv} does not divide num_attention_heads = {n_heads}"
        )
    if head_dim % 2:
        raise InputError(f"config.head_dim = {head_dim}: split-half RoPE needs an even head_dim")
    return DecoderShape(
        hidden=d_model,
        heads=n_heads,
        kv_heads=n_kv,
        head_dim=head_dim,
        intermediate=int(config_value(config, "intermediate_size")),
        vocab=int(config_value(config, "vocab_size")),
        layers=int(config_value(config, "num_hidden_layers")),
        eps=float(config_value(config, "rms_norm_eps")),
        tied=bool(config_value(config, "tie_word_embeddings", False)),
    )


def refuse_sliding_layers(config: object) -> None:
    """Refuse sliding-window layers by their effect: transformers applies a window only to
    layers whose ``layer_types`` entry says so (``use_sliding_window`` alone is not enough)."""
    types: list[str] = list(config_value(config, "layer_types") or [])
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise InputError(
            f"config.layer_types: layers {sliding} use sliding-window attention "
            f"(sliding_window = {config_value(config, 'sliding_window')}); not implemented"
        )


def map_decoder(
    state_dict: Mapping[str, torch.Tensor],
    *,
    architecture: str,
    shape: DecoderShape,
    table: Sequence[Row | Skip],
    flags: Mapping[str, Flag],
    layers: Sequence[LayerSpec],
    final_norm: NormSpec,
    embed_scale: float = 1.0,
) -> CanonicalModel:
    """Map a ``*ForCausalLM`` state dict through ``table`` into a `CanonicalModel`."""
    spec = TransformerSpec(
        architecture=architecture,
        hidden_size=shape.hidden,
        vocab_size=shape.vocab,
        layers=tuple(layers),
        final_norm=final_norm,
        tied_embeddings=shape.tied,
        embed_scale=embed_scale,
    )
    reader = WeightReader(state_dict, architecture)
    weights = map_weights(
        table,
        reader,
        dims=shape.dims(),
        flags={**flags, "untied": not shape.tied},
        num_layers=shape.layers,
    )
    if shape.tied and "lm_head.weight" in state_dict:
        # transformers lists the tied head under its own name; it must be the same table.
        if not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]):
            raise InputError(
                "config.tie_word_embeddings is true but tensor 'lm_head.weight' differs "
                "from 'model.embed_tokens.weight'"
            )
        reader.skip("lm_head.weight")
    reader.finish()
    return CanonicalModel(spec=spec, weights=weights)
