"""Compute-plan dumps: JSON files keyed by the package's content hash.

``anec plan-inspect --dump FILE`` writes one on a Mac; ``--from-plan FILE`` reads it on any
machine, so CI on Linux can gate on a recorded plan. The content hash
(``converter.pipeline.hashing.mlpackage_content_hash``) ties a plan to the exact package it was read
from: a dump for another package is refused, never matched by name.

Format (``anec-compute-plan/1``)::

    {"format": "anec-compute-plan/1", "evidence": "compute-plan",
     "packages": {"<content sha256>": {
         "package": "<file name>", "recorded": {"origin": "macos", "macos": ...,
         "machine": ..., "chip": ..., "coremltools": ..., "date": ...},
         "plans": {"CPU_AND_NE": {"main": [<op>, ...]}, ...}}}}

where each op is ``{"index", "operator", "outputs", "preferred", "supported",
"cost_weight"}`` and ``preferred`` is "NE", "CPU", "GPU" or null (usage not determined).
``recorded`` must say where the plan was recorded (``converter.placement.provenance``): a dump
without the macOS version, chip and coremltools version, or a test stand-in outside anec's
tests, is refused.
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.evidence.labels import Evidence
from converter.placement.computeplan import PlanOp, plan_op_from_json, plan_op_to_json
from converter.placement.provenance import ORIGIN_MACOS, check_recorded
from converter.placement.rules import COMPUTE_UNITS

DUMP_FORMAT = "anec-compute-plan/1"


@dataclass
class RecordedPlan:
    """The plans of one package read from a dump."""

    content_sha256: str
    package: str
    recorded: dict[str, Any]
    plans: dict[str, dict[str, list[PlanOp]]]  # compute units -> function -> ops


def recording_metadata() -> dict[str, Any]:  # pragma: no cover - values differ per machine
    """Where and when a plan or measurement is recorded (on macOS): origin, macOS version,
    machine, chip, coremltools version and date."""
    from importlib.metadata import version

    chip = None
    if platform.system() == "Darwin":
        try:
            chip = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except OSError:
            chip = None
    return {
        "origin": ORIGIN_MACOS,
        "macos": platform.mac_ver()[0] or None,
        "machine": platform.machine(),
        "chip": chip,
        "coremltools": version("coremltools"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def dump_to_json(recorded: RecordedPlan) -> dict[str, Any]:
    """The dump document for one package."""
    return {
        "format": DUMP_FORMAT,
        "evidence": Evidence.COMPUTE_PLAN.value,
        "packages": {
            recorded.content_sha256: {
                "package": recorded.package,
                "recorded": recorded.recorded,
                "plans": {
                    units: {fn: [plan_op_to_json(op) for op in ops] for fn, ops in fns.items()}
                    for units, fns in recorded.plans.items()
                },
            }
        },
    }


def write_dump(path: Path, recorded: RecordedPlan) -> Path:
    """Write (or add to) a dump file; an entry for the same content hash is replaced."""
    from converter.pipeline.publish import write_json_atomic

    doc = dump_to_json(recorded)
    if path.is_file():
        existing = _load(path)
        existing["packages"].update(doc["packages"])
        doc = existing
    return write_json_atomic(path, doc)


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read the compute-plan dump: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != DUMP_FORMAT:
        raise InputError(f"{path}: not an {DUMP_FORMAT} dump (format {doc.get('format')!r})")
    if doc.get("evidence") != Evidence.COMPUTE_PLAN.value:
        raise InputError(f"{path}: evidence is {doc.get('evidence')!r}, expected 'compute-plan'")
    if not isinstance(doc.get("packages"), dict):
        raise InputError(f"{path}: 'packages' must map content hashes to plans")
    return doc


def read_dump(path: Path, content_sha256: str) -> RecordedPlan:
    """The plans recorded for the package with this content hash (InputError if absent)."""
    doc = _load(path)
    entry = doc["packages"].get(content_sha256)
    if entry is None:
        known = ", ".join(h[:12] for h in doc["packages"]) or "none"
        raise InputError(
            f"{path}: no plan for this package (content hash {content_sha256[:12]}); the dump "
            f"holds {known}. Record it again with --dump on a Mac."
        )
    plans: dict[str, dict[str, list[PlanOp]]] = {}
    raw = entry.get("plans")
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{path}: entry {content_sha256[:12]} has no plans")
    for units, fns in raw.items():
        if units not in COMPUTE_UNITS:
            raise InputError(f"{path}: unknown compute units {units!r}")
        if not isinstance(fns, dict):
            raise InputError(f"{path}: plans[{units!r}] must map function names to op lists")
        plans[units] = {fn: [plan_op_from_json(op) for op in ops] for fn, ops in fns.items()}
    return RecordedPlan(
        content_sha256=content_sha256,
        package=str(entry.get("package", "")),
        recorded=check_recorded(entry.get("recorded"), f"{path}: entry {content_sha256[:12]}"),
        plans=plans,
    )
