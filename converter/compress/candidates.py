"""The search's per-weight choices across methods: method x bits x group, each with the values
it gives a weight and the bytes it stores (``compress.search``).

A candidate is a `Scheme` (None: the weight stays fp16). Its values are computed once per
candidate for every searched weight, by the same routines the emitted program's values come
from: coremltools' k-means per tensor or per group of output rows (``lut``), sensitive k-means
on the calibration text (``skm``, all weights in one SKMPalettizer run), GPTQ on the
calibration text (``gptq``, every weight at that width, layer by layer), or the weight's own
block grid (``grid``: one candidate whose width is found per weight, exact; a weight on no
grid does not take it). A data-dependent
candidate's values assume every other weight at the same candidate (SKM's sensitivities are
the fp16 model's either way; GPTQ's later layers see earlier GPTQ layers); the chosen plan is
then emitted (computed again for its own mix) and confirmed on the program.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from converter.compress.methods.base import Scheme
from converter.compress.sites import WeightSite

Candidate = Scheme | None  # None: fp16


def label(c: Candidate) -> str:
    """``fp16``, ``lut4``, ``lut4g32``, ``skm4g8``, ``gptq4``."""
    if c is None:
        return "fp16"
    if c.method == "grid":
        return "grid"  # one candidate: the width is each weight's own
    return f"{c.method}{c.bits}" + (f"g{c.group_size}" if c.group_size else "")


def candidates(space: Any) -> list[Candidate]:
    """Every candidate of a search space: fp16 (when 16 is in ``bits``), then each method's
    widths, per tensor and per each group size (palettes) or per channel (gptq)."""
    out: list[Candidate] = [None] if 16 in space.bits else []
    widths = sorted((b for b in space.bits if b != 16), reverse=True)
    for method in space.methods:
        if method == "grid":
            out.append(Scheme("grid", 0, "per-block", space.grid_block))  # width: per weight
            continue
        for b in widths:
            if method == "gptq":
                if b in (4, 8):
                    out.append(Scheme("gptq", b, "per-channel", None, True))
                continue
            out.append(Scheme(method, b, "per-tensor"))
            out += [Scheme(method, b, "per-grouped-channel", g) for g in space.group_sizes]
    return out


def fits(site: WeightSite, c: Candidate) -> bool:
    """Whether ``site`` can take ``c``: groups must divide its output rows (grid blocks its
    inputs; whether it lies on a grid is known only from its values)."""
    if c is None or not c.group_size:
        return True
    if c.method == "grid":
        return site.elements // site.shape[0] % c.group_size == 0
    return site.shape[0] % c.group_size == 0


def stored_bytes(site: WeightSite, c: Candidate) -> int:
    """Bytes the program stores for ``site`` as ``c`` (indices or integers, tables, scales)."""
    if c is None:
        return site.elements * 2
    payload = (site.elements * c.bits + 7) // 8
    if c.method == "gptq":
        return payload + site.shape[0] * 2  # one fp16 scale per output row
    if c.method == "grid":
        assert c.group_size is not None  # a grid scheme is per block
        per_block = 2 if c.symmetric else 4  # an fp16 scale (and offset) per block
        return payload + site.elements // c.group_size * per_block
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


def candidate_values(
    c: Scheme,
    sites: list[WeightSite],
    fp16: dict[str, np.ndarray],
    module: Any,
    calibration: list[Any],
    embed_table: Any,
    pad_id: int,
) -> dict[str, tuple[Scheme, np.ndarray]]:
    """Every site's scheme and fp16 values as candidate ``c`` (grid: only the sites on a
    grid, each with its own grid's scheme)."""
    if c.method == "lut":
        return {s.name: (c, grouped_palette(fp16[s.name], c.bits, c.group_size)) for s in sites}
    if c.method == "skm":
        from converter.compress.methods.skm import skm_weights

        plan = {s.name: c for s in sites}
        values = skm_weights(module, sites, plan, calibration, embed_table, pad_id)
        return {n: (c, v) for n, v in values.items()}
    if c.method == "gptq":
        from converter.compress.methods.gptq import decode, gptq_weights

        ints, scales = gptq_weights(
            module, sites, {s.name: c.bits for s in sites}, calibration, embed_table, pad_id
        )
        return {n: (c, decode(q, scales[n]).astype(np.float16)) for n, q in ints.items()}
    if c.method == "grid":
        from converter.compress.grids import find_grid

        assert c.group_size is not None
        out: dict[str, tuple[Scheme, np.ndarray]] = {}
        for s in sites:
            found = find_grid(fp16[s.name].astype(np.float32), c.group_size)
            if found is not None:
                grid, integers = found
                scheme = Scheme("grid", grid.bits, "per-block", c.group_size, grid.symmetric)
                out[s.name] = (scheme, integers.decode().astype(np.float16))
        return out
    raise ValueError(f"no search values for method {c.method!r}")
