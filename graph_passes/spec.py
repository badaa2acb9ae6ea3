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

NormKind = Literal["rms", "layer"]
# swiglu: down(silu(gate) * up); gelu: down(gelu(up)) (BERT); geglu: down(gelu(value) * gate)
# from one fused D -> 2I projection whose first half is the value (ModernBERT).
MlpKind = Literal["swiglu", "gelu", "geglu"]


@dataclass(frozen=True)
class NormSpec:
    """A normalisation exactly as the checkpoint defines it."""

    kind: NormKind
    eps: float
    # Gemma-style checkpoints multiply by (offset + w); Llama and Qwen2 use offset 0.
    weight_offset: float = 0.0
    # LayerNorm only: whether the checkpoint has a bias (beta); ModernBERT's norms have none.
    bias: bool = False


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
    # False for absolute-position models (BERT): no rotation, rope_theta is unused.
    rope: bool = True
    # Local attention: a key is visible iff abs(q - k) <= window (inclusive band); None = global.
    window: int | None = None

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


# ---- encoders (BERT, ModernBERT) ------------------------------------------------------------
#
# Canonical encoder weight names (per layer ``i``)::
#
#     embed.word.weight                 (vocab, D)
#     embed.position.weight             (positions, D)  absolute positions only (BERT)
#     embed.type.weight                 (types, D)      token types only (BERT)
#     embed.norm.weight / .bias         (D,)            .bias when the norm has one
#     layers.i.attn.{q,k,v,o}.weight    .bias when the spec says so
#     layers.i.attn_norm.weight / .bias absent for an identity norm (ModernBERT layer 0)
#     layers.i.mlp.up.weight / .bias    (I, D)          gelu MLP
#     layers.i.mlp.{value,gate}.weight  (I, D)          geglu MLP: the fused D->2I rows, split
#     layers.i.mlp.down.weight / .bias  (D, I)
#     layers.i.mlp_norm.weight / .bias  (D,)
#     final_norm.weight / .bias         (D,)            pre-norm models only
#     head.dense.weight / .bias         (D, D)          BERT pooler / ModernBERT head dense
#     head.norm.weight / .bias          (D,)            ModernBERT head norm
#     head.classifier.weight / .bias    (labels, D)

NormPlacement = Literal["pre", "post"]
Pooling = Literal["cls", "mean"]
HeadActivation = Literal["tanh", "gelu"]


@dataclass(frozen=True)
class EmbeddingSpec:
    """Token rows, plus absolute position and token-type rows where the checkpoint has them,
    summed and normalised (the norm reads the sum, or the token row alone without the extras)."""

    vocab_size: int
    max_positions: int  # 0: no absolute position table (RoPE models)
    type_vocab_size: int  # 0: no token-type table
    norm: NormSpec
    pad_token_id: int

    @property
    def norm_reads_token_row_alone(self) -> bool:
        """True when the embedding norm sees only the token row, so it may be pre-applied to the
        table offline (SPEC section 2); False when it reads word + position + type rows."""
        return self.max_positions == 0 and self.type_vocab_size == 0


@dataclass(frozen=True)
class EncoderLayerSpec:
    """One bidirectional layer, in one of two norm placements.

    ``pre``:  ``h = x + attn(attn_norm(x))``, ``out = h + mlp(mlp_norm(h))`` (ModernBERT; an
    ``attention_norm`` of None is the identity of its first layer);
    ``post``: ``h = attn_norm(x + attn(x))``, ``out = mlp_norm(h + mlp(h))`` (BERT).
    """

    attention: AttentionSpec
    mlp: MlpSpec
    placement: NormPlacement
    attention_norm: NormSpec | None
    mlp_norm: NormSpec


@dataclass(frozen=True)
class ClassifierSpec:
    """Sequence classification: pool, ``dense`` -> activation -> optional norm, classifier.

    BERT: CLS row, pooler dense + tanh, classifier. ModernBERT: CLS row or masked mean
    (``classifier_pooling``), head dense + GELU + LayerNorm, classifier.
    """

    pooling: Pooling
    dense_bias: bool
    activation: HeadActivation
    norm: NormSpec | None
    labels: tuple[str, ...]  # label names in logit order

    @property
    def num_labels(self) -> int:
        """Number of logits."""
        return len(self.labels)


@dataclass(frozen=True)
class EncoderSpec:
    """A bidirectional encoder: embeddings, layers, optional final norm and classifier."""

    architecture: str
    hidden_size: int
    embedding: EmbeddingSpec
    layers: tuple[EncoderLayerSpec, ...]
    final_norm: NormSpec | None
    classifier: ClassifierSpec | None

    @property
    def num_layers(self) -> int:
        """Number of transformer layers."""
        return len(self.layers)


@dataclass
class EncoderModel:
    """An encoder spec plus its weights under canonical names (see the encoder names above)."""

    spec: EncoderSpec
    weights: dict[str, torch.Tensor] = field(repr=False)
