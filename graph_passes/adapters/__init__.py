"""Per-architecture adapters: Hugging Face config + state dict -> `CanonicalModel`.

One file per architecture; `ADAPTERS` maps a config's ``model_type`` to its adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from converter.errors import InputError
from graph_passes.adapters import bert, llama, modernbert, qwen2
from graph_passes.spec import CanonicalModel, EncoderModel

Adapter = Callable[[object, Mapping[str, torch.Tensor]], CanonicalModel]
EncoderAdapter = Callable[[object, Mapping[str, torch.Tensor]], EncoderModel]

ADAPTERS: dict[str, Adapter] = {
    "llama": llama.adapt,
    "qwen2": qwen2.adapt,
}

# Encoders (bidirectional; feature extraction, sentence embeddings, classification).
ENCODER_ADAPTERS: dict[str, EncoderAdapter] = {
    "bert": bert.adapt,
    "modernbert": modernbert.adapt,
}


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Run the adapter registered for ``config.model_type``."""
    model_type = getattr(config, "model_type", None)
    adapter = ADAPTERS.get(str(model_type))
    if adapter is None:
        raise InputError(
            f"config.model_type: architecture {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return adapter(config, state_dict)


def adapt_encoder(config: object, state_dict: Mapping[str, torch.Tensor]) -> EncoderModel:
    """Run the encoder adapter registered for ``config.model_type``."""
    model_type = getattr(config, "model_type", None)
    adapter = ENCODER_ADAPTERS.get(str(model_type))
    if adapter is None:
        raise InputError(
            f"config.model_type: encoder architecture {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(ENCODER_ADAPTERS))}"
        )
    return adapter(config, state_dict)
