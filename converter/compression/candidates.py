"""The search's per-weight choices across methods: method x bits x group, each with the values
it gives a weight and the bytes it stores (``compress.search``).

A candidate is a `Scheme` (None: the weight stays fp16). Its values are computed once per
candidate for every searched weight, by the same routines the emitted program's values come
from: coremltools' k-means per tensor or per group of output rows (``lut``), sensitive k-means
on the calibration text (``skm``, all weights in one SKMPalettizer run), GPTQ on the
calibration text (``gptq``, every weight at that width, layer by layer), or the weight's own
block grid (``grid``: one candidate whose width is found per weight, exact; a weight on no
grid does not take it). Each of these is the search method's own (``methods/<name>.py``, its
``search_*`` hooks); this module asks the registry. A data-dependent
candidate's values assume every other weight at the same candidate (SKM's sensitivities are
the fp16 model's either way; GPTQ's later layers see earlier GPTQ layers); the chosen plan is
then emitted (computed again for its own mix) and confirmed on the program.
"""

from __future__ import annotations

from typing import Any

from converter.compression import methods
from converter.compression.methods.base import Scheme, SearchData, SiteValues
from converter.compression.sites import WeightSite

Candidate = Scheme | None  # None: fp16


def label(c: Candidate) -> str:
    """``fp16``, ``lut4``, ``lut4g32``, ``skm4g8``, ``gptq4``."""
    return "fp16" if c is None else methods.get(c.method).search_label(c)


def candidates(space: Any) -> list[Candidate]:
    """Every candidate of a search space: fp16 (when 16 is in ``bits``), then each method's
    candidates at each width, largest first (e.g. palettes per tensor and per each group size,
    gptq per channel)."""
    out: list[Candidate] = [None] if 16 in space.bits else []
    widths = sorted((b for b in space.bits if b != 16), reverse=True)
    for name in space.methods:
        out += methods.get(name).search_candidates(space, widths)
    return out


def fits(site: WeightSite, c: Candidate) -> bool:
    """Whether ``site`` can take ``c`` (e.g. groups must divide its output rows)."""
    return c is None or methods.get(c.method).fits(site, c)


def stored_bytes(site: WeightSite, c: Candidate) -> int:
    """Bytes the program stores for ``site`` as ``c`` (indices or integers, tables, scales)."""
    return site.elements * 2 if c is None else methods.get(c.method).stored_bytes(site, c)


def candidate_values(
    c: Scheme,
    sites: list[WeightSite],
    fp16: dict[str, Any],
    module: Any,
    calibration: list[Any],
    embed_table: Any,
    pad_id: int,
) -> SiteValues:
    """Every site's scheme and fp16 values as candidate ``c`` (grid: only the sites on a
    grid, each with its own grid's scheme)."""
    data = SearchData(fp16, module, calibration, embed_table, pad_id)
    return methods.get(c.method).search_values(c, sites, data)
