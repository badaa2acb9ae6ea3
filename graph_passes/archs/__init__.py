"""The architecture registry: one file per architecture, registered by Hugging Face
``model_type`` and architecture class names.

Each file holds its config reading, its weight-mapping table (`graph_passes.archs.table`) and
its refusals, and exports ``ARCH`` (`Architecture`). Adding an architecture is one file: every
module of this package that defines ``ARCH`` is registered (the shared helpers define none).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import cast

import torch

from graph_passes.archs.registry import Architecture
from graph_passes.errors import InputError
from graph_passes.spec import CanonicalModel, EncoderModel


def _discover() -> tuple[Architecture, ...]:
    """The ``ARCH`` of every module in this package: decoders first, then by name."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        arch = getattr(module, "ARCH", None)
        if isinstance(arch, Architecture):
            found.append(arch)
    return tuple(sorted(found, key=lambda a: (a.family != "decoder", a.name)))


def _by_model_type(archs: tuple[Architecture, ...]) -> dict[str, Architecture]:
    registry: dict[str, Architecture] = {}
    for arch in archs:
        for model_type in arch.model_types:
            if model_type in registry:
                raise RuntimeError(
                    f"model_type {model_type!r} is registered by both "
                    f"{registry[model_type].name} and {arch.name}"
                )
            registry[model_type] = arch
    return registry


_ARCHS: tuple[Architecture, ...] = _discover()

# model_type -> architecture
REGISTRY: dict[str, Architecture] = _by_model_type(_ARCHS)

Adapter = Callable[[object, Mapping[str, torch.Tensor]], CanonicalModel]
EncoderAdapter = Callable[[object, Mapping[str, torch.Tensor]], EncoderModel]

# model_type -> adapt function, per family (what the pipelines and preflight look up).
ADAPTERS: dict[str, Adapter] = {
    t: cast(Adapter, a.adapt) for t, a in REGISTRY.items() if a.family == "decoder"
}
ENCODER_ADAPTERS: dict[str, EncoderAdapter] = {
    t: cast(EncoderAdapter, a.adapt) for t, a in REGISTRY.items() if a.family == "encoder"
}
# Parts adapted with their encoder (the decision head: `archs.decision_head.HeadSource`).
HEAD_ADAPTERS = {t: a.adapt for t, a in REGISTRY.items() if a.family == "head"}


def architectures() -> tuple[Architecture, ...]:
    """Every registered architecture, in registration order."""
    return _ARCHS


def find(config: object) -> Architecture | None:
    """The architecture for ``config.model_type``, else for one of ``config.architectures``."""
    arch = REGISTRY.get(str(getattr(config, "model_type", None)))
    if arch is not None:
        return arch
    for cls in getattr(config, "architectures", None) or []:
        for candidate in _ARCHS:
            if cls in candidate.classes:
                return candidate
    return None


def _lookup(config: object, family: str) -> Architecture:
    arch = find(config)
    if arch is None or arch.family != family:
        model_type = getattr(config, "model_type", None)
        supported = sorted(t for t, a in REGISTRY.items() if a.family == family)
        kind = "architecture" if family == "decoder" else "encoder architecture"
        raise InputError(
            f"config.model_type: {kind} {model_type!r} is not supported; "
            f"supported: {', '.join(supported)}"
        )
    return arch


def adapt(config: object, state_dict: Mapping[str, torch.Tensor]) -> CanonicalModel:
    """Map a decoder checkpoint to its description, by its registered architecture."""
    model = _lookup(config, "decoder").adapt(config, state_dict)
    assert isinstance(model, CanonicalModel)
    return model


def adapt_encoder(config: object, state_dict: Mapping[str, torch.Tensor]) -> EncoderModel:
    """Map an encoder checkpoint to its description, by its registered architecture."""
    model = _lookup(config, "encoder").adapt(config, state_dict)
    assert isinstance(model, EncoderModel)
    return model
