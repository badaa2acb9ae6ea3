"""``method: lut``: k-means palettes (look-up tables) of 2**bits fp16 entries per tensor, or
per group of output channels (``per-grouped-channel``, macOS 15 / iOS 18).

The program holds ``constexpr_lut_to_dense``: packed indices and the palette(s). The values
are coremltools' own clustering (``palettize_weights``, mode ``kmeans``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from converter.compression.methods.base import (
    LUT_BITS,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    SearchData,
    SiteValues,
    VariantFields,
    quiet_progress,
)
from converter.compression.sites import WeightSite
from converter.coreml.targets import Feature

# coremltools clusters with kmeans1d (optimal 1-D k-means, vendored in coremltools._deps) for
# fp16 weights of at least this many values, else scikit-learn k-means (k-means++, random_state 0).
_KMEANS1D_MIN = 10_000
_FIX = "set target: macOS15 (or iOS18)"


class Lut(CompressionMethod):
    """k-means palettized weights."""

    name = "lut"
    summary = "k-means palettes of 2**bits entries, per tensor or per group of output channels"
    order = 10
    kv_cache = True
    searchable = True
    search_summary = "k-means palettes (coremltools)"

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.bits not in LUT_BITS:
            allowed = ", ".join(map(str, LUT_BITS))
            problems.append((("bits",), f"a lut variant needs bits from {allowed}"))
        if variant.granularity in ("per-channel", "per-block"):
            problems.append((("granularity",), "palettes are per-tensor or per-grouped-channel"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        used: list[FeatureUse] = []
        if variant.granularity == "per-grouped-channel":
            used.append((("granularity",), Feature.GROUPED_PALETTE, _FIX + " or use per-tensor"))
        if variant.bits == 3:
            used.append((("bits",), Feature.PALETTE_3BIT, _FIX + " or use 2 or 4 bits"))
        return used

    def scheme(self, variant: VariantFields) -> Scheme:
        assert variant.bits is not None  # guaranteed by check()
        return Scheme("lut", variant.bits, variant.granularity, variant.group_size)

    def describe(self, scheme: Scheme) -> str:
        group = f" (groups of {scheme.group_size} output channels)" if scheme.group_size else ""
        return f"lut{scheme.bits} k-means {scheme.granularity}{group}"

    def ct_config(self, scheme: Scheme) -> Any:
        from coremltools.optimize.coreml import OpPalettizerConfig

        return OpPalettizerConfig(
            mode="kmeans",
            nbits=scheme.bits,
            granularity=scheme.granularity.replace("-", "_"),
            group_size=scheme.group_size or 32,
            channel_axis=0,  # output channels of a conv weight (O, I, 1, 1)
            weight_threshold=1,
        )

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        per_table = site.elements
        if scheme.granularity == "per-grouped-channel" and scheme.group_size:
            per_table = site.elements * scheme.group_size // site.shape[0]
        from coremltools._deps import _HAS_KMEANS1D as has_1d  # coremltools vendors kmeans1d

        if has_1d and per_table >= _KMEANS1D_MIN and site.dtype == "float16":
            return "k-means, kmeans1d (optimal 1-D clustering of the fp16 values), coremltools"
        return "k-means, scikit-learn KMeans (k-means++, n_init 1, tol 1e-2, random_state 0)"

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        from coremltools.optimize.coreml import OptimizationConfig, palettize_weights

        with quiet_progress():
            return palettize_weights(mlmodel, OptimizationConfig(op_name_configs=op_configs))

    def search_candidates(self, space: Any, widths: list[int]) -> list[Scheme]:
        return palette_candidates(self.name, space, widths)

    def stored_bytes(self, site: WeightSite, scheme: Scheme) -> int:
        return palette_bytes(site, scheme)

    def search_values(self, c: Scheme, sites: list[WeightSite], data: SearchData) -> SiteValues:
        return {
            s.name: (c, grouped_palette(data.fp16[s.name], c.bits, c.group_size)) for s in sites
        }


METHOD = Lut()


def palette_candidates(method: str, space: Any, widths: list[int]) -> list[Scheme]:
    """Palette candidates of ``method`` at each width: per tensor, then per group of each of
    ``space.group_sizes`` output rows."""
    out: list[Scheme] = []
    for b in widths:
        out.append(Scheme(method, b, "per-tensor"))
        out += [Scheme(method, b, "per-grouped-channel", g) for g in space.group_sizes]
    return out


def palette_bytes(site: WeightSite, c: Scheme) -> int:
    """Bytes of ``site`` as palette ``c``: packed indices and fp16 tables."""
    payload = (site.elements * c.bits + 7) // 8
    tables = site.shape[0] // c.group_size if c.group_size else 1
    return payload + tables * (2**c.bits) * 2


def palette(weight: np.ndarray, bits: int) -> np.ndarray:
    """``weight`` through a per-tensor k-means palette of ``2**bits`` entries (fp16 values)."""
    from coremltools.models.neural_network.quantization_utils import (
        _get_kmeans_lookup_table_and_weight,
    )

    w = np.asarray(weight, np.float16)
    lut, indices = _get_kmeans_lookup_table_and_weight(bits, w)
    return np.asarray(lut, np.float16).reshape(-1)[np.asarray(indices)].reshape(w.shape)


def grouped_palette(weight: np.ndarray, bits: int, group: int | None) -> np.ndarray:
    """``weight`` through k-means palettes per ``group`` output rows (None: per tensor), as
    coremltools' palettizer computes them."""
    if group is None:
        return palette(weight, bits)
    rows = [palette(weight[i : i + group], bits) for i in range(0, weight.shape[0], group)]
    return np.concatenate(rows)
