"""The decision head (``model_type: anec-decision-head``): H transformer layers in the
encoder's own block, a head norm, candidate selection, a scorer and an action head, read from
``decision_head/config.json`` and ``decision_head/model.safetensors`` beside a ModernBERT
checkpoint (layout: ``docs/decision-head.md``).

Registered like an architecture: the config reading below, a weight-mapping table (every
tensor of the head file is mapped or named in an error), and its refusals. The head layers
reuse the encoder's `LayerSpec` (same widths, norms, biases, GeGLU) of a global layer (RoPE
with the global theta) or, where the config says ``local``, of a local layer (the encoder's
window and local theta), with an attention norm (the identity norm belongs to the layer right
after the embeddings, not to a head layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from graph_passes.archs.registry import Architecture
from graph_passes.archs.table import Row, map_weights
from graph_passes.archs.weights import WeightReader
from graph_passes.decision_spec import (
    ACTION_INPUTS,
    ActionInput,
    CandidateSpec,
    DecisionHead,
    DecisionHeadSpec,
    MlpHeadSpec,
)
from graph_passes.errors import InputError
from graph_passes.spec import EncoderSpec, LayerSpec

MODEL_TYPE = "anec-decision-head"
_ACTIVATIONS = ("gelu", "tanh", "relu")
_KEYS = {
    "model_type", "num_layers", "attention", "final_norm", "candidates", "num_candidates",
    "scorer", "action", "actions", "temperature",
}  # fmt: skip

L = "layers.{i}."
# The head file's names are those of a ModernBERT layer (`ModernBertEncoderLayer`), so a head
# trained on top of transformers' classes saves them as they are.
LAYER_TABLE: tuple[Row, ...] = (
    Row(("layers.{i}.attn.q", "layers.{i}.attn.k", "layers.{i}.attn.v"), L + "attn.Wqkv",
        ("3D", "D"), bias="attn_bias"),
    Row("layers.{i}.attn.o", L + "attn.Wo", ("D", "D"), bias="attn_bias"),
    Row("layers.{i}.attn_norm", L + "attn_norm", ("D",), bias="norm_bias"),
    Row("layers.{i}.mlp_norm", L + "mlp_norm", ("D",), bias="norm_bias"),
    Row(("layers.{i}.mlp.gate", "layers.{i}.mlp.up"), L + "mlp.Wi", ("2I", "D"), bias="mlp_bias"),
    Row("layers.{i}.mlp.down", L + "mlp.Wo", ("D", "I"), bias="mlp_bias"),
    Row("head_norm", "norm", ("D",), bias="norm_bias", when="final_norm"),
)  # fmt: skip


@dataclass(frozen=True)
class HeadSource:
    """What the head adapter reads besides the tensors: the JSON config, the encoder it sits
    on (its block is the head's block) and the file the config came from (for errors)."""

    data: Mapping[str, Any]
    encoder: EncoderSpec
    where: str = "decision_head/config.json"


def _fail(where: str, key: str, problem: str) -> InputError:
    return InputError(f"{where}: {key}: {problem}")


def _int(data: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(where, key, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _mlp(data: Any, key: str, where: str, first: int, last: int) -> MlpHeadSpec:
    if not isinstance(data, Mapping) or set(data) - {"widths", "activation", "inputs"}:
        raise _fail(where, key, f"expected a mapping with widths and activation, got {data!r}")
    widths: Any = data.get("widths")
    ok = isinstance(widths, list) and len(widths) >= 2
    if not ok or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths):
        raise _fail(
            where, f"{key}.widths", f"expected at least two positive widths, got {widths!r}"
        )
    if widths[0] != first or widths[-1] != last:
        raise _fail(
            where, f"{key}.widths", f"expected {first} first and {last} last, got {widths!r}"
        )
    activation = data.get("activation")
    if activation not in _ACTIVATIONS:
        raise _fail(
            where, f"{key}.activation", f"expected one of {_ACTIVATIONS} (gelu is the exact erf "
            f"GELU), got {activation!r}",
        )  # fmt: skip
    return MlpHeadSpec(tuple(widths), activation)


def _candidates(data: Any, where: str) -> CandidateSpec:
    if not isinstance(data, Mapping) or data.get("kind") not in ("markers", "cls"):
        raise _fail(where, "candidates", f"expected kind markers or cls, got {data!r}")
    if data["kind"] == "cls":
        if set(data) != {"kind"}:
            raise _fail(where, "candidates", "kind cls takes no other key")
        return CandidateSpec("cls")
    ids = data.get("marker_token_ids")
    if set(data) != {"kind", "marker_token_ids"} or not isinstance(ids, list) or not ids:
        raise _fail(
            where, "candidates.marker_token_ids", f"expected a list of token ids, got {ids!r}"
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _fail(where, "candidates.marker_token_ids", f"expected token ids >= 0, got {ids!r}")
    return CandidateSpec("markers", tuple(ids))


def _input_width(name: str, k: int, d: int) -> int:
    return {"raw_probs": k, "scorer_logits": k, "cls_row": d}[name]


HEAD_ATTENTION = ("global", "local")


def head_layer_spec(encoder: EncoderSpec, attention: str = "global") -> LayerSpec:
    """The head's block: the encoder's global (or local: its window and local RoPE theta)
    layer with an attention norm (the encoder's mlp norm spec: ModernBERT builds both norms
    alike)."""
    local = attention == "local"
    bases = [ls for ls in encoder.layers if (ls.attention.window is not None) == local]
    if not bases:
        raise InputError(
            f"the encoder has no {attention}-attention layer to take the head's block from"
        )
    base = bases[0]
    return dataclasses.replace(base, attention_norm=base.mlp_norm)


def _head_attention(data: Mapping[str, object], where: str, n_layers: int) -> tuple[str, ...]:
    """``attention``: one of HEAD_ATTENTION for every head layer, or a list of them, one per
    head layer."""
    value = data.get("attention", "global")
    kinds = [value] * n_layers if isinstance(value, str) else value
    if (
        not isinstance(kinds, list)
        or len(kinds) != n_layers
        or any(k not in HEAD_ATTENTION for k in kinds)
    ):
        raise _fail(
            where, "attention", f"expected one of {list(HEAD_ATTENTION)} or a list of "
            f"{n_layers} of them (one per head layer), got {value!r}",
        )  # fmt: skip
    return tuple(cast(list[str], kinds))


def read_head_spec(source: HeadSource) -> DecisionHeadSpec:
    """The head description from its JSON config; InputError naming the file and key."""
    data, where, enc = source.data, source.where, source.encoder
    if not isinstance(data, Mapping):
        raise InputError(f"{where}: expected a JSON object")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise _fail(where, unknown[0], f"not a decision-head key; the keys are {sorted(_KEYS)}")
    if data.get("model_type") != MODEL_TYPE:
        raise _fail(where, "model_type", f"expected {MODEL_TYPE!r}, got {data.get('model_type')!r}")
    final_norm = data.get("final_norm", True)
    if not isinstance(final_norm, bool):
        raise _fail(where, "final_norm", f"expected true or false, got {final_norm!r}")
    n_layers = _int(data, "num_layers", where)
    attention = _head_attention(data, where, n_layers)
    k = _int(data, "num_candidates", where, minimum=2)
    candidates = _candidates(data.get("candidates"), where)
    d = enc.hidden_size
    scorer = _mlp(data.get("scorer"), "scorer", where, d, 1 if candidates.kind == "markers" else k)
    action_data = data.get("action")
    inputs = action_data.get("inputs") if isinstance(action_data, Mapping) else None
    if not isinstance(inputs, list) or not inputs or inputs[0] != "raw_probs":
        raise _fail(
            where, "action.inputs", f"expected a list starting with raw_probs, got {inputs!r}"
        )
    bad = [i for i in inputs if i not in ACTION_INPUTS]
    if bad or len(set(inputs)) != len(inputs):
        raise _fail(
            where, "action.inputs", f"expected distinct items of {ACTION_INPUTS}, got {inputs!r}"
        )
    actions = data.get("actions")
    if (
        not isinstance(actions, list)
        or len(actions) < 2
        or not all(isinstance(a, str) for a in actions)
    ):
        raise _fail(where, "actions", f"expected at least two action names, got {actions!r}")
    width = sum(_input_width(i, k, d) for i in inputs)
    action = _mlp(action_data, "action", where, width, len(actions))
    temperature = data.get("temperature")
    if (
        not isinstance(temperature, int | float)
        or isinstance(temperature, bool)
        or not temperature > 0
    ):
        raise _fail(where, "temperature", f"expected a number > 0, got {temperature!r}")
    blocks = tuple(head_layer_spec(enc, kind) for kind in attention)
    return DecisionHeadSpec(
        layers=blocks,
        norm=blocks[0].mlp_norm if final_norm else None,
        candidates=candidates,
        num_candidates=k,
        scorer=scorer,
        action=action,
        action_inputs=cast(tuple[ActionInput, ...], tuple(inputs)),
        actions=tuple(actions),
        temperature=float(temperature),
    )


def _mlp_rows(name: str, mlp: MlpHeadSpec) -> tuple[list[Row], dict[str, int]]:
    rows, dims = [], {}
    for k in range(mlp.num_linear):
        dims[f"{name}{k}"], dims[f"{name}{k + 1}"] = mlp.widths[k], mlp.widths[k + 1]
        rows.append(Row(f"{name}.{k}", f"{name}.{k}", (f"{name}{k + 1}", f"{name}{k}"), bias=True))
    return rows, dims


def adapt_head(
    source: HeadSource, state_dict: Mapping[str, torch.Tensor], first_layer: int
) -> DecisionHead:
    """Map the head's tensors: head layer ``j`` becomes canonical ``layers.{first_layer+j}``."""
    spec = read_head_spec(source)
    block = spec.layers[0]
    enc = source.encoder
    dims = {"D": enc.hidden_size, "3D": 3 * enc.hidden_size,
            "I": block.mlp.intermediate_size, "2I": 2 * block.mlp.intermediate_size}  # fmt: skip
    scorer_rows, scorer_dims = _mlp_rows("scorer", spec.scorer)
    action_rows, action_dims = _mlp_rows("action", spec.action)
    norm = block.mlp_norm
    reader = WeightReader(state_dict, "decision-head")
    flags = {
        "norm_bias": norm.bias,
        "attn_bias": block.attention.qkv_bias,
        "mlp_bias": block.mlp.bias,
        "final_norm": spec.norm is not None,
    }
    layer_weights = map_weights(
        LAYER_TABLE, reader, dims=dims, flags=flags, num_layers=spec.num_layers
    )
    tail_weights = map_weights(
        [*scorer_rows, *action_rows], reader, dims={**scorer_dims, **action_dims}, flags=flags,
        num_layers=1,
    )  # fmt: skip
    reader.finish()
    weights = dict(tail_weights)
    for name, tensor in layer_weights.items():
        if name.startswith("layers."):
            _, j, rest = name.split(".", 2)
            name = f"layers.{first_layer + int(j)}.{rest}"
        weights[name] = tensor
    return DecisionHead(spec, weights, dict(source.data))


def _adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> DecisionHead:
    if not isinstance(config, HeadSource):
        raise InputError("a decision head is read with its encoder (graph_passes.archs.HeadSource)")
    return adapt_head(config, state_dict, first_layer=config.encoder.num_layers)


ARCH = Architecture(
    name="decision-head",
    family="head",
    model_types=(MODEL_TYPE,),
    classes=(),
    tasks=("decision",),
    refuses=(
        "head attention other than global or the encoder's local window",
        "candidates other than marker token ids or the CLS row",
        "scorer / action activations other than gelu (erf), tanh, relu",
        "action.inputs not starting with raw_probs, or items outside " + ", ".join(ACTION_INPUTS),
        "a request whose number of markers differs from num_candidates",
    ),
    adapt=_adapt,
)
