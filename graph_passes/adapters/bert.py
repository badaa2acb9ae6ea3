"""BERT (and MiniLM, all-MiniLM-L6-v2): post-LN, LayerNorm with bias, absolute positions and
token types, exact-GELU MLP, biases everywhere; ``BertModel`` or ``BertForSequenceClassification``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from converter.errors import InputError
from graph_passes.adapters.encoder_common import label_names, model_prefix, require_exact_gelu
from graph_passes.adapters.llama_family import config_value
from graph_passes.adapters.weights import WeightReader
from graph_passes.spec import (
    AttentionSpec,
    ClassifierSpec,
    EmbeddingSpec,
    EncoderLayerSpec,
    EncoderModel,
    EncoderSpec,
    MlpSpec,
    NormSpec,
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
    head_dim = d_model // n_heads
    inter = int(config_value(config, "intermediate_size"))
    vocab = int(config_value(config, "vocab_size"))
    positions = int(config_value(config, "max_position_embeddings"))
    types = int(config_value(config, "type_vocab_size"))
    n_layers = int(config_value(config, "num_hidden_layers"))
    norm = NormSpec(kind="layer", eps=float(config_value(config, "layer_norm_eps")), bias=True)

    attn = AttentionSpec(
        num_heads=n_heads,
        num_kv_heads=n_heads,
        head_dim=head_dim,
        rope_theta=0.0,
        qkv_bias=True,
        out_bias=True,
        causal=False,
        rope=False,
    )
    layer = EncoderLayerSpec(
        attention=attn,
        mlp=MlpSpec(kind="gelu", intermediate_size=inter, bias=True),
        placement="post",
        attention_norm=norm,
        mlp_norm=norm,
    )
    p = model_prefix(state_dict, "embeddings.word_embeddings.weight", ("", "bert."))
    classifier = None
    if "classifier.weight" in state_dict:
        # BertForSequenceClassification: CLS row -> pooler dense + tanh -> classifier.
        classifier = ClassifierSpec(
            pooling="cls", dense_bias=True, activation="tanh", norm=None, labels=label_names(config)
        )
    spec = EncoderSpec(
        architecture="bert",
        hidden_size=d_model,
        embedding=EmbeddingSpec(
            vocab_size=vocab,
            max_positions=positions,
            type_vocab_size=types,
            norm=norm,
            pad_token_id=int(config_value(config, "pad_token_id", 0) or 0),
        ),
        layers=tuple(layer for _ in range(n_layers)),
        final_norm=None,  # post-LN: every layer already ends in a norm
        classifier=classifier,
    )

    r = WeightReader(state_dict, "bert")
    w: dict[str, torch.Tensor] = {}

    def take(dst: str, src: str, shape: tuple[int, ...], bias: bool = True) -> None:
        w[dst + ".weight"] = r.take(src + ".weight", shape)
        if bias:
            w[dst + ".bias"] = r.take(src + ".bias", (shape[0],))

    e = p + "embeddings."
    take("embed.word", e + "word_embeddings", (vocab, d_model), bias=False)
    take("embed.position", e + "position_embeddings", (positions, d_model), bias=False)
    take("embed.type", e + "token_type_embeddings", (types, d_model), bias=False)
    take("embed.norm", e + "LayerNorm", (d_model,))
    for name in ("position_ids", "token_type_ids"):  # index buffers, not weights
        r.skip(e + name)
    for i in range(n_layers):
        src, dst = f"{p}encoder.layer.{i}.", f"layers.{i}."
        for q in ("query", "key", "value"):
            take(dst + "attn." + q[0], src + "attention.self." + q, (d_model, d_model))
        take(dst + "attn.o", src + "attention.output.dense", (d_model, d_model))
        take(dst + "attn_norm", src + "attention.output.LayerNorm", (d_model,))
        take(dst + "mlp.up", src + "intermediate.dense", (inter, d_model))
        take(dst + "mlp.down", src + "output.dense", (d_model, inter))
        take(dst + "mlp_norm", src + "output.LayerNorm", (d_model,))
    if classifier is not None:
        take("head.dense", p + "pooler.dense", (d_model, d_model))
        take("head.classifier", "classifier", (classifier.num_labels, d_model))
    else:
        # BertModel's pooler (CLS dense + tanh) is not part of feature extraction or of mean
        # pooled sentence embeddings (sentence-transformers never calls it): unused by design.
        r.skip(p + "pooler.dense.weight")
        r.skip(p + "pooler.dense.bias")
    r.finish()
    return EncoderModel(spec=spec, weights=w)
