"""What the NE decodes per call, and what each compressed format costs relative to another
(evidence ``predicted``): the inputs of the cost model's third bound (``plan.cost``).

Community measurements show the NE decoding compressed weights at a capped rate, counted in
weights per second, whatever the bits per weight (``../shared/research/anchors_runtime.md``
section 6, "Weight-rate cap"); the chips where a rate was measured carry it
(``plan.chips``). Two relative costs come from published timings, never from an anec run:

* LUT granularity: Apple's OPT-1.3B table (iPhone 15 Pro NE) times LUT4 per tensor, per
  group of 8 / 4 / 2 output channels and per channel; a palettized weight's bytes and decoded
  weights are scaled by its time relative to per tensor;
* index width: 3- and 6-bit indices time like 4 and 8 bits (forge, M6); applied on the chips
  with no measurement that says otherwise (``Chip.index_padding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRANULARITY_SOURCE = (
    "apple/coremltools docs-guides/source/opt-opt1_3.md (OPT-1.3B, iPhone 15 Pro NE): LUT4 "
    "per-tensor 14.76 ms, group 8 15.49, group 4 17.07, group 2 30.72, per-channel 59.11 "
    "(anchors_runtime.md section 6, 'LUT granularity on the NE'); measured on A17 Pro only"
)
PADDING_SOURCE = (
    "Anemll/anemll-forge (M6, docs/history/VECTOR_LUT_README.md): 3- and 6-bit indices time "
    "like 4 and 8 bits (anchors_runtime.md section 6); measured on M6 only"
)
# Apple's OPT-1.3B LUT4 decode latency in ms by output channels per palette; None is one
# palette for the whole tensor. The relative cost is each time over the per-tensor time.
_OPT_LUT4_MS: dict[int | None, float] = {None: 14.76, 8: 15.49, 4: 17.07, 2: 30.72, 1: 59.11}
# Index widths that time like a wider one (forge, M6). coremltools palettizes to 1, 2, 3, 4,
# 6 or 8 bits, so these are the only two widths that could pad.
PADDED_BITS: dict[int, int] = {3: 4, 6: 8}


@dataclass(frozen=True)
class DecodedWeight:
    """One compressed weight the NE decodes each call (its format stays compressed)."""

    rule: str  # plan.streamed rule id: S-LUT, S-INT8, S-INT4-CHANNEL
    weights: int  # dense elements decoded per call
    stored_bytes: int  # what the NE streams for it (indices, palettes, scales)
    index_bits: int | None = None  # LUT only
    group: int | None = None  # LUT: output channels per palette; None: one per tensor
    granularity: str = "n/a"  # LUT: "per-tensor", "group 8", "per-channel", ...
    relative_cost: float = 1.0  # time relative to per tensor at the same bits (Apple's table)


def granularity_cost(group: int | None) -> float:
    """LUT time relative to one palette per tensor, from Apple's OPT-1.3B table.

    A group size between two measured ones gets the cheaper neighbour's cost (the larger
    group): the floor stays a floor of what was measured. Groups above 8 therefore cost 1.
    """
    if group is None:
        return 1.0
    measured = sorted(g for g in _OPT_LUT4_MS if g is not None)
    at_least = [g for g in measured if g >= group]
    if not at_least:
        return 1.0
    return _OPT_LUT4_MS[at_least[0]] / _OPT_LUT4_MS[None]


def padded_bits(bits: int) -> int:
    """The index width a ``bits``-bit index times like (forge, M6)."""
    return PADDED_BITS.get(bits, bits)


def padding_extra(weight: DecodedWeight) -> float:
    """Bytes its indices add to the weight's stream (at its relative cost) when they time like
    wider ones; the palettes are not padded."""
    bits = weight.index_bits
    if bits is None:
        return 0.0
    return weight.weights * (padded_bits(bits) - bits) / 8 * weight.relative_cost


def _granularity_name(group: int | None) -> str:
    if group is None:
        return "per-tensor"
    return "per-channel" if group == 1 else f"group {group}"


def _lut_group(indices: Any, lut: Any) -> tuple[int | None, bool]:
    """(output channels per palette or None for one palette, True when the grouping is along
    output channels only: the form Apple's table measures)."""
    if lut.rank != indices.rank + 2 or not indices.static or not lut.static:
        return None, lut.rank == 1  # the iOS16 form: one palette for the tensor
    per_axis = lut.shape[: indices.rank]
    if all(n == 1 for n in per_axis):
        return None, True
    if all(n == 1 for n in per_axis[1:]):
        return int(indices.shape[0]) // int(per_axis[0]), True
    return None, False


def _bits(dtype: str) -> int | None:
    digits = dtype.removeprefix("uint").removeprefix("int")
    return int(digits) if digits.isdigit() else None


def decoded_of(
    rule: str, consts: dict[str, Any], outputs: list[Any], stored: int
) -> DecodedWeight | None:
    """The `DecodedWeight` of a constexpr whose rule ``rule`` stays compressed, else None.

    ``consts`` and ``outputs`` are ``ops.Tensor``; ``stored`` is what its readers stream.
    """
    weights = sum(t.elements or 0 for t in outputs)
    if rule in ("S-INT8", "S-INT4-CHANNEL"):
        return DecodedWeight(rule, weights, stored)
    if rule != "S-LUT" or "indices" not in consts or "lut" not in consts:
        return None
    indices, lut = consts["indices"], consts["lut"]
    group, known = _lut_group(indices, lut)
    bits = _bits(indices.dtype)
    if lut.rank == 1 and lut.static:  # iOS16: the palette's length gives the width
        bits = max(int(lut.shape[0]) - 1, 1).bit_length()
    if not known:  # palettes along another axis: not in Apple's table, so no surcharge
        return DecodedWeight(rule, weights, stored, bits, None, "other (not in the table)")
    return DecodedWeight(
        rule, weights, stored, bits, group, _granularity_name(group), granularity_cost(group)
    )


def relative_costs_json() -> dict[str, Any]:
    """The relative costs the floor applies, with their sources and label."""
    return {
        "evidence": "predicted",
        "lut_granularity": {
            _granularity_name(g): round(granularity_cost(g), 3) for g in _OPT_LUT4_MS
        },
        "lut_granularity_source": GRANULARITY_SOURCE,
        "index_width": {f"{b}-bit": f"times like {p}-bit" for b, p in PADDED_BITS.items()},
        "index_width_source": PADDING_SOURCE,
    }
