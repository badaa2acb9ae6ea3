"""The placement report: one structure for static predictions and for compute plans.

A report carries exactly one evidence label (``static`` or ``compute-plan``); its rows give
every op its device and the rule (or plan) that decided it, and its summary gives the NE
shares of ops, FLOPs and weight bytes, the device transitions and NE segments along the
program, the bytes crossing devices, per-layer residency, and every op that breaks NE
residency with its reason and fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from converter.evidence.labels import Evidence
from converter.placement.decode import DecodedWeight
from converter.placement.ops import Function, Op, Tensor


@dataclass
class Row:
    """One op of the table with its placement."""

    function: str
    index: int
    op_type: str
    name: str
    shape: list[int | None]
    dtype: str
    flops: int | None
    weight_bytes: int
    device: str
    rule: str
    confidence: str | None
    reason: str
    fix: str
    layer: int | None
    flags: list[str] = field(default_factory=list)
    also: str | None = None  # static: the op rule that agrees when a global rule decided
    supported: list[str] | None = None  # compute-plan only
    cost_weight: float | None = None  # compute-plan only: MLComputePlanCost.weight
    other_chips: dict[str, str] = field(default_factory=dict)  # static: chip -> device if different
    decoded: list[DecodedWeight] = field(default_factory=list)  # compressed weights it reads


@dataclass
class Segment:
    """A run of consecutive dispatchable ops on one device, in program order."""

    device: str
    first: int  # op index
    last: int
    ops: int
    flops: int


@dataclass
class Summary:
    """Totals of one function (or of the whole package)."""

    ops: int
    ops_ne: int
    flops: int
    flops_ne: int
    weight_bytes: int
    weight_bytes_ne: int
    transitions: int
    ne_segments: int
    segments: list[Segment]
    boundary_bytes: int  # tensors crossing devices inside the program, padded rows on the NE
    input_bytes: int  # function inputs read by NE ops (host -> NE)
    output_bytes: int  # function outputs (padded rows when the NE writes them)
    unknown_flops_ops: int
    layers: int
    layers_all_ne: int
    breakers: list[Row]
    # A stateful function's state (a KV cache) per call: bytes read_state reads (also counted
    # in input_bytes: the state is a function input) and bytes written back.
    state_read_bytes: int = 0
    state_write_bytes: int = 0
    layer_ops: int = 0  # placed ops inside a transformer layer (the rest: embedding, head)

    @property
    def ops_per_layer(self) -> float | None:
        """Placed ops per transformer layer (None without layers)."""
        return self.layer_ops / self.layers if self.layers else None

    def share(self, part: str) -> float | None:
        """NE share of "ops", "flops" or "weight_bytes" (None when the total is 0)."""
        total = getattr(self, part)
        return getattr(self, f"{part}_ne") / total if total else None

    def to_json(self) -> dict[str, Any]:
        """JSON form with the three shares spelled out."""
        data = asdict(self)
        data["ne_share"] = {k: self.share(k) for k in ("ops", "flops", "weight_bytes")}
        data["ops_per_layer"] = self.ops_per_layer
        return data


@dataclass
class FunctionReport:
    """The rows and summary of one function."""

    name: str
    rows: list[Row]
    summary: Summary


@dataclass
class PlacementReport:
    """Where the ops of one package go, from one kind of evidence."""

    evidence: Evidence
    package: str
    content_sha256: str
    compute_units: str
    functions: list[FunctionReport]
    chip: str | None = None  # static: the chip the rows are for
    calibration: str | None = None  # static: "uncalibrated" until compared with a real dump
    chips: dict[str, dict[str, Any]] = field(default_factory=dict)  # static: per-chip summary
    source: dict[str, Any] = field(default_factory=dict)  # compute-plan: where it was recorded
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form; the evidence label is the first key."""
        return {
            "evidence": self.evidence.value,
            "calibration": self.calibration,
            "package": self.package,
            "content_sha256": self.content_sha256,
            "compute_units": self.compute_units,
            "chip": self.chip,
            "chips": self.chips,
            "source": self.source,
            "notes": self.notes,
            "functions": [
                {
                    "name": f.name,
                    "summary": f.summary.to_json(),
                    "rows": [asdict(r) for r in f.rows],
                }
                for f in self.functions
            ],
        }


def _tensor_bytes(t: Tensor, on_ne: bool) -> int:
    return (t.aligned_nbytes if on_ne else t.nbytes) or 0


def segments_of(ops: list[Op], devices: list[str]) -> list[Segment]:
    """Runs of consecutive dispatchable ops on one device (constants and unknowns skipped)."""
    out: list[Segment] = []
    for op, device in zip(ops, devices, strict=True):
        if device in ("none", "unknown"):
            continue
        if out and out[-1].device == device:
            seg = out[-1]
            seg.last, seg.ops, seg.flops = op.index, seg.ops + 1, seg.flops + (op.flops or 0)
        else:
            out.append(Segment(device, op.index, op.index, 1, op.flops or 0))
    return out


