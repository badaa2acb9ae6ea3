"""``method: int8``: affine int8 weights, one scale (and, asymmetric, one zero point) per
output channel: the form the Neural Engine runs well (per-block int4 is GPU-oriented).

The program holds ``constexpr_affine_dequantize``; the values are coremltools' own
``linear_quantize_weights``.
"""

from __future__ import annotations

from typing import Any

from converter.compression.methods.base import (
    CompressionMethod,
    Problem,
    Scheme,
    VariantFields,
    quiet_progress,
)
from converter.compression.sites import WeightSite


def int8_problems(variant: VariantFields) -> list[Problem]:
    """The rules of int8 weights (shared with ``w8a8``)."""
    problems: list[Problem] = []
    if variant.bits not in (None, 8):
        problems.append((("bits",), f"{variant.method} is 8 bits; remove bits or set 8"))
    if variant.granularity != "per-channel":
        problems.append(
            (
                ("granularity",),
                "int8 weights are per-channel (per output channel: the form the NE "
                "runs well; per-block int4 is GPU-oriented)",
            )
        )
    return problems


class Int8(CompressionMethod):
    """Affine int8 weights, per output channel, symmetric or with a zero point."""

    name = "int8"
    summary = "int8 weights per output channel, symmetric or with a zero point per channel"
    fields = {"symmetric": "weights have a zero point"}
    order = 20
    kv_cache = True
    records_symmetry = True

    def check(self, variant: VariantFields) -> list[Problem]:
        return int8_problems(variant)

    def scheme(self, variant: VariantFields) -> Scheme:
        return Scheme("int8", 8, "per-channel", None, variant.symmetric)

    def describe(self, scheme: Scheme) -> str:
        kind = "symmetric" if scheme.symmetric else "asymmetric"
        return f"int8 {scheme.granularity} {kind}"

    def ct_config(self, scheme: Scheme) -> Any:
        from coremltools.optimize.coreml import OpLinearQuantizerConfig

        return OpLinearQuantizerConfig(
            mode="linear_symmetric" if scheme.symmetric else "linear",
            dtype="int8",
            granularity="per_channel",
            weight_threshold=1,
        )

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        zero = "zero point 0" if scheme.symmetric else "zero point per channel"
        return f"affine int8 per output channel ({zero}), coremltools linear_quantize_weights"

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        from coremltools.optimize.coreml import OptimizationConfig, linear_quantize_weights

        with quiet_progress():
            return linear_quantize_weights(mlmodel, OptimizationConfig(op_name_configs=op_configs))


METHOD = Int8()
