"""Neural Engine figures and limits per chip: the one table the cost model and the per-chip
placement rules read.

Every figure carries a central value, a range (low, high) and its source; most are public
estimates, not Apple specifications (/work/shared/research/ane_rules.md sections 2.3 and 4).
Apple does not publish NE bandwidth; the weight-stream figures are community measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Platform = Literal["macOS", "iOS"]


@dataclass(frozen=True)
class Figure:
    """A number with its uncertainty and where it comes from."""

    value: float
    low: float
    high: float
    unit: str
    source: str

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "value": self.value,
            "low": self.low,
            "high": self.high,
            "unit": self.unit,
            "source": self.source,
        }


@dataclass(frozen=True)
class Chip:
    """One chip's NE: throughput, bandwidth, dispatch cost and the limits placement depends on."""

    name: str
    platform: Platform
    fp16_tflops: Figure
    int8_tops: Figure  # W8A8; equals the fp16 figure where there is no int8 fast path
    weight_stream_gbps: Figure
    dispatch_ms: Figure  # per NE segment (one program launch)
    cpu_gflops: Figure  # for ops predicted on the CPU
    cpu_gbps: Figure
    max_spatial: int  # largest non-channel axis (ane_rules R-DIM)
    max_channels: int
    model_budget_bytes: int  # above it the whole model leaves the NE (R-SIZE)
    native_trig: bool  # sin/cos on the NE (O-TRIG)
    texture_engine: bool  # resize / crop_resize on the NE (O-RESIZE)
    int8_fast_path: bool  # faster int8 x int8 compute (O-W8A8)

    def to_json(self) -> dict[str, Any]:
        """JSON form: every figure with its source, and the limits."""
        figures = ("fp16_tflops", "int8_tops", "weight_stream_gbps", "dispatch_ms")
        return {
            "name": self.name,
            "platform": self.platform,
            **{k: getattr(self, k).to_json() for k in figures},
            "cpu_gflops": self.cpu_gflops.to_json(),
            "cpu_gbps": self.cpu_gbps.to_json(),
            "max_spatial": self.max_spatial,
            "max_channels": self.max_channels,
            "model_budget_bytes": self.model_budget_bytes,
            "native_trig": self.native_trig,
            "texture_engine": self.texture_engine,
            "int8_fast_path": self.int8_fast_path,
        }


GB = 10**9
_BASE_BW_SOURCE = "anemll-bench Results.MD (model size / inference time, base chips cluster 55-70)"
_DISPATCH_UNMEASURED = Figure(
    0.095,
    0.07,
    0.23,
    "ms",
    "not measured on this chip: range of M4 0.095 (maderix), M1 0.23 "
    "(ane-guide ch.18 fit), 0.07 per program (ANEForge)",
)
# Core ML's own segmenter anchors for the CPU (reverse-engineered, ane-guide ch.18); the high
# end is what the CPU's matrix units reach, so CPU time has a wide range.
_CPU_GFLOPS = Figure(
    20.0,
    20.0,
    1000.0,
    "GFLOP/s",
    "ane-guide ch.18 segmenter anchor (CPU 20 "
    "GFLOP/s); high end: CPU matrix units, an order-of-magnitude guess",
)
_CPU_GBPS = Figure(
    10.0,
    10.0,
    60.0,
    "GB/s",
    "ane-guide ch.18 segmenter anchor (CPU 10 GB/s); high end: unified memory on base chips",
)

