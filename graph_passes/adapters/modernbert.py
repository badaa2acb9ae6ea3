"""ModernBERT (and mmBERT): pre-LN without norm biases, an identity norm before the first
layer, a final norm, fused Wqkv, a fused D->2I GeGLU MLP, and alternating global and local
attention, each layer type with its own RoPE theta; ``ModernBertModel`` or
``ModernBertForSequenceClassification`` (head dense + GELU + LayerNorm, CLS or mean pooling).
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

_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_theta(config: object, layer_type: str) -> float:
    """RoPE theta of one layer type, from the config object's ``rope_parameters``."""
    params = (config_value(config, "rope_parameters") or {}).get(layer_type)
    if not isinstance(params, Mapping) or "rope_theta" not in params:
        raise InputError(f"config.rope_parameters[{layer_type!r}]: no rope_theta given")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise InputError(
            f"config.rope_parameters[{layer_type!r}].rope_type = {rope_type!r}: RoPE scaling "
            "is not implemented"
        )
    return float(params["rope_theta"])


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> EncoderModel:
    """Map a transformers ``ModernBertConfig`` and ``ModernBertModel`` / ``...ForSequence
    Classification`` state dict."""
    require_exact_gelu(config, "hidden_activation")
    d_model = int(config_value(config, "hidden_size"))
    n_heads = int(config_value(config, "num_attention_heads"))
    if d_model % n_heads or (d_model // n_heads) % 2:
        raise InputError(f"config.hidden_size = {d_model}: needs an even head_dim per head")
    head_dim = d_model // n_heads
    inter = int(config_value(config, "intermediate_size"))
    vocab = int(config_value(config, "vocab_size"))
    n_layers = int(config_value(config, "num_hidden_layers"))
    norm_bias = bool(config_value(config, "norm_bias", False))
    attn_bias = bool(config_value(config, "attention_bias", False))
    mlp_bias = bool(config_value(config, "mlp_bias", False))
    norm = NormSpec(kind="layer", eps=float(config_value(config, "norm_eps")), bias=norm_bias)
    layer_types = list(config_value(config, "layer_types") or [])
    if len(layer_types) != n_layers or set(layer_types) - set(_LAYER_TYPES):
        raise InputError(
            f"config.layer_types = {layer_types!r}: expected one of {_LAYER_TYPES} per layer"
        )
    # transformers' bidirectional sliding-window mask keeps abs(q - k) <= sliding_window, with
    # sliding_window = local_attention // 2 (64 for a local_attention of 128).
    window = int(config_value(config, "sliding_window"))

    layers = []
    for i, layer_type in enumerate(layer_types):
        attn = AttentionSpec(
            num_heads=n_heads,
            num_kv_heads=n_heads,
            head_dim=head_dim,
            rope_theta=layer_theta(config, layer_type),
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            causal=False,
            window=window if layer_type == "sliding_attention" else None,
        )
        layers.append(
            EncoderLayerSpec(
                attention=attn,
                mlp=MlpSpec(kind="geglu", intermediate_size=inter, bias=mlp_bias),
                placement="pre",
                attention_norm=None if i == 0 else norm,  # layer 0: nn.Identity
                mlp_norm=norm,
            )
        )
    p = model_prefix(state_dict, "embeddings.tok_embeddings.weight", ("", "model."))
    classifier = None
    if "classifier.weight" in state_dict:
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
    spec = EncoderSpec(
        architecture="modernbert",
        hidden_size=d_model,
        embedding=EmbeddingSpec(
            vocab_size=vocab,
            max_positions=0,
            type_vocab_size=0,
            norm=norm,
            pad_token_id=int(config_value(config, "pad_token_id", 0) or 0),
        ),
        layers=tuple(layers),
        final_norm=norm,
        classifier=classifier,
    )

    r = WeightReader(state_dict, "modernbert")
    w: dict[str, torch.Tensor] = {}

    def take_norm(dst: str, src: str) -> None:
        w[dst + ".weight"] = r.take(src + ".weight", (d_model,))
        if norm_bias:
            w[dst + ".bias"] = r.take(src + ".bias", (d_model,))

    w["embed.word.weight"] = r.take(p + "embeddings.tok_embeddings.weight", (vocab, d_model))
    take_norm("embed.norm", p + "embeddings.norm")
    for i in range(n_layers):
        src, dst = f"{p}layers.{i}.", f"layers.{i}."
        # Wqkv rows are [q | k | v], each heads x head_dim (transformers views them as
        # (3, heads, head_dim)); split here, re-fused into one conv by the BC1L module.
        qkv = r.take(src + "attn.Wqkv.weight", (3 * d_model, d_model))
        for n, part in zip("qkv", qkv.split(d_model), strict=True):
            w[f"{dst}attn.{n}.weight"] = part.clone()
        if attn_bias:
            qkv_b = r.take(src + "attn.Wqkv.bias", (3 * d_model,))
            for n, part in zip("qkv", qkv_b.split(d_model), strict=True):
                w[f"{dst}attn.{n}.bias"] = part.clone()
            w[dst + "attn.o.bias"] = r.take(src + "attn.Wo.bias", (d_model,))
        w[dst + "attn.o.weight"] = r.take(src + "attn.Wo.weight", (d_model, d_model))
        if i > 0:
            take_norm(dst + "attn_norm", src + "attn_norm")
        take_norm(dst + "mlp_norm", src + "mlp_norm")
        # Wi rows are [value | gate]: transformers chunks them as (input, gate) and applies
        # the activation to the first half.
        wi = r.take(src + "mlp.Wi.weight", (2 * inter, d_model))
        w[dst + "mlp.value.weight"], w[dst + "mlp.gate.weight"] = (
            x.clone() for x in wi.split(inter)
        )
        if mlp_bias:
            bi = r.take(src + "mlp.Wi.bias", (2 * inter,))
            w[dst + "mlp.value.bias"], w[dst + "mlp.gate.bias"] = (
                x.clone() for x in bi.split(inter)
            )
            w[dst + "mlp.down.bias"] = r.take(src + "mlp.Wo.bias", (d_model,))
        w[dst + "mlp.down.weight"] = r.take(src + "mlp.Wo.weight", (d_model, inter))
    take_norm("final_norm", p + "final_norm")
    if classifier is not None:
        w["head.dense.weight"] = r.take("head.dense.weight", (d_model, d_model))
        if classifier.dense_bias:
            w["head.dense.bias"] = r.take("head.dense.bias", (d_model,))
        take_norm("head.norm", "head.norm")
        w["head.classifier.weight"] = r.take("classifier.weight", (classifier.num_labels, d_model))
        w["head.classifier.bias"] = r.take("classifier.bias", (classifier.num_labels,))
    r.finish()
    return EncoderModel(spec=spec, weights=w)
