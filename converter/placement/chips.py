"""Neural Engine figures and limits per chip: the one table the cost model and the per-chip
placement rules read.

Every figure carries a central value, a range (low, high) and its source; most are public
estimates, not Apple specifications (docs/placement-rules.md sections 2.3 and 4).
Apple does not publish NE bandwidth; the weight-stream figures are community measurements.
A weight-decode rate (the NE's cap on compressed weights per second) is carried only where it
was measured; elsewhere it is None and the cost model has no third bound. `VARIANTS` are
chips with their base chip's NE (the same placement) and their own memory figures: the cost
model prices them, the placement rules and gates use the base chip.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from converter.placement.decode import PADDING_SOURCE

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
    max_spatial: int  # largest non-channel axis (docs/placement-rules.md R-DIM)
    max_channels: int
    model_budget_bytes: int  # above it the whole model leaves the NE (R-SIZE)
    native_trig: bool  # sin/cos on the NE (O-TRIG)
    texture_engine: bool  # resize / crop_resize on the NE (O-RESIZE)
    int8_fast_path: bool  # faster int8 x int8 compute (O-W8A8)
    # G weights/s the NE decodes compressed weights at; None: not measured, no cap
    decode_gweights: Figure | None = None
    index_padding: bool = True  # 3/6-bit indices time like 4/8 bits (plan.decode)
    index_padding_source: str = ""
    variant_of: str | None = None  # a variant's base chip: its placement is the base's

    @property
    def placement_chip(self) -> str:
        """The chip whose placement rules this one follows (itself, or a variant's base)."""
        return self.variant_of or self.name

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
            "decode_gweights": (
                self.decode_gweights.to_json()
                if self.decode_gweights is not None
                else "not measured: no weight-decode bound"
            ),
            "index_padding": self.index_padding,
            "index_padding_source": self.index_padding_source,
            "variant_of": self.variant_of,
        }


GB = 10**9
MAX_CHANNELS = 65536  # the same on every chip listed
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
_NO_INT8_FAST_PATH = "no int8 fast path: fp16 figure"
_PADDING_UNMEASURED = (True, f"not measured on this chip, applied from: {PADDING_SOURCE}")
_LUT6_HEAD = "llama_lm_head_lut6: the 128256 x 4096 head (525 M weights, 396 MB)"

# Placement limits, one row per chip: platform; largest non-channel axis (R-DIM); model size
# in GB above which the whole model leaves the NE (R-SIZE); sin/cos on the NE (O-TRIG);
# resize / crop_resize on the NE (O-RESIZE); faster int8 x int8 compute (O-W8A8). The row
# order is the order of CHIPS.
# fmt: off
_LIMITS: dict[str, tuple[Platform, int, int, bool, bool, bool]] = {
    #           platform  spatial  GB  trig   texture  int8 fast path
    "M1":      ("macOS",  16384,   2,  False, False,   False),
    "M2":      ("macOS",  16384,   2,  False, True,    False),
    "M3":      ("macOS",  16384,   2,  True,  True,    False),
    "M4":      ("macOS",  65536,   2,  True,  True,    True),
    "A17 Pro": ("iOS",    65536,   1,  True,  True,    True),
    "M5":      ("macOS",  65536,   2,  True,  True,    True),
}
# fmt: on

_Row = tuple[float, float, float, str]  # value, low, high, source; the unit is the field's


@dataclass(frozen=True)
class _NeFigures:
    """One chip's own NE figures; what a chip leaves out is filled in by `_chip`."""

    fp16_tflops: _Row  # TFLOP/s
    weight_stream_gbps: _Row  # GB/s
    int8_tops: _Row | None = None  # TOPS; None: the fp16 figure (no int8 fast path)
    dispatch_ms: _Row | None = None  # ms; None: not measured, `_DISPATCH_UNMEASURED`
    decode_gweights: _Row | None = None  # G weights/s; None: not measured, no cap
    index_padding: tuple[bool, str] | None = None  # None: `_PADDING_UNMEASURED`


