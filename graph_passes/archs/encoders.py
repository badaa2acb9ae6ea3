"""Shared pieces of the encoder architectures (BERT, ModernBERT): prefixes, activations, labels."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.archs.config import config_value
from graph_passes.errors import InputError

# transformers' ACT2FN names of the exact (erf) GELU; tanh forms ("gelu_new",
# "gelu_pytorch_tanh", ...) are other functions and are refused, never substituted.
EXACT_GELU = ("gelu",)


def require_exact_gelu(config: object, key: str) -> None:
    """Fail naming ``key`` unless the config's activation is the exact (erf) GELU."""
    value = config_value(config, key)
    if value not in EXACT_GELU:
        raise InputError(
            f"config.{key} = {value!r}: only the exact (erf) GELU {EXACT_GELU} is implemented"
        )


def model_prefix(
    state_dict: Mapping[str, torch.Tensor], probe: str, prefixes: tuple[str, ...]
) -> str:
    """The prefix under which the base model's tensors live (``bert.`` in a task model)."""
    for prefix in prefixes:
        if prefix + probe in state_dict:
            return prefix
    raise InputError(f"checkpoint tensor {probe!r} is missing (tried prefixes {list(prefixes)})")


def label_names(config: object) -> tuple[str, ...]:
    """Label names in logit order, from ``config.id2label``."""
    num = int(config_value(config, "num_labels", 0) or 0)
    id2label = config_value(config, "id2label") or {}
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num))
