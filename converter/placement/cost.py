"""The cost model (evidence ``predicted``): a latency floor per chip from a placement report.

For each function: the NE part is ``max(NE FLOPs / peak, NE weight bytes / weight-stream
bandwidth, NE compressed weights / weight-decode rate)`` (SPEC section 6); the third term only
on chips where a decode rate was measured (``plan.chips``). A compressed weight's bytes and
decoded weights are scaled by its relative cost (LUT granularity), and its index bytes padded
where the chip pads 3/6-bit indices (``plan.decode``, both predictions from sources). Ops
placed on the CPU add ``max(FLOPs / CPU rate, weight bytes / CPU bandwidth)``; the bytes
crossing devices, the inputs read by the NE (a state's reads among them), a state's writes
and the outputs are copies at the NE bandwidth;
every NE segment pays one dispatch. The central figure uses each chip's central values; the
range uses the optimistic and pessimistic ends of every figure.
It is a model: a floor from published figures, never a measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from converter.evidence.labels import MEANING, Evidence
from converter.placement.chips import Chip
from converter.placement.decode import DecodedWeight, padding_extra, relative_costs_json
from converter.placement.report import FunctionReport, PlacementReport

MODEL_NOTE = (
    "a model, not a measurement: a floor from published chip figures "
    "(converter/placement/chips.py); "
    "real latency is higher"
)


@dataclass(frozen=True)
class Work:
    """What the cost model reads from one function's placement."""

    ne_flops: int
    ne_weight_bytes: int
    cpu_flops: int
    cpu_weight_bytes: int
    copy_bytes: int  # crossing + NE-read inputs
    output_bytes: int
    ne_segments: int
    w8a8: bool  # int8 activations: the int8 throughput applies
    # Compressed weights on the NE (plan.decode): the bytes their relative cost adds, the bytes
    # padded indices add where the chip pads, and the weights decoded (relative cost applied).
    ne_relative_bytes: float = 0.0
    ne_padding_bytes: float = 0.0
    ne_decoded_weights: float = 0.0


@dataclass(frozen=True)
class Floor:
    """The predicted floor of one function on one chip, in milliseconds."""

    function: str
    chip: str
    ms: float
    low_ms: float
    high_ms: float
    # the largest term: "compute", "weights", "weight-decode", "cpu", "copies" or "dispatch"
    bound: str
    components_ms: dict[str, float]
    evidence: Evidence = Evidence.PREDICTED

    def to_json(self) -> dict[str, Any]:
        """JSON form; carries the evidence label and says it is a model."""
        data = asdict(self)
        data["evidence"] = self.evidence.value
        data["note"] = MODEL_NOTE
        return data


def with_decoded(work: Work, decoded: list[DecodedWeight]) -> Work:
    """``work`` with the compressed weights the NE reads: the bytes their relative cost adds,
    the bytes padded indices add, and the decoded weights scaled by their relative cost."""
    return replace(
        work,
        ne_relative_bytes=sum(d.stored_bytes * (d.relative_cost - 1.0) for d in decoded),
        ne_padding_bytes=sum(padding_extra(d) for d in decoded),
        ne_decoded_weights=sum(d.weights * d.relative_cost for d in decoded),
    )


def work_of(function: FunctionReport, w8a8: bool = False) -> Work:
    """The work of one function, split by device (constants excluded)."""
    ne = [r for r in function.rows if r.device == "NE"]
    off = [r for r in function.rows if r.device not in ("NE", "none")]
    s = function.summary
    work = Work(
        ne_flops=sum(r.flops or 0 for r in ne),
        ne_weight_bytes=sum(r.weight_bytes for r in ne),
        cpu_flops=sum(r.flops or 0 for r in off),
        cpu_weight_bytes=sum(r.weight_bytes for r in off),
        # A state (KV cache) is read as a function input and written back every call.
        copy_bytes=s.boundary_bytes + s.input_bytes + s.state_write_bytes,
        output_bytes=s.output_bytes,
        ne_segments=s.ne_segments,
        w8a8=w8a8,
    )
    return with_decoded(work, [d for r in ne for d in r.decoded])