def crossing_bytes(function: Function, devices: list[str]) -> tuple[int, int, int]:
    """(bytes crossing devices inside, function-input bytes read on the NE, output bytes).

    A tensor is counted once per device that reads it from another device.
    """
    producer: dict[str, int] = {}
    for op in function.ops:
        for t in op.outputs:
            producer[t.name] = op.index
    inputs = {t.name for t in function.inputs}
    crossing = into_ne = 0
    seen: set[tuple[str, str]] = set()
    for op, device in zip(function.ops, devices, strict=True):
        if device in ("none", "unknown"):
            continue
        for t in op.inputs:
            if (t.name, device) in seen:
                continue
            seen.add((t.name, device))
            if t.name in inputs:
                if device == "NE":
                    into_ne += _tensor_bytes(t, True)
                continue
            src = producer.get(t.name)
            if src is None or devices[src] in ("none", "unknown"):
                continue
            if devices[src] != device:
                crossing += _tensor_bytes(t, "NE" in (device, devices[src]))
    out_bytes = 0
    for t in function.outputs:
        src = producer.get(t.name)
        on_ne = src is not None and devices[src] == "NE"
        out_bytes += _tensor_bytes(t, on_ne)
    return crossing, into_ne, out_bytes


def summarize(function: Function, rows: list[Row]) -> Summary:
    """The summary of one function's rows (rows in op order)."""
    devices = [r.device for r in rows]
    live = [(op, r) for op, r in zip(function.ops, rows, strict=True) if r.device != "none"]
    placed = [(op, r) for op, r in live if r.device != "unknown"]
    segs = segments_of(function.ops, devices)
    crossing, into_ne, out_bytes = crossing_bytes(function, devices)
    layers: dict[int, bool] = {}
    for op, r in live:
        if op.layer is not None:
            layers[op.layer] = layers.get(op.layer, True) and r.device == "NE"
    return Summary(
        ops=len(placed),
        ops_ne=sum(r.device == "NE" for _, r in placed),
        flops=sum(op.flops or 0 for op, _ in placed),
        flops_ne=sum(op.flops or 0 for op, r in placed if r.device == "NE"),
        weight_bytes=sum(op.weight_bytes for op, _ in placed),
        weight_bytes_ne=sum(op.weight_bytes for op, r in placed if r.device == "NE"),
        transitions=max(len(segs) - 1, 0),
        ne_segments=sum(s.device == "NE" for s in segs),
        segments=segs,
        boundary_bytes=crossing,
        input_bytes=into_ne,
        output_bytes=out_bytes,
        unknown_flops_ops=sum(op.flops is None for op, _ in placed),
        layers=len(layers),
        layers_all_ne=sum(layers.values()),
        breakers=[r for _, r in live if r.device != "NE"],
        state_read_bytes=sum(_state_bytes(op, "read") for op, _ in placed),
        state_write_bytes=sum(_state_bytes(op, "write") for op, _ in placed),
        layer_ops=sum(op.layer is not None for op, _ in placed),
    )


_STATE_WRITES = ("coreml_update_state", "write_state")


def _state_bytes(op: Op, way: str) -> int:
    """Bytes of a state one op reads (``read_state``'s output) or writes (the value of
    ``coreml_update_state`` / ``write_state``), unpadded; 0 for any other op."""
    if way == "read" and op.op_type == "read_state":
        tensors = op.outputs
    elif way == "write" and op.op_type in _STATE_WRITES:
        tensors = op.inputs[-1:]  # the value written (the state itself comes first)
    else:
        return 0
    return sum(_tensor_bytes(t, False) for t in tensors)


def row_of(op: Op) -> dict[str, Any]:
    """The op-table part of a row (everything but the placement)."""
    first = op.outputs[0] if op.outputs else Tensor("", (), "")
    return {
        "function": op.function,
        "index": op.index,
        "op_type": op.op_type,
        "name": op.name,
        "shape": list(first.shape),
        "dtype": first.dtype,
        "flops": op.flops,
        "weight_bytes": op.weight_bytes,
        "layer": op.layer,
        "decoded": list(op.decoded),
    }


def package_totals(report: PlacementReport) -> dict[str, Any]:
    """Shares over every function of the package together."""
    keys = ("ops", "ops_ne", "flops", "flops_ne", "weight_bytes", "weight_bytes_ne")
    totals = {k: sum(getattr(f.summary, k) for f in report.functions) for k in keys}
    for part in ("ops", "flops", "weight_bytes"):
        whole = totals[part]
        totals[f"{part}_ne_share"] = totals[f"{part}_ne"] / whole if whole else None
    totals["transitions"] = sum(f.summary.transitions for f in report.functions)
    totals["ne_segments"] = sum(f.summary.ne_segments for f in report.functions)
    return totals
