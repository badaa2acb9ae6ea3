"""``method: mixed``: one palette width per weight tensor, found by the mixed-bit search under
the variant's parity budget (``compress.search``); the chosen widths are per-tensor k-means
palettes, stored as ``lut`` stores them.
"""

from __future__ import annotations

import time

from converter.compress.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Selection,
    VariantFields,
    split_sites,
)
from converter.targets import Feature


class Mixed(CompressionMethod):
    """Per-tensor palette widths chosen by a sensitivity-guided search."""

    name = "mixed"
    summary = "a palette width per weight tensor, searched under a parity budget"
    tasks = frozenset({"text-generation"})
    needs_calibration = True
    fields = {"search": None}

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.search is None:
            problems.append((("search",), "a mixed variant needs a search section"))
        if variant.bits is not None:
            problems.append((("bits",), "a mixed variant's bits come from search.bits"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        if variant.search is not None and 3 in variant.search.bits:
            fix = "set target: macOS15 (or iOS18) or drop 3"
            return [(("search", "bits"), Feature.PALETTE_3BIT, fix)]
        return []

    def select(self, ctx: BuildContext, variant: VariantFields) -> Selection:
        """The searched plan; weights the search leaves at 16 bits are kept fp16."""
        assert variant.search is not None  # check()
        start = time.perf_counter()
        chosen, kept = split_sites(ctx.sites, ctx.keep_fp16, ctx.min_weight_elements)
        widths = [b for b in variant.search.bits if b != 16]
        label = f"{variant.suffix}: search ({len(chosen)} weights x {len(widths)} widths)"
        with ctx.progress.step(label, total=len(chosen) * len(widths)) as advance:
            plan, found = ctx.subject.search(variant, chosen, advance)
        for site in chosen:
            if site.name not in plan:
                kept[site.name] = "the mixed-bit search kept it fp16"
        selection = Selection(plan, kept, {"search": found})
        selection.seconds["search"] = time.perf_counter() - start
        return selection


METHOD = Mixed()
