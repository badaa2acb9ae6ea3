"""``method: mixed``: one candidate (method x bits x group) per weight tensor, found by the
search under the variant's parity budget (``compress.search``); each chosen weight is stored as
its method stores it (``lut`` palettes, ``skm`` palettes, ``gptq`` integers), the calibrated
methods' values computed again for the chosen weights (``prepare``).
"""

from __future__ import annotations

import time
from typing import Any

from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    Selection,
    VariantFields,
    split_sites,
)
from converter.coreml.targets import Feature


class Mixed(CompressionMethod):
    """Per-tensor palette widths chosen by a sensitivity-guided search."""

    name = "mixed"
    summary = "a palette width per weight tensor, searched under a parity budget"
    tasks = frozenset({"text-generation"})
    needs_calibration = True
    fields = {"search": None}
    order = 40
    kv_cache = True  # the plan is searched once, then stored as palettes (kv_cache methods)

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.search is None:
            problems.append((("search",), "a mixed variant needs a search section"))
        if variant.bits is not None:
            problems.append((("bits",), "a mixed variant's bits come from search.bits"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        used: list[FeatureUse] = []
        space = variant.search
        if space is not None and 3 in space.bits:
            fix = "set target: macOS15 (or iOS18) or drop 3"
            used.append((("search", "bits"), Feature.PALETTE_3BIT, fix))
        if space is not None and space.group_sizes:
            fix = "set target: macOS15 (or iOS18) or remove group_sizes"
            used.append((("search", "group_sizes"), Feature.GROUPED_PALETTE, fix))
        if space is not None:
            from converter.compression import methods

            # each feature asked once, by the first method (registry order) that needs it
            for method in methods.METHODS.values():
                if method.name in space.methods:
                    for loc, feature, fix in method.search_features(space):
                        if all((loc, feature) != (u[0], u[1]) for u in used):
                            used.append((loc, feature, fix))
        return used

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with the chosen weights that are written before ``apply_plan`` (each
        search method's own ``prepare``: skm values, gptq integers, grid integers); palettes
        are applied by ``apply_plan`` as usual."""
        from converter.compression import methods

        model, seconds = mlmodel, 0.0
        for name in methods.search_methods():
            part = {n: s for n, s in plan.items() if s.method == name}
            if part:
                start = time.perf_counter()
                model, _ = methods.get(name).prepare(ctx, variant, model, part)
                seconds += time.perf_counter() - start
        return model, {"seconds": seconds}

    def select(self, ctx: BuildContext, variant: VariantFields) -> Selection:
        """The searched plan; weights the search leaves at 16 bits are kept fp16."""
        from converter.compression.candidates import candidates

        assert variant.search is not None  # check()
        start = time.perf_counter()
        chosen, kept = split_sites(ctx.sites, ctx.keep_fp16, ctx.min_weight_elements)
        lowered = [c for c in candidates(variant.search) if c is not None]
        label = f"{variant.suffix}: search ({len(chosen)} weights x {len(lowered)} candidates)"
        with ctx.progress.step(label, total=len(chosen) * len(lowered)) as advance:
            plan, found = ctx.subject.search(variant, chosen, advance)
        for site in chosen:
            if site.name not in plan:
                kept[site.name] = "the mixed-bit search kept it fp16"
        selection = Selection(plan, kept, {"search": found})
        selection.seconds["search"] = time.perf_counter() - start
        return selection


METHOD = Mixed()
