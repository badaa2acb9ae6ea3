"""Per-weight compression schemes and applying them to an ML Program with coremltools.

A plan maps every compressed weight (by torch name) to one ``Scheme``; weights not in the plan
stay fp16. Plans are applied through ``coremltools.optimize.coreml`` with one op-name config per
weight constant, so nothing is compressed by a global default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from converter.compress.config import Variant
from converter.compress.sites import WeightSite, keep_reason

SchemeMethod = Literal["lut", "int8"]


@dataclass(frozen=True)
class Scheme:
    """How one weight is compressed."""

    method: SchemeMethod
    bits: int
    granularity: str  # per-tensor, per-grouped-channel, per-channel
    group_size: int | None = None
    symmetric: bool = True

    def describe(self) -> str:
        """A short label, e.g. ``lut4 per-tensor`` or ``int8 per-channel symmetric``."""
        if self.method == "lut":
            group = f" (groups of {self.group_size} output channels)" if self.group_size else ""
            return f"lut{self.bits} k-means {self.granularity}{group}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"int8 {self.granularity} {kind}"

    def ct_config(self) -> Any:
        """The coremltools op config; ``weight_threshold`` 1: the plan already chose."""
        from coremltools.optimize.coreml import OpLinearQuantizerConfig, OpPalettizerConfig

        if self.method == "lut":
            return OpPalettizerConfig(
                mode="kmeans",
                nbits=self.bits,
                granularity=self.granularity.replace("-", "_"),
                group_size=self.group_size or 32,
                channel_axis=0,  # output channels of a conv weight (O, I, 1, 1)
                weight_threshold=1,
            )
        return OpLinearQuantizerConfig(
            mode="linear_symmetric" if self.symmetric else "linear",
            dtype="int8",
            granularity="per_channel",
            weight_threshold=1,
        )


def variant_scheme(variant: Variant) -> Scheme:
    """The one scheme a uniform variant (lut, int8, w8a8 weights) gives every weight."""
    if variant.method == "lut":
        assert variant.bits is not None  # guaranteed by the recipe schema
        return Scheme("lut", variant.bits, variant.granularity, variant.group_size)
    if variant.method in ("int8", "w8a8"):
        return Scheme("int8", 8, "per-channel", None, variant.symmetric)
    raise ValueError(f"{variant.method} variants have a searched plan, not one scheme")


def split_sites(
    sites: list[WeightSite], keep_fp16: list[str], min_elements: int
) -> tuple[list[WeightSite], dict[str, str]]:
    """Sites to compress, and the kept ones with the reason they stay fp16."""
    compress, kept = [], {}
    for site in sites:
        reason = keep_reason(site, keep_fp16, min_elements)
        if reason is None:
            compress.append(site)
        else:
            kept[site.name] = reason
    return compress, kept


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """coremltools draws tqdm bars on stderr for every pass; keep the CLI's own progress
    readable. (tqdm reads TQDM_DISABLE when it is imported, so the variable cannot be set
    here; its bars go to ``sys.stderr`` as it is when each bar starts.)"""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


def apply_plan(mlmodel: Any, plan: dict[str, Scheme], sites: list[WeightSite]) -> Any:
    """A new MLModel with every planned weight compressed (palettes first, then int8)."""
    from coremltools.optimize.coreml import (
        OptimizationConfig,
        linear_quantize_weights,
        palettize_weights,
    )

    const = {s.name: s.const for s in sites}
    unknown = sorted(set(plan) - set(const))
    if unknown:
        raise KeyError(f"planned weights not in the program: {unknown[:5]}")
    model = mlmodel
    with quiet_progress():
        for method, run in (("lut", palettize_weights), ("int8", linear_quantize_weights)):
            configs = {const[n]: s.ct_config() for n, s in plan.items() if s.method == method}
            if configs:
                model = run(model, OptimizationConfig(op_name_configs=configs))
    return model
