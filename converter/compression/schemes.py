"""Per-weight compression schemes and applying them to an ML Program with coremltools (the
weight-scheme plan of a compressed variant; ``converter.placement`` is compute-unit placement).

A plan maps every compressed weight (by torch name) to one ``Scheme``; weights not in the plan
stay fp16. Plans are applied through ``coremltools.optimize.coreml`` with one op-name config per
weight constant, so nothing is compressed by a global default. The method that stores each
scheme (``methods/lut.py``, ``methods/int8.py``) builds its config and applies it.
"""

from __future__ import annotations

from typing import Any

from converter.compression import methods
from converter.compression.methods.base import (
    Scheme,
    VariantFields,
    quiet_progress,
    split_sites,
)
from converter.compression.sites import WeightSite

__all__ = [
    "Scheme",
    "apply_plan",
    "quiet_progress",
    "split_sites",
    "variant_scheme",
]


def variant_scheme(variant: VariantFields) -> Scheme:
    """The one scheme a uniform variant (lut, int8, w8a8 weights) gives every weight."""
    return methods.get(variant.method).scheme(variant)


def apply_plan(mlmodel: Any, plan: dict[str, Scheme], sites: list[WeightSite]) -> Any:
    """A new MLModel with every planned weight compressed (palettes first, then int8)."""
    const = {s.name: s.const for s in sites}
    unknown = sorted(set(plan) - set(const))
    if unknown:
        raise KeyError(f"planned weights not in the program: {unknown[:5]}")
    model = mlmodel
    for name, method in methods.METHODS.items():
        configs = {const[n]: s.ct_config() for n, s in plan.items() if s.method == name}
        if configs:
            model = method.apply(model, configs)
    return model
