"""What a compressed program holds, weight by weight, and the weights it decodes to.

The record of a weight says how it was compressed (method, bits, granularity, the clustering
algorithm), what the program stores for it (the constexpr op, stored bytes, bits per weight)
and hashes of the stored payload and the decoded values, so a reader can rebuild the same
model with the same tools and check it bit for bit. The decoded values come from coremltools'
own decompression (``materialized_val_inference``), independently of anec's MIL evaluator.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from converter.compression import methods
from converter.compression.schemes import Scheme
from converter.compression.sites import WeightSite

_COMPRESSED_SUFFIXES = ("_palettized", "_quantized")


@dataclass(frozen=True)
class WeightRecord:
    """One weight of a variant: how it was compressed and what the program stores."""

    weight: str
    const: str
    shape: list[int]
    method: str  # "fp16" (kept), or the registered method that stores it
    scheme: str
    bits: int
    granularity: str | None
    group_size: int | None
    symmetric: bool | None
    algorithm: str
    op: str  # the op that holds it: "const" or "constexpr_*"
    fp16_bytes: int
    stored_bytes: int
    bits_per_weight: float
    kept_reason: str | None
    payload_sha256: str
    decoded_sha256: str

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data."""
        return asdict(self)


def _bit_width(var: Any) -> int:
    from coremltools.converters.mil.mil import types

    name = types.builtin_to_string(var.dtype)
    digits = re.findall(r"\d+", name)
    return int(digits[-1]) if digits else 8


def _stored(op: Any) -> tuple[int, str]:
    """Bytes the program stores for ``op`` (a const's value, or a constexpr's constant
    inputs), and their sha256."""
    digest = hashlib.sha256()
    bits = 0
    # A const holds its value in its output; a constexpr op holds constant inputs.
    held = {"val": op.outputs[0]} if op.op_type == "const" else op.inputs
    for name in sorted(held):
        var = held[name]
        value = var.val
        if value is None:
            continue
        array = np.asarray(value)
        bits += array.size * _bit_width(var)
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return (bits + 7) // 8, digest.hexdigest()


def _decode(op: Any) -> np.ndarray:
    infer = getattr(op, "materialized_val_inference", None) or op.value_inference
    return np.asarray(infer()).astype(np.float16)


def decoded_weight(function: Any, const: str) -> np.ndarray:
    """coremltools' decoding (fp16) of the compressed constant made from ``const``."""
    for op in function.operations:
        if op.op_type.startswith("constexpr_") and op.outputs[0].name in {
            const + s for s in _COMPRESSED_SUFFIXES
        }:
            return _decode(op)
    raise KeyError(f"no compressed constant {const}_palettized / _quantized in the program")


def weight_records(
    function: Any,
    sites: list[WeightSite],
    plan: dict[str, Scheme],
    kept: dict[str, str],
) -> tuple[list[WeightRecord], dict[str, np.ndarray]]:
    """Records for every weight site, and the decoded values of the compressed ones."""
    by_output: dict[str, Any] = {}
    consts: dict[str, Any] = {}
    for op in function.operations:
        if op.op_type.startswith("constexpr_"):
            by_output[op.outputs[0].name] = op
        elif op.op_type == "const":
            consts[op.outputs[0].name] = op
    records: list[WeightRecord] = []
    decoded: dict[str, np.ndarray] = {}
    for site in sites:
        scheme = plan.get(site.name)
        if scheme is None:
            op = consts.get(site.const)
            if op is None:
                raise KeyError(f"{site.name}: constant {site.const!r} not in the program")
            records.append(_fp16_record(site, op, kept.get(site.name, "not in the plan")))
            continue
        names = (site.const + s for s in _COMPRESSED_SUFFIXES)
        op = next((by_output[n] for n in names if n in by_output), None)
        if op is None:
            raise KeyError(f"{site.name}: no compressed op for {site.const!r} in the program")
        value = _decode(op)
        if tuple(value.shape) != site.shape:
            raise ValueError(f"{site.name}: decodes to {value.shape}, expected {site.shape}")
        decoded[site.name] = value
        records.append(_compressed_record(site, op, scheme, value))
    return records, decoded


def _fp16_record(site: WeightSite, op: Any, why: str) -> WeightRecord:
    """A weight the plan keeps in fp16, stored as a plain constant."""
    stored, payload = _stored(op)
    value = np.asarray(op.outputs[0].val).astype(np.float16)
    return WeightRecord(
        site.name, site.const, list(site.shape), "fp16", "fp16", 16, None, None, None, "none",
        "const", site.elements * 2, stored, 16.0, why, payload,
        hashlib.sha256(value.tobytes()).hexdigest(),
    )  # fmt: skip


def _compressed_record(
    site: WeightSite, op: Any, scheme: Scheme, value: np.ndarray
) -> WeightRecord:
    """A compressed weight: its scheme, the op that stores it and the values it decodes to."""
    stored, payload = _stored(op)
    method = methods.get(scheme.method)
    return WeightRecord(
        site.name, site.const, list(site.shape), scheme.method, scheme.describe(), scheme.bits,
        scheme.granularity, scheme.group_size,
        scheme.symmetric if method.records_symmetry else None,
        method.algorithm(scheme, site), op.op_type, site.elements * 2, stored,
        stored * 8 / site.elements, None, payload, hashlib.sha256(value.tobytes()).hexdigest(),
    )  # fmt: skip


def with_extra_bytes(records: list[WeightRecord], extra: dict[str, int]) -> list[WeightRecord]:
    """``records`` with each named weight's extra stored bytes (ops a method adds for it, e.g.
    exact outlier columns) counted in its stored bytes and bits per weight."""
    import dataclasses

    unknown = sorted(set(extra) - {r.weight for r in records})
    if unknown:
        raise KeyError(f"extra bytes for weights without a record: {unknown[:5]}")
    out = []
    for r in records:
        if r.weight in extra:
            stored = r.stored_bytes + extra[r.weight]
            r = dataclasses.replace(
                r, stored_bytes=stored, bits_per_weight=stored * 8 / (r.fp16_bytes // 2)
            )
        out.append(r)
    return out
