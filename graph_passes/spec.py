"""The one model description that every architecture file produces and the BC1L block runs.

An architecture file (`graph_passes.archs`) reads a Hugging Face config object and state dict
and returns a `CanonicalModel` (decoders) or an `EncoderModel` (encoders): plain dataclasses for
the structure plus a dict of weights under canonical names. Decoders and encoders share the
layer description (`LayerSpec`: norms with their kind, scaling and placement; attention with its
heads, RoPE, q/k norms, window and scale; the MLP with its activation and gating), and one
BC1L block (`graph_passes.model.Block`) runs it. Nothing in here depends on the source
architecture.

Canonical weight names (per layer ``i``), shared by decoders and encoders::

    layers.i.attn_norm.weight         (D,)          absent for an identity norm
    layers.i.attn.{q,k,v}.weight      (out, D)      .bias when the spec says so
    layers.i.attn.{q,k}_norm.weight   (head_dim,)   per-head q/k norms (Qwen3, Gemma 3)
    layers.i.attn.o.weight            (D, H*d)      .bias when the spec says so
    layers.i.attn_out_norm.weight     (D,)          placement "both": norm of the attention output
    layers.i.mlp_norm.weight          (D,)
    layers.i.mlp.{gate,up}.weight     (I, D)        gated MLPs: ``down(act(gate) * up)``
    layers.i.mlp.up.weight            (I, D)        plain MLP (BERT): ``down(act(up))``
    layers.i.mlp.down.weight          (D, I)
    layers.i.mlp_out_norm.weight      (D,)          placement "both": norm of the MLP output

Decoders add::

    embed.weight                      (vocab, D)    unscaled; `TransformerSpec.embed_scale`
    final_norm.weight                 (D,)
    lm_head.weight                    (vocab, D)    absent when embeddings are tied
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

NormKind = Literal["rms", "layer"]
# swiglu: down(silu(gate) * up); geglu: down(gelu(gate) * up) (ModernBERT: exact GELU on the
# first half of its fused D -> 2I projection; Gemma: tanh GELU); gelu: down(gelu(up)) (BERT).
MlpKind = Literal["swiglu", "gelu", "geglu"]
# The activation exactly: "gelu" is the erf GELU, "gelu_tanh" transformers' gelu_pytorch_tanh.
# "silu_mul_sigmoid" is SiLU spelled x * sigmoid(x): the same function, and a program with a
# sigmoid and a mul where "silu" gives one silu op (recipe silu_form: mul-sigmoid).
Activation = Literal["silu", "gelu", "gelu_tanh", "silu_mul_sigmoid"]
# pre:  h = x + attn(attn_norm(x)), out = h + mlp(mlp_norm(h))  (Llama, Qwen, ModernBERT)
# post: h = attn_norm(x + attn(x)), out = mlp_norm(h + mlp(h))  (BERT)
# both: h = x + attn_out_norm(attn(attn_norm(x))), out = h + mlp_out_norm(mlp(mlp_norm(h)))
#       (Gemma 2/3: four norms per layer; the out-norms read the branch output, not the stream)
NormPlacement = Literal["pre", "post", "both"]
# Which keys a local (sliding-window) layer sees from query q; both conventions exist:
# "symmetric-inclusive": abs(q - k) <= window (transformers' bidirectional ModernBERT mask);
# "causal-exclusive":   q - window < k <= q   (transformers' causal sliding window, Gemma 3).
WindowRule = Literal["symmetric-inclusive", "causal-exclusive"]

_DEFAULT_ACTIVATION: dict[str, Activation] = {"swiglu": "silu", "gelu": "gelu", "geglu": "gelu"}


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
class RopeScaling:
    """Llama 3.x frequency rescaling (``rope_type: llama3``): wavelengths above
    ``original / low_freq_factor`` are slowed by ``factor``, those below ``original /
    high_freq_factor`` kept, and those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    kind: Literal["llama3"] = "llama3"


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
    # Local attention: which keys are visible is `window_rule`'s; None = global.
    window: int | None = None
    window_rule: WindowRule = "symmetric-inclusive"
    # Scores are (q . k) * scale; None = 1 / sqrt(head_dim). Gemma: query_pre_attn_scalar^-0.5.
    scale: float | None = None
    # Per-head norm of q and of k (over head_dim channels), before RoPE (Qwen3, Gemma 3).
    qk_norm: NormSpec | None = None
    # Channels of each head that RoPE rotates (partial rotary); None = all of head_dim.
    rotary_dim: int | None = None
    # RoPE frequency rescaling; None = plain RoPE with rope_theta.
    rope_scaling: RopeScaling | None = None

    @property
    def score_scale(self) -> float:
        """The factor on q . k: `scale`, or 1 / sqrt(head_dim)."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def rotary_channels(self) -> int:
        """Channels per head that RoPE rotates (even; the rest pass through)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

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
    # None: the kind's own (silu for swiglu, exact GELU for gelu and geglu).
    activation: Activation | None = None

    @property
    def act(self) -> Activation:
        """The activation function, exactly."""
        return self.activation or _DEFAULT_ACTIVATION[self.kind]

    @property
    def gated(self) -> bool:
        """True for ``down(act(gate) * up)``, False for ``down(act(up))``."""
        return self.kind != "gelu"


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer, decoder or encoder, in one of the `NormPlacement` forms.

    ``attention_norm`` of None is the identity (ModernBERT's first layer). The out-norms are
    set exactly when the placement is ``both``.
    """

    attention: AttentionSpec
    mlp: MlpSpec
    attention_norm: NormSpec | None
    mlp_norm: NormSpec
    placement: NormPlacement = "pre"
    attention_out_norm: NormSpec | None = None
    mlp_out_norm: NormSpec | None = None

    def __post_init__(self) -> None:
        has_out = (self.attention_out_norm is not None, self.mlp_out_norm is not None)
        if has_out != ((self.placement == "both"),) * 2:
            raise ValueError(f"placement {self.placement!r}: out-norms {has_out} do not fit")

    @property
    def input_norm(self) -> NormSpec:
        """The norm before attention (a decoder's ``input_layernorm``)."""
        if self.attention_norm is None:
            raise ValueError("this layer has an identity attention norm")
        return self.attention_norm

    @property
    def post_attention_norm(self) -> NormSpec:
        """The norm before the MLP (a Llama decoder's ``post_attention_layernorm``)."""
        return self.mlp_norm


# Encoders share the layer description.
EncoderLayerSpec = LayerSpec


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer with an LM head."""

    architecture: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    final_norm: NormSpec
    tied_embeddings: bool
    # Embedding rows are multiplied by this (Gemma: sqrt(D)); the LM head reads the raw table.
    embed_scale: float = 1.0
    # The residual stream is carried as this power of two times the checkpoint's (folded into
    # the weights and norms by `graph_passes.stream_scale`; 1 for the checkpoint as read).
    stream_scale: float = 1.0

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
#     layers.i.*                        the shared layer names above, with .bias where the
#                                       spec has biases (LayerNorm biases included)
#     final_norm.weight / .bias         (D,)            pre-norm models only
#     head.dense.weight / .bias         (D, D)          BERT pooler / ModernBERT head dense
#     head.norm.weight / .bias          (D,)            ModernBERT head norm
#     head.classifier.weight / .bias    (labels, D)

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
