"""The ``cache:`` section of a text-generation recipe: a stateful draft decoder's KV cache.

``style: none`` (the default) is today's window program. ``state`` and ``io`` emit one
multifunction package (``prefill``, ``decode``, ``extend``) over a KV cache of ``length``
slots (`graph_passes.cached_decoder`): ``state`` keeps the cache as a Core ML state (macOS 15
/ iOS 18), ``io`` passes it in and returns only the new rows. ``layout: per-function`` emits
one package per function instead, for runtimes where loading several functions of one package
holds a weight copy per function (reported by Anemll for multifunction packages): the host
carries the cache between packages (``io``), or copies the state from the package it last
called into the next (``state``: MLState read_state / write_state).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from converter.compression import methods
from converter.coreml.targets import Feature, check_feature
from converter.recipe.yaml_errors import Loc, StrictModel, raise_rules

CacheStyleName = Literal["none", "state", "io"]
CacheLayout = Literal["multifunction", "per-function"]
# A cache's slots are one axis of the state; at most the NE's per-axis limit.
MAX_CACHE = 16384


class CacheSpec(StrictModel):
    """KV cache shape and functions (text-generation only)."""

    style: CacheStyleName = "none"
    # Slots (positions) the cache holds; a multiple of 32 (Core AI's shape ladder starts at
    # 256 and doubles; ../shared/research/anchors_runtime.md section 2).
    length: int = Field(default=512, ge=32, le=MAX_CACHE, strict=True)
    prefill: int = Field(default=64, ge=1, le=512, strict=True)  # tokens per prefill call
    extend: int = Field(default=4, ge=2, le=64, strict=True)  # K: tokens per extend call
    # Sequential decode steps the parity gates run after each fixture's prompt (>= 64 is the
    # gate the issue fixes; fewer only for CI-sized recipes, which say so in their comment).
    decode_steps: int = Field(default=64, ge=1, le=4096, strict=True)
    # Stored weight megabytes (10^6 bytes) per package: the layers are split into consecutive
    # chunk packages within it (`converter.tasks.kv_chunks`); default by target, about 1 GB
    # for iOS and 2 GB for macOS (Anemll's chunk sizes).
    package_budget_mb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # One multifunction package (weights stored once), or one package per function.
    layout: CacheLayout = "multifunction"

    @model_validator(mode="after")
    def _fits(self) -> CacheSpec:
        problems: list[tuple[Loc, str]] = []
        if self.length % 32:
            problems.append((("length",), f"expected a multiple of 32, got {self.length}"))
        for key in ("prefill", "extend"):
            value = getattr(self, key)
            if value > self.length:
                problems.append(((key,), f"{value} tokens exceed the cache length {self.length}"))
        raise_rules("CacheSpec", problems)
        return self


def cache_problems(
    cache: CacheSpec, target: str, batch: int, variants: list[Any], precision: str
) -> list[tuple[Loc, str]]:
    """Rules between the cache section and the rest of a decoder recipe (``variants``: the
    compression variants, in order)."""
    if cache.style == "none":
        # by value: a manifest's recipe records every key with its default
        keys = ["package_budget_mb"] if cache.package_budget_mb is not None else []
        keys += ["layout"] if cache.layout != "multifunction" else []
        return [
            (("cache", k), "applies to a cached decoder (style state or io); style none emits "
             "one window program")
            for k in keys
        ]  # fmt: skip
    problems: list[tuple[Loc, str]] = []
    needs = [Feature.MULTIFUNCTION] + ([Feature.STATES] if cache.style == "state" else [])
    for feature in needs:
        reason = check_feature(target, feature)
        if reason:
            problems.append((("cache", "style"), f"{reason}; choose target macOS15 or iOS18"))
    if batch != 1:
        problems.append((("shapes", "batch"), "a cached decoder runs batch 1; set batch: 1"))
    if precision != "float16":
        problems.append((("precision",), "a KV cache is fp16 (the NE's rule); set float16"))
    if cache.layout == "per-function":
        # Each function's package is converted on its own; chunks and compressed variants
        # are built around one multifunction package per chunk.
        if cache.package_budget_mb is not None:
            problems.append((
                ("cache", "package_budget_mb"),
                "a per-function layout is not chunked: remove package_budget_mb or use "
                "layout multifunction",
            ))  # fmt: skip
        if variants:
            problems.append((
                ("compression",),
                "compressed variants of a per-function layout are not implemented: use "
                "layout multifunction",
            ))  # fmt: skip
    return problems + kv_method_problems(variants)


def kv_method_problems(variants: list[Any]) -> list[tuple[Loc, str]]:
    """Variants whose method a cached decoder cannot carry: the methods whose stored values are
    a function of the weight and its scheme alone (``kv_cache`` in ``compress/methods``) make
    every function's package, compressed with the same plan, hold byte-identical weights
    (`converter.compression.stateful`)."""
    kv = methods.kv_methods()
    # a search method's values written into the window program before palettes are applied
    # (skm, gptq, grid) would not reach the cached functions, which receive only the plan
    searched = [n for n in methods.search_methods() if n in kv]
    problems: list[tuple[Loc, str]] = []
    for i, variant in enumerate(variants):
        if variant.method not in kv:
            problems.append(
                (
                    ("compression", "variants", i, "method"),
                    f"{variant.method} variants of a cached decoder are not implemented (they "
                    "change the program beyond its weights, and those ops are not carried into "
                    f"the cached functions); use one of {', '.join(kv)}",
                )
            )
        elif variant.search is not None and set(variant.search.methods) - set(searched):
            problems.append(
                (
                    ("compression", "variants", i, "search", "methods"),
                    "a cached decoder's mixed search chooses palettes only; "
                    f"use [{', '.join(searched)}]",
                )
            )
    return problems
