"""What the Neural Engine streams for a compressed weight: placement rules saying which stored
formats stay compressed in NE memory (the NE reads the stored bytes each call) and which are
expanded to fp16 when the model loads (the NE reads the dense fp16 weight each call).

A prediction from published sources, not a measurement: no anec run has read the NE's memory
traffic. The sources are in ``../shared/research/ane_rules.md`` (rows O-QW, O-BLOCK4) and
``anchors_runtime.md``; each rule carries its own and a confidence (H / M / L as there).
``ops.function_table`` charges each reader of a constexpr what its rule says, so the static
report's "weight bytes on the NE" and the cost model's floor (``plan.cost``) use the streamed
figure, not the file size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamRule:
    """One placement rule for a stored weight format."""

    id: str
    format: str
    stays_compressed: bool
    confidence: str  # H, M, L
    source: str


LUT = StreamRule(
    "S-LUT",
    "constexpr_lut_to_dense (palettes, 1-8 bit, per tensor or per grouped channel)",
    True,
    "M",
    "ane_rules.md O-QW: coremltools opt-overview.md (palettization 'typically works the best "
    "on the Neural Engine'); anchors_runtime.md: Anemll ships LUT4/LUT6 per grouped channel "
    "for its NE models and sizes their weight streams by the palettized bytes",
)
INT8_CHANNEL = StreamRule(
    "S-INT8",
    "constexpr_affine_dequantize / blockwise_shift_scale, int8, one scale per output channel",
    True,
    "M",
    "ane_rules.md O-QW: coremltools opt-quantization-perf.md (per-channel int8 recommended on "
    "the NE); an int8 decoder kept its linear/matmul on the NE (dump D1). Conflict noted "
    "there: stablehlo-coreml PR #110 saw int4/int8 constexpr consumers on the CPU",
)
INT4_CHANNEL = StreamRule(
    "S-INT4-CHANNEL",
    "constexpr_blockwise_shift_scale, int4, one scale per output channel",
    True,
    "L",
    "ane_rules.md O-QW (per-channel is the form recommended on the NE) by analogy with int8; "
    "no source measures per-channel int4 on the NE",
)
BLOCK = StreamRule(
    "S-BLOCK",
    "constexpr_blockwise_shift_scale with blocks along the input axis (per-block int4/int8)",
    False,
    "L",
    "ane_rules.md O-BLOCK4: coremltools opt-quantization-perf.md (per-block is for the GPU; "
    "'on the NE, it is recommended to use the per-channel'): expect dequantisation to fp16; "
    "Anemll README ('lack of Block Quantization on ANE'). ane-guide appendix A says blockwise "
    "streams natively from M3: not applied (one rule for every chip)",
)
OTHER = StreamRule(
    "S-OTHER",
    "any other constexpr (sparse masks, joint formats)",
    False,
    "L",
    "no source says the NE keeps these compressed; counted dense (fp16) to keep the floor a "
    "floor of what is known",
)
RULES = (LUT, INT8_CHANNEL, INT4_CHANNEL, BLOCK, OTHER)


def rule_for(op_type: str, consts: dict[str, Any]) -> StreamRule:
    """The rule for a constexpr op ``op_type`` with constant inputs ``consts`` (name ->
    ``ops.Tensor``)."""
    if op_type == "constexpr_lut_to_dense":
        return LUT
    if op_type == "constexpr_affine_dequantize":
        return INT8_CHANNEL  # its scale is per tensor or per the one axis: never per block
    if op_type == "constexpr_blockwise_shift_scale":
        data, scale = consts.get("data"), consts.get("scale")
        if data is None or scale is None:
            return OTHER
        per_channel = all(s == 1 for s in scale.shape[1:]) or scale.rank < data.rank
        if not per_channel:
            return BLOCK
        return INT4_CHANNEL if data.dtype in ("int4", "uint4") else INT8_CHANNEL
    return OTHER


def rules_json() -> list[dict[str, Any]]:
    """Every rule, for the report."""
    return [vars(r) | {"evidence": "predicted"} for r in RULES]


def streamed_section(table: Any) -> dict[str, Any]:
    """Per function of an ``ops.OpTable``: the weight bytes the program stores (every constant
    once, the file's weights) against the bytes its ops read per call under these rules, and
    the compressed weights by rule. Labelled a prediction."""
    functions = {}
    for f in table.functions:
        per_call = sum(op.weight_bytes for op in f.ops)
        functions[f.name] = {
            "weight_bytes_stored": f.weight_bytes_stored,
            "weight_bytes_read_per_call": per_call,
            "by_rule": f.streamed,
        }
    return {
        "evidence": "predicted",
        "meaning": "which stored formats the NE keeps compressed (it reads the stored bytes) "
        "and which are expanded to fp16 at load (it reads the dense bytes), from published "
        "sources; the cost model's NE weight bytes use this figure, not the file size",
        "functions": functions,
        "rules": rules_json(),
    }


def streamed_lines(section: dict[str, Any]) -> list[str]:
    """The section as text lines."""
    mib = 2**20
    lines = ["weight bytes per call (predicted; rules in plan.streamed, sources in the JSON):"]
    for name, f in section["functions"].items():
        lines.append(
            f"  {name}: read per call {f['weight_bytes_read_per_call'] / mib:.2f} MiB, stored "
            f"{f['weight_bytes_stored'] / mib:.2f} MiB"
        )
        for rule, t in sorted(f["by_rule"].items()):
            state = next(r for r in RULES if r.id == rule)
            how = "stays compressed" if state.stays_compressed else "expanded to fp16 at load"
            lines.append(
                f"    {rule} ({state.confidence}): {t['weights']} weights, stored "
                f"{t['stored'] / mib:.2f} MiB, read {t['streamed'] / mib:.2f} MiB - {how}"
            )
    return lines