_FIGURES: dict[str, _NeFigures] = {
    "M1": _NeFigures(
        fp16_tflops=(
            11.0,
            5.5,
            12.0,
            "Apple M1: 11 TOPS, precision not stated (read as fp16; half if int8-style); "
            "ane-guide ch.9: ~12 fp16 TFLOP/s slope",
        ),
        int8_tops=(
            11.0,
            5.5,
            12.0,
            "no int8 fast path (coremltools opt-quantization-overview: A17 Pro / M4 and "
            "later): fp16 figure",
        ),
        weight_stream_gbps=(
            60.9,
            51.0,
            85.0,
            "anemll-bench M1 60.9; ane-guide M1: 51 weight stream, 85 DRAM roof",
        ),
        dispatch_ms=(0.23, 0.07, 0.23, "ane-guide ch.18 M1 fit 0.23; ANEForge ~0.07 per program"),
    ),
    "M2": _NeFigures(
        fp16_tflops=(
            15.8,
            7.9,
            15.8,
            "Apple ML research (15.8 teraflops for this NE generation); hollance supported-devices",
        ),
        weight_stream_gbps=(60.5, 55.0, 70.0, f"anemll-bench M2 60.5; range: {_BASE_BW_SOURCE}"),
    ),
    "M3": _NeFigures(
        fp16_tflops=(
            18.0,
            15.8,
            18.0,
            "eeNews: 60% faster than M1 (about 18 TOPS); hollance lists 15.8 (conflict); "
            "M3 Pro direct path 16.8 (maderix)",
        ),
        weight_stream_gbps=(63.1, 55.0, 70.0, f"anemll-bench M3 63.1; range: {_BASE_BW_SOURCE}"),
    ),
    "M4": _NeFigures(
        fp16_tflops=(
            18.6,
            10.9,
            19.0,
            "maderix/ANE direct path 18.6 fp16; community 12.6 (M4 Pro) / 10.9 (M4 Max); "
            "Apple 38 TOPS is an int8-style count (about 19 fp16)",
        ),
        int8_tops=(35.1, 35.1, 38.0, "maderix/ANE W8A8 35.1 measured; Apple 38 TOPS"),
        weight_stream_gbps=(64.2, 55.0, 70.0, f"anemll-bench M4 64.2; range: {_BASE_BW_SOURCE}"),
        dispatch_ms=(0.095, 0.07, 0.095, "maderix Part 2 (M4, direct path); ANEForge ~0.07"),
        # No decode rate: the measured LUT6 head is bytes-bound here (anchors_runtime.md 6).
        index_padding=(
            False,
            f"anemll-bench issue 5 (base M4): {_LUT6_HEAD} in 6.45 ms at 61.4 GB/s vs fp16 "
            "64.2 GB/s, 2.5x faster: its 6-bit indices stream unpadded",
        ),
    ),
    "A17 Pro": _NeFigures(
        fp16_tflops=(
            17.5,
            8.75,
            17.5,
            "Apple 35 TOPS, widely read as int8 (half for fp16); no fp16 measurement published",
        ),
        int8_tops=(
            35.0,
            17.5,
            35.0,
            "Apple 35 TOPS (hollance supported-devices); int8 fast path from A17 Pro (coremltools)",
        ),
        weight_stream_gbps=(
            60.0,
            40.0,
            70.0,
            "no published measurement: borrowed from the M-series base chips (anemll-bench), "
            "range widened",
        ),
    ),
    "M5": _NeFigures(
        fp16_tflops=(19.6, 19.6, 19.6, "ane-guide ch.12 matmul slope; Apple discloses no NE TOPS"),
        int8_tops=(
            19.6,
            19.6,
            39.2,
            "no figure; int8 fast path presumed (coremltools: newer than A17 Pro / M4), unmeasured",
        ),
        weight_stream_gbps=(
            70.2,
            70.2,
            145.0,
            "anemll-bench M5 70.2; ane-guide ch.12 ~145 (conflict)",
        ),
    ),
}


