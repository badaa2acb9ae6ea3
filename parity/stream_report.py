"""The residual stream's measured range and the power-of-two scales chosen from it, as the
parity report shows them (`graph_passes.stream_scale`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from graph_passes.stream_scale import FP16_MAX, LIMIT, StreamScaling

RANGE_SERIES = {
    "stream": "residual stream",
    "attention_out": "attention output",
    "mlp_product": "act(gate) * up",
    "mlp_out": "down projection output",
    "projections": "q/k/v, gate/up outputs",
}
MEASURED_ON = (
    "largest |value| per layer, fp32, the checkpoint's scale, on every fixture position "
    "(padding included)"
)


def stream_to_json(scaling: StreamScaling) -> dict[str, Any]:
    """The ``stream`` section of parity.json."""
    return {
        "measured_on": MEASURED_ON,
        "limit": LIMIT,
        "fp16_max": FP16_MAX,
        "scale": scaling.scale,
        "peak": scaling.peak,
        "branch_scales": [{**dataclasses.asdict(b), "where": b.where} for b in scaling.branches],
        "layers": [dataclasses.asdict(row) for row in scaling.layers],
        "scaled_tensors": [dataclasses.asdict(t) for t in scaling.tensors],
        "weights_to_fp16_subnormal": scaling.to_subnormal,
        "weights_to_fp16_zero": scaling.to_zero,
    }


def stream_to_text(scaling: StreamScaling) -> str:
    """The range table and the chosen scales, for parity.txt."""
    lines = [
        f"Residual stream range ({MEASURED_ON}); values above {LIMIT:g} are scaled by powers "
        "of two:",
        f"  stream scale s = {scaling.scale:g} (peak |h| {scaling.peak:.1f}, "
        f"{FP16_MAX / max(scaling.peak * scaling.scale, 1e-30):.2f}x below fp16's largest "
        "value once scaled)",
    ]
    for b in scaling.branches:
        lines.append(
            f"  branch scale {b.scale:g} at {b.where} (layer {b.layer} {b.branch}: "
            f"{b.measured:.1f} inside the branch)"
        )
    if scaling.tensors:
        lines.append(
            f"  scaled weights pushed into fp16 subnormals: {scaling.to_subnormal}, to zero: "
            f"{scaling.to_zero} (over {len(scaling.tensors)} tensors)"
        )
    lines.append("layer  " + "  ".join(f"{name:>12}" for name in RANGE_SERIES))
    for row in scaling.layers:
        values = "  ".join(f"{getattr(row, key):>12.1f}" for key in RANGE_SERIES)
        lines.append(f"{row.layer:>5}  {values}")
    return "\n".join(lines)