CHIPS: dict[str, Chip] = {
    c.name: c
    for c in [
        Chip(
            name="M1",
            platform="macOS",
            fp16_tflops=Figure(
                11.0,
                5.5,
                12.0,
                "TFLOP/s",
                "Apple M1: 11 TOPS, precision not "
                "stated (read as fp16; half if int8-style); ane-guide ch.9: ~12 "
                "fp16 TFLOP/s slope",
            ),
            int8_tops=Figure(
                11.0,
                5.5,
                12.0,
                "TOPS",
                "no int8 fast path (coremltools "
                "opt-quantization-overview: A17 Pro / M4 and later): fp16 figure",
            ),
            weight_stream_gbps=Figure(
                60.9,
                51.0,
                85.0,
                "GB/s",
                "anemll-bench M1 60.9; ane-guide M1: 51 weight stream, 85 DRAM roof",
            ),
            dispatch_ms=Figure(
                0.23, 0.07, 0.23, "ms", "ane-guide ch.18 M1 fit 0.23; ANEForge ~0.07 per program"
            ),
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=16384,
            max_channels=65536,
            model_budget_bytes=2 * GB,
            native_trig=False,
            texture_engine=False,
            int8_fast_path=False,
        ),
        Chip(
            name="M2",
            platform="macOS",
            fp16_tflops=Figure(
                15.8,
                7.9,
                15.8,
                "TFLOP/s",
                "Apple ML research (15.8 teraflops "
                "for this NE generation); hollance supported-devices",
            ),
            int8_tops=Figure(15.8, 7.9, 15.8, "TOPS", "no int8 fast path: fp16 figure"),
            weight_stream_gbps=Figure(
                60.5, 55.0, 70.0, "GB/s", f"anemll-bench M2 60.5; range: {_BASE_BW_SOURCE}"
            ),
            dispatch_ms=_DISPATCH_UNMEASURED,
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=16384,
            max_channels=65536,
            model_budget_bytes=2 * GB,
            native_trig=False,
            texture_engine=True,
            int8_fast_path=False,
        ),
        Chip(
            name="M3",
            platform="macOS",
            fp16_tflops=Figure(
                18.0,
                15.8,
                18.0,
                "TFLOP/s",
                "eeNews: 60% faster than M1 "
                "(about 18 TOPS); hollance lists 15.8 (conflict); M3 Pro direct "
                "path 16.8 (maderix)",
            ),
            int8_tops=Figure(18.0, 15.8, 18.0, "TOPS", "no int8 fast path: fp16 figure"),
            weight_stream_gbps=Figure(
                63.1, 55.0, 70.0, "GB/s", f"anemll-bench M3 63.1; range: {_BASE_BW_SOURCE}"
            ),
            dispatch_ms=_DISPATCH_UNMEASURED,
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=16384,
            max_channels=65536,
            model_budget_bytes=2 * GB,
            native_trig=True,
            texture_engine=True,
            int8_fast_path=False,
        ),
        Chip(
            name="M4",
            platform="macOS",
            fp16_tflops=Figure(
                18.6,
                10.9,
                19.0,
                "TFLOP/s",
                "maderix/ANE direct path 18.6 fp16; "
                "community 12.6 (M4 Pro) / 10.9 (M4 Max); Apple 38 TOPS is an "
                "int8-style count (about 19 fp16)",
            ),
            int8_tops=Figure(
                35.1, 35.1, 38.0, "TOPS", "maderix/ANE W8A8 35.1 measured; Apple 38 TOPS"
            ),
            weight_stream_gbps=Figure(
                64.2, 55.0, 70.0, "GB/s", f"anemll-bench M4 64.2; range: {_BASE_BW_SOURCE}"
            ),
            dispatch_ms=Figure(
                0.095, 0.07, 0.095, "ms", "maderix Part 2 (M4, direct path); ANEForge ~0.07"
            ),
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=65536,
            max_channels=65536,
            model_budget_bytes=2 * GB,
            native_trig=True,
            texture_engine=True,
            int8_fast_path=True,
        ),
        Chip(
            name="A17 Pro",
            platform="iOS",
            fp16_tflops=Figure(
                17.5,
                8.75,
                17.5,
                "TFLOP/s",
                "Apple 35 TOPS, widely read as int8 (half for fp16); no fp16 measurement published",
            ),
            int8_tops=Figure(
                35.0,
                17.5,
                35.0,
                "TOPS",
                "Apple 35 TOPS (hollance "
                "supported-devices); int8 fast path from A17 Pro (coremltools)",
            ),
            weight_stream_gbps=Figure(
                60.0,
                40.0,
                70.0,
                "GB/s",
                "no published measurement: "
                "borrowed from the M-series base chips (anemll-bench), "
                "range widened",
            ),
            dispatch_ms=_DISPATCH_UNMEASURED,
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=65536,
            max_channels=65536,
            model_budget_bytes=1 * GB,
            native_trig=True,
            texture_engine=True,
            int8_fast_path=True,
        ),
        Chip(
            name="M5",
            platform="macOS",
            fp16_tflops=Figure(
                19.6,
                19.6,
                19.6,
                "TFLOP/s",
                "ane-guide ch.12 matmul slope; Apple discloses no NE TOPS",
            ),
            int8_tops=Figure(
                19.6,
                19.6,
                39.2,
                "TOPS",
                "no figure; int8 fast path presumed "
                "(coremltools: newer than A17 Pro / M4), unmeasured",
            ),
            weight_stream_gbps=Figure(
                70.2, 70.2, 145.0, "GB/s", "anemll-bench M5 70.2; ane-guide ch.12 ~145 (conflict)"
            ),
            dispatch_ms=_DISPATCH_UNMEASURED,
            cpu_gflops=_CPU_GFLOPS,
            cpu_gbps=_CPU_GBPS,
            max_spatial=65536,
            max_channels=65536,
            model_budget_bytes=2 * GB,
            native_trig=True,
            texture_engine=True,
            int8_fast_path=True,
        ),
    ]
}

# The chip whose limits are strictest: the default for a static report.
STRICTEST = "M1"


def chip(name: str) -> Chip:
    """The chip called ``name`` (case-insensitive, spaces optional)."""
    from converter.errors import InputError

    key = name.replace(" ", "").lower()
    for c in CHIPS.values():
        if c.name.replace(" ", "").lower() == key:
            return c
    raise InputError(f"unknown chip {name!r}; known: {', '.join(CHIPS)}")


def chips_for(platform: str | None) -> list[Chip]:
    """The chips of one platform ("macOS" or "iOS"), or every chip for None."""
    return [c for c in CHIPS.values() if platform is None or c.platform == platform]
