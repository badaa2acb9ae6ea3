"""BERT (and MiniLM, all-MiniLM-L6-v2): post-LN, LayerNorm with bias, absolute positions and
token types, exact-GELU MLP, biases everywhere; ``BertModel`` or ``BertForSequenceClassification``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value
from graph_passes.archs.encoders import label_names, model_prefix, require_exact_gelu
from graph_passes.archs.registry import Architecture
from graph_passes.archs.table import Row, Skip, map_weights
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

E = "{p}embeddings."
L = "{p}encoder.layer.{i}."
TABLE: tuple[Row | Skip, ...] = (
    Row("embed.word", E + "word_embeddings", ("V", "D")),
    Row("embed.position", E + "position_embeddings", ("P", "D")),
    Row("embed.type", E + "token_type_embeddings", ("T", "D")),
    Row("embed.norm", E + "LayerNorm", ("D",), bias=True),
    Skip(E + "position_ids"),  # index buffers, not weights
    Skip(E + "token_type_ids"),
    Row("layers.{i}.attn.q", L + "attention.self.query", ("D", "D"), bias=True),
    Row("layers.{i}.attn.k", L + "attention.self.key", ("D", "D"), bias=True),
    Row("layers.{i}.attn.v", L + "attention.self.value", ("D", "D"), bias=True),
    Row("layers.{i}.attn.o", L + "attention.output.dense", ("D", "D"), bias=True),
    Row("layers.{i}.attn_norm", L + "attention.output.LayerNorm", ("D",), bias=True),
    Row("layers.{i}.mlp.up", L + "intermediate.dense", ("I", "D"), bias=True),
    Row("layers.{i}.mlp.down", L + "output.dense", ("D", "I"), bias=True),
    Row("layers.{i}.mlp_norm", L + "output.LayerNorm", ("D",), bias=True),
    # BertForSequenceClassification: CLS row -> pooler dense + tanh -> classifier.
    Row("head.dense", "{p}pooler.dense", ("D", "D"), bias=True, when="classifier"),
    Row("head.classifier", "classifier", ("labels", "D"), bias=True, when="classifier"),
    # BertModel's pooler (CLS dense + tanh) is not part of feature extraction or of mean
    # pooled sentence embeddings (sentence-transformers never calls it): unused by design.
    Skip("{p}pooler.dense.weight", when="no_classifier"),
    Skip("{p}pooler.dense.bias", when="no_classifier"),
)


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> EncoderModel:
    """Map a transformers ``BertConfig`` and a ``BertModel`` / ``BertFor*`` state dict."""
    require_exact_gelu(config, "hidden_act")
    position_kind = config_value(config, "position_embedding_type", "absolute")
    if position_kind != "absolute":
        raise InputError(
            f"config.position_embedding_type = {position_kind!r}: only 'absolute' is implemented"
        )
    if config_value(config, "is_decoder", False) or config_value(config, "add_cross_attention"):
        raise InputError("config.is_decoder: BERT as a decoder is not implemented")
    d_model = int(config_value(config, "hidden_size"))
    n_heads = int(config_value(config, "num_attention_heads"))
    if d_model % n_heads:
        raise InputError(f"config.hidden_size = {d_model} is not a multiple of the head count")
    n_layers = int(config_value(config, "num_hidden_layers"))
    dims = {
        "D": d_model,
        "V": int(config_value(config, "vocab_size")),
        "I": int(config_value(config, "intermediate_size")),
        "P": int(config_value(config, "max_position_embeddings")),
        "T": int(config_value(config, "type_vocab_size")),
    }
    norm = NormSpec(kind="layer", eps=float(config_value(config, "layer_norm_eps")), bias=True)
    attn = AttentionSpec(
        num_heads=n_heads,
        num_kv_heads=n_heads,
        head_dim=d_model // n_heads,
        rope_theta=0.0,
        qkv_bias=True,
        out_bias=True,
        causal=False,
        rope=False,
    )
    layer = LayerSpec(
        attention=attn,
        mlp=MlpSpec(kind="gelu", intermediate_size=dims["I"], bias=True),
        placement="post",
        attention_norm=norm,
        mlp_norm=norm,
    )
    prefix = model_prefix(state_dict, "embeddings.word_embeddings.weight", ("", "bert."))
    classifier = None
    if "classifier.weight" in state_dict:
        classifier = ClassifierSpec(
            pooling="cls", dense_bias=True, activation="tanh", norm=None, labels=label_names(config)
        )
        dims["labels"] = classifier.num_labels
    spec = EncoderSpec(
        architecture="bert",
        hidden_size=d_model,
        embedding=EmbeddingSpec(
            vocab_size=dims["V"],
            max_positions=dims["P"],
            type_vocab_size=dims["T"],
            norm=norm,
            pad_token_id=int(config_value(config, "pad_token_id", 0) or 0),
        ),
        layers=tuple(layer for _ in range(n_layers)),
        final_norm=None,  # post-LN: every layer already ends in a norm
        classifier=classifier,
    )
    reader = WeightReader(state_dict, "bert")
    flags = {"classifier": classifier is not None, "no_classifier": classifier is None}
    weights = map_weights(TABLE, reader, dims=dims, flags=flags, num_layers=n_layers, prefix=prefix)
    reader.finish()
    return EncoderModel(spec=spec, weights=weights)


ARCH = Architecture(
    name="bert",
    family="encoder",
    model_types=("bert",),
    classes=("BertModel", "BertForSequenceClassification"),
    tasks=("feature-extraction", "sentence-similarity", "text-classification"),
    refuses=(
        "hidden_act other than the exact (erf) GELU",
        "position_embedding_type other than absolute",
        "is_decoder / add_cross_attention",
    ),
    adapt=adapt,
)
