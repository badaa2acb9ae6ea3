"""The canonical transformer description that every adapter produces and the BC1L module runs.

An adapter reads a Hugging Face config object and state dict and returns a `CanonicalModel`:
plain dataclasses for the structure plus a dict of weights under canonical names. Nothing in
here depends on the source architecture; one BC1L implementation runs any such description.

Canonical weight names (per layer ``i``)::

    embed.weight                      (vocab, D)
    layers.i.input_norm.weight        (D,)
    layers.i.attn.{q,k,v}.weight      (out, D)      .bias when the spec says so
    layers.i.attn.o.weight            (D, H*d)      .bias when the spec says so
    layers.i.post_attn_norm.weight    (D,)
    layers.i.mlp.{gate,up}.weight     (I, D)
    layers.i.mlp.down.weight          (D, I)
    final_norm.weight                 (D,)
    lm_head.weight                    (vocab, D)    absent when embeddings are tied
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

NormKind = Literal["rms"]
MlpKind = Literal["swiglu"]


@dataclass(frozen=True)
class NormSpec:
    """A normalisation exactly as the checkpoint defines it."""

    kind: NormKind
    eps: float
    # Gemma-style checkpoints multiply by (offset + w); Llama and Qwen2 use offset 0.
    weight_offset: float = 0.0


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention of one layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    qkv_bias: bool
    out_bias: bool
    causal: bool = True

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA): query head h reads kv head h // group_size."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class MlpSpec:
    """The feed-forward block."""

    kind: MlpKind
    intermediate_size: int
    bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm transformer layer: x + attn(norm(x)), then h + mlp(norm(h))."""

    attention: AttentionSpec
    mlp: MlpSpec
    input_norm: NormSpec
    post_attention_norm: NormSpec


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer with an LM head."""

    architecture: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    final_norm: NormSpec
    tied_embeddings: bool

    @property
    def num_layers(self) -> int:
        """Number of transformer layers."""
        return len(self.layers)


@dataclass
class CanonicalModel:
    """A spec plus its weights under canonical names (see the module docstring)."""

    spec: TransformerSpec
    weights: dict[str, torch.Tensor] = field(repr=False)

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head matrix (vocab, D): the embedding table when tied."""
        if self.spec.tied_embeddings:
            return self.weights["embed.weight"]
        return self.weights["lm_head.weight"]
