"""Reading ``anec device-check`` evidence files (`converter.device` writes them): the
format name, the raw document, and a function's latency as a plan report's ``observed``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.placement.device_bench import LatencyStats, Observed, latency_stats
from converter.placement.provenance import check_recorded

FORMAT = "anec-device-check/1"


def read_raw(path: Path) -> dict[str, Any]:
    """A JSON evidence file as a dict; InputError when unreadable."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read the evidence file: {e}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: not an evidence document (a JSON object)")
    return doc


def observed_from(doc: dict[str, Any], function: str, content_sha256: str) -> Observed:
    """The latency of ``function`` per units setting of a device-check file (provenance
    checked), as the ``observed`` section of a plan report reads a bench-device result."""
    recorded = check_recorded(doc.get("recorded"), str(doc.get("artifact")))
    latency: dict[str, LatencyStats] = {}
    try:
        for unit, result in doc["units"].items():
            samples = result["functions"].get(function, {}).get("samples_ms")
            if samples:
                latency[unit] = latency_stats(samples)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(
            f"{doc.get('artifact')}: malformed device-check units section ({e!r})"
        ) from None
    power = {u: {"available": False, "reason": "device-check samples no power"} for u in latency}
    if not latency:
        raise InputError(f"{doc.get('artifact')}: the device-check file timed no {function} call")
    return Observed(str(doc["artifact"]), content_sha256, recorded, latency, power)
