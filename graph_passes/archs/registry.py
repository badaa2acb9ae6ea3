"""The architecture record every file in `graph_passes.archs` registers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from graph_passes.decision_spec import DecisionHead
from graph_passes.spec import CanonicalModel, EncoderModel

# "head": a part that sits on an encoder (the decision head), adapted with its encoder.
Family = Literal["decoder", "encoder", "head"]


@dataclass(frozen=True)
class Architecture:
    """One supported architecture: how to find it, what it does, what it refuses.

    ``adapt`` maps a transformers config object and state dict to the model description.
    ``refuses`` lists, for ``anec archs`` and the docs, the config features that are an
    error naming their key rather than a silently different model.
    """

    name: str
    family: Family
    model_types: tuple[str, ...]
    classes: tuple[str, ...]  # Hugging Face architecture class names (config.architectures)
    tasks: tuple[str, ...]
    refuses: tuple[str, ...]
    adapt: Callable[
        [object, Mapping[str, torch.Tensor]], CanonicalModel | EncoderModel | DecisionHead
    ]
