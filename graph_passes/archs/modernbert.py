"""ModernBERT (and mmBERT): pre-LN without norm biases, an identity norm before the first
layer, a final norm, fused Wqkv, a fused D->2I GeGLU MLP, and alternating global and local
attention, each layer type with its own RoPE theta; ``ModernBertModel`` or
``ModernBertForSequenceClassification`` (head dense + GELU + LayerNorm, CLS or mean pooling).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value, layer_types, rope_parameters
from graph_passes.archs.encoders import label_names, model_prefix, require_exact_gelu
from graph_passes.archs.registry import Architecture
from graph_passes.archs.table import Row, map_weights
from graph_passes.archs.weights import WeightReader
from graph_passes.errors import InputError
from graph_passes.spec import (
    AttentionSpec,
    ClassifierSpec,
    EmbeddingSpec,
    EncoderModel,
    EncoderSpec,
    LayerSpec,
    MlpSpec,
    NormSpec,
)

_LAYER_TYPES = ("full_attention", "sliding_attention")
L = "{p}layers.{i}."
TABLE: tuple[Row, ...] = (
    Row("embed.word", "{p}embeddings.tok_embeddings", ("V", "D")),
    Row("embed.norm", "{p}embeddings.norm", ("D",), bias="norm_bias"),
    # Wqkv rows are [q | k | v], each heads x head_dim (transformers views them as
    # (3, heads, head_dim)); split here, re-fused into one conv by the BC1L block.
    Row(
        ("layers.{i}.attn.q", "layers.{i}.attn.k", "layers.{i}.attn.v"),
        L + "attn.Wqkv",
        ("3D", "D"),
        bias="attn_bias",
    ),  # fmt: skip
    Row("layers.{i}.attn.o", L + "attn.Wo", ("D", "D"), bias="attn_bias"),
    # Layer 0's attention norm is nn.Identity: no tensor.
    Row("layers.{i}.attn_norm", L + "attn_norm", ("D",), bias="norm_bias", when="attn_norm"),
    Row("layers.{i}.mlp_norm", L + "mlp_norm", ("D",), bias="norm_bias"),
    # Wi rows are [input | gate]: transformers chunks them and applies the activation to the
    # first half, which is the canonical gate (the activated half).
    Row(("layers.{i}.mlp.gate", "layers.{i}.mlp.up"), L + "mlp.Wi", ("2I", "D"), bias="mlp_bias"),
    Row("layers.{i}.mlp.down", L + "mlp.Wo", ("D", "I"), bias="mlp_bias"),
    Row("final_norm", "{p}final_norm", ("D",), bias="norm_bias"),
    Row("head.dense", "head.dense", ("D", "D"), bias="dense_bias", when="classifier"),
    Row("head.norm", "head.norm", ("D",), bias="norm_bias", when="classifier"),
    Row("head.classifier", "classifier", ("labels", "D"), bias=True, when="classifier"),
)


def layer_theta(config: object, layer_type: str) -> float:
    """RoPE theta of one layer type, from the config object's ``rope_parameters``."""
    params = (config_value(config, "rope_parameters") or {}).get(layer_type)
    if not isinstance(params, Mapping):
        raise InputError(f"config.rope_parameters[{layer_type!r}]: no rope_theta given")
    return rope_parameters(params, f"rope_parameters[{layer_type!r}]")


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> EncoderModel:
    """Map a transformers ``ModernBertConfig`` and ``ModernBertModel`` / ``...ForSequence
    Classification`` state dict."""
    require_exact_gelu(config, "hidden_activation")
    d_model = int(config_value(config, "hidden_size"))
    n_heads = int(config_value(config, "num_attention_heads"))
    if d_model % n_heads or (d_model // n_heads) % 2:
        raise InputError(f"config.hidden_size = {d_model}: needs an even head_dim per head")
    inter = int(config_value(config, "intermediate_size"))
    n_layers = int(config_value(config, "num_hidden_layers"))
    norm_bias = bool(config_value(config, "norm_bias", False))
    attn_bias = bool(config_value(config, "attention_bias", False))
    mlp_bias = bool(config_value(config, "mlp_bias", False))
    norm = NormSpec(kind="layer", eps=float(config_value(config, "norm_eps")), bias=norm_bias)
    types = layer_types(config, n_layers, _LAYER_TYPES)
    # transformers' bidirectional sliding-window mask keeps abs(q - k) <= sliding_window, with
    # sliding_window = local_attention // 2 (64 for a local_attention of 128).
    window = int(config_value(config, "sliding_window"))
    layers = []
    for i, layer_type in enumerate(types):
        attn = AttentionSpec(
            num_heads=n_heads,
            num_kv_heads=n_heads,
            head_dim=d_model // n_heads,
            rope_theta=layer_theta(config, layer_type),
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            causal=False,
            window=window if layer_type == "sliding_attention" else None,
            window_rule="symmetric-inclusive",
        )
        layers.append(
            LayerSpec(
                attention=attn,
                mlp=MlpSpec(kind="geglu", intermediate_size=inter, bias=mlp_bias),
                placement="pre",
                attention_norm=None if i == 0 else norm,  # layer 0: nn.Identity
                mlp_norm=norm,
            )
        )
    prefix = model_prefix(state_dict, "embeddings.tok_embeddings.weight", ("", "model."))
    dims = {"D": d_model, "3D": 3 * d_model, "V": int(config_value(config, "vocab_size")),
            "I": inter, "2I": 2 * inter}  # fmt: skip
    classifier = _classifier(config, norm) if "classifier.weight" in state_dict else None
    if classifier is not None:
        dims["labels"] = classifier.num_labels
    spec = EncoderSpec(
        architecture="modernbert",
        hidden_size=d_model,
        embedding=EmbeddingSpec(
            vocab_size=dims["V"],
            max_positions=0,
            type_vocab_size=0,
            norm=norm,
            pad_token_id=int(config_value(config, "pad_token_id", 0) or 0),
        ),
        layers=tuple(layers),
        final_norm=norm,
        classifier=classifier,
    )
    reader = WeightReader(state_dict, "modernbert")
    weights = map_weights(
        TABLE,
        reader,
        dims=dims,
        flags={
            "norm_bias": norm_bias,
            "attn_bias": attn_bias,
            "mlp_bias": mlp_bias,
            "attn_norm": lambda i: i > 0,
            "classifier": classifier is not None,
            "dense_bias": classifier is not None and classifier.dense_bias,
        },
        num_layers=n_layers,
        prefix=prefix,
    )
    reader.finish()
    return EncoderModel(spec=spec, weights=weights)


def _classifier(config: object, norm: NormSpec) -> ClassifierSpec:
    """The sequence-classification head ``ModernBertForSequenceClassification`` adds."""
    require_exact_gelu(config, "classifier_activation")
    classifier = ClassifierSpec(
        pooling=config_value(config, "classifier_pooling"),
        dense_bias=bool(config_value(config, "classifier_bias", False)),
        activation="gelu",
        norm=norm,
        labels=label_names(config),
    )
    if classifier.pooling not in ("cls", "mean"):
        raise InputError(f"config.classifier_pooling = {classifier.pooling!r}")
    return classifier


ARCH = Architecture(
    name="modernbert",
    family="encoder",
    model_types=("modernbert",),
    classes=("ModernBertModel", "ModernBertForSequenceClassification"),
    tasks=("feature-extraction", "sentence-similarity", "text-classification"),
    refuses=(
        "hidden_activation / classifier_activation other than the exact (erf) GELU",
        "RoPE scaling in rope_parameters",
        "classifier_pooling other than cls or mean",
        "layer_types other than full_attention / sliding_attention",
    ),
    adapt=adapt,
)