def _terms(work: Work, chip: Chip, end: str) -> dict[str, float]:
    """Milliseconds per component with the figures' ``value``, ``high`` (fast) or ``low``."""
    fast = end == "high"

    def pick(figure: Any, time_like: bool = False) -> float:
        if end == "value":
            return float(figure.value)
        # For rates the fast end is the high figure; for a time (dispatch) the low one.
        return float(figure.low if fast == time_like else figure.high)

    peak = chip.int8_tops if work.w8a8 else chip.fp16_tflops
    tflops = pick(peak)
    gbps = pick(chip.weight_stream_gbps)
    ne_bytes = work.ne_weight_bytes + work.ne_relative_bytes
    ne_bytes += work.ne_padding_bytes if chip.index_padding else 0.0
    # No measured decode rate: no third bound (SPEC section 6), not a guessed one.
    rate = chip.decode_gweights
    decode = 0.0 if rate is None else work.ne_decoded_weights / (pick(rate) * 1e9) * 1e3
    return {
        "ne_compute": work.ne_flops / (tflops * 1e12) * 1e3,
        "ne_weights": ne_bytes / (gbps * 1e9) * 1e3,
        "ne_decode": decode,
        "cpu": max(
            work.cpu_flops / (pick(chip.cpu_gflops) * 1e9),
            work.cpu_weight_bytes / (pick(chip.cpu_gbps) * 1e9),
        )
        * 1e3,
        "copies": work.copy_bytes / (gbps * 1e9) * 1e3,
        "outputs": work.output_bytes / (gbps * 1e9) * 1e3,
        "dispatch": work.ne_segments * pick(chip.dispatch_ms, time_like=True),
    }


def _total(t: dict[str, float]) -> float:
    ne = max(t["ne_compute"], t["ne_weights"], t["ne_decode"])
    return ne + t["cpu"] + t["copies"] + t["outputs"] + t["dispatch"]


def _bound(t: dict[str, float]) -> str:
    """The largest term: NE "compute", "weights" or "weight-decode", "cpu", "copies" or
    "dispatch" (a tie goes to the first)."""
    terms = {
        "compute": t["ne_compute"],
        "weights": t["ne_weights"],
        "weight-decode": t["ne_decode"],
        "cpu": t["cpu"],
        "copies": t["copies"] + t["outputs"],
        "dispatch": t["dispatch"],
    }
    return max(terms, key=lambda k: terms[k])


def floor(function: FunctionReport, chip: Chip, w8a8: bool = False) -> Floor:
    """The predicted floor of ``function`` on ``chip`` (central value and range)."""
    return floor_of_work(function.name, work_of(function, w8a8), chip)


def floor_of_work(name: str, work: Work, chip: Chip) -> Floor:
    """The predicted floor of the work ``work`` (of function ``name``) on ``chip``."""
    central = _terms(work, chip, "value")
    return Floor(
        function=name,
        chip=chip.name,
        ms=_total(central),
        low_ms=_total(_terms(work, chip, "high")),
        high_ms=_total(_terms(work, chip, "low")),
        bound=_bound(central),
        components_ms=central,
    )


def cost_section(
    placements: list[tuple[Chip, PlacementReport]], w8a8: bool = False
) -> dict[str, Any]:
    """The ``predicted`` section: floors per function and chip, each from that chip's own
    placement, with the chips' figures and sources."""
    floors = [floor(f, c, w8a8).to_json() for c, report in placements for f in report.functions]
    return {
        "evidence": Evidence.PREDICTED.value,
        "meaning": MEANING[Evidence.PREDICTED],
        "note": MODEL_NOTE,
        "placement_from": sorted({report.evidence.value for _, report in placements}),
        "formula": "max(NE FLOPs / peak, NE weight bytes / bandwidth, NE compressed weights / "
        "weight-decode rate, on chips with a sourced rate only) + CPU ops + copies (crossing "
        "+ NE inputs + state writes) + outputs at NE bandwidth + dispatch per NE segment; "
        "compressed weights scaled by their relative cost (LUT granularity, index width)",
        "floors": floors,
        "chips": {c.name: c.to_json() for c, _ in placements},
        "relative_costs": relative_costs_json(),
    }