# Variants: the base chip's NE (placement limits, rules) with their own memory figures. Only
# chips with a measured weight-decode rate are listed (anchors_runtime.md section 6).
_VARIANTS: dict[str, tuple[str, _NeFigures]] = {
    "M4 Max": (
        "M4",
        _NeFigures(
            fp16_tflops=(
                18.6,
                10.9,
                19.0,
                "the M4's NE (ANEForge PR #271: same 16-core NE generation as the base M4); "
                "maderix/ANE M4 direct path 18.6; community 10.9 measured on M4 Max",
            ),
            int8_tops=(35.1, 35.1, 38.0, "the M4's NE: maderix/ANE W8A8 35.1 (M4); Apple 38 TOPS"),
            weight_stream_gbps=(
                118.9,
                118.9,
                120.2,
                "anemll-bench Results.MD M4 Max 118.9; issue 1: fp16 lm_head 120.2 GB/s",
            ),
            decode_gweights=(
                130.0,
                130.0,
                130.0,
                f"anemll-bench issue 1 (M4 Max): {_LUT6_HEAD} in 4.03 ms, about 130 G weights/s "
                "at 98 GB/s, below the fp16 stream: capped by weight rate, not bytes "
                "(anchors_runtime.md section 6); one measurement",
            ),
            index_padding=(
                False,
                "anemll-bench issue 1 (M4 Max): the LUT6 head's 130 G weights/s would need 130 "
                "GB/s as 8-bit indices, above the 120 GB/s fp16 stream: not padded",
            ),
        ),
    ),
    "M5 Max": (
        "M5",
        _NeFigures(
            fp16_tflops=(19.27, 19.27, 19.27, "maderix/ANE PR #50 (M5 Max): 19.27 TFLOPS fp16"),
            int8_tops=(35.61, 35.61, 35.61, "maderix/ANE PR #50 (M5 Max): 35.61 TOPS W8A8"),
            weight_stream_gbps=(
                159.0,
                145.0,
                159.0,
                "anemll-forge RESULTS_M5_MAX_INT8.md: fp16 dense 159 GB/s (4096x4096 conv "
                "chains), 145 GB/s (32 parallel 2048x2048 weights)",
            ),
            decode_gweights=(
                150.0,
                125.0,
                155.0,
                "anemll-forge RESULTS_M5_MAX_INT8.md: every LUT from 4 to 0.5 bits/weight at "
                "0.150-0.155 T weights/s (chains), 0.125-0.130 (parallel), the int8 dense "
                "time (1.0x int8, 1.95x fp16; anchors_runtime.md section 6)",
            ),
        ),
    ),
}


def _figure(row: _Row, unit: str) -> Figure:
    value, low, high, source = row
    return Figure(value, low, high, unit, source)


def _chip(name: str, ne: _NeFigures) -> Chip:
    """Chip ``name`` from its row of `_LIMITS` and its figures ``ne``."""
    platform, max_spatial, budget_gb, native_trig, texture_engine, int8_fast_path = _LIMITS[name]
    fp16_value, fp16_low, fp16_high, _ = ne.fp16_tflops
    int8 = ne.int8_tops or (fp16_value, fp16_low, fp16_high, _NO_INT8_FAST_PATH)
    dispatch = _DISPATCH_UNMEASURED if ne.dispatch_ms is None else _figure(ne.dispatch_ms, "ms")
    decode = None if ne.decode_gweights is None else _figure(ne.decode_gweights, "G weights/s")
    padding, padding_source = ne.index_padding or _PADDING_UNMEASURED
    return Chip(
        name=name,
        platform=platform,
        fp16_tflops=_figure(ne.fp16_tflops, "TFLOP/s"),
        int8_tops=_figure(int8, "TOPS"),
        weight_stream_gbps=_figure(ne.weight_stream_gbps, "GB/s"),
        dispatch_ms=dispatch,
        cpu_gflops=_CPU_GFLOPS,
        cpu_gbps=_CPU_GBPS,
        max_spatial=max_spatial,
        max_channels=MAX_CHANNELS,
        model_budget_bytes=budget_gb * GB,
        native_trig=native_trig,
        texture_engine=texture_engine,
        int8_fast_path=int8_fast_path,
        decode_gweights=decode,
        index_padding=padding,
        index_padding_source=padding_source,
    )


CHIPS: dict[str, Chip] = {name: _chip(name, _FIGURES[name]) for name in _LIMITS}
# Priced by the cost model only: placement and gates use the base chip (`Chip.variant_of`).
VARIANTS: dict[str, Chip] = {
    name: replace(_chip(base, ne), name=name, variant_of=base)
    for name, (base, ne) in _VARIANTS.items()
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


def cost_chips() -> list[Chip]:
    """Every chip the cost model prices: the placement chips, each followed by its variants."""
    out = []
    for c in CHIPS.values():
        out += [c, *[v for v in VARIANTS.values() if v.variant_of == c.name]]
    return out


def chips_for(platform: str | None) -> list[Chip]:
    """The chips of one platform ("macOS" or "iOS"), or every chip for None."""
    return [c for c in CHIPS.values() if platform is None or c.platform == platform]
