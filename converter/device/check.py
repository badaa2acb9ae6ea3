"""``anec device-check``: which check an artifact's kind allows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.coreml_runtime import MemoryProbe, ModelLoader
from converter.device.cached import cached_check
from converter.device.encoder import encoder_check
from converter.device.evidence import DeviceEvidence, plan_section
from converter.device.window import window_check
from converter.plan.computeplan import PlanOp

DEFAULT_UNITS = ("CPU_ONLY", "CPU_AND_NE")
# package, units settings -> {units: {function: ops}} (`converter.plan.computeplan.read_plans`)
Planner = Callable[[Path, list[str]], dict[str, dict[str, list[PlanOp]]]]


@dataclass(frozen=True)
class Adapters:
    """What device-check calls on a Mac: Core ML's loader, the memory probe, the compute-plan
    reader and where this runs (stand-ins of the same shape in the tests)."""

    load: ModelLoader
    probe: MemoryProbe
    plans: Planner
    recorded: dict[str, Any]


def device_check(
    artifact: Path, units: Sequence[str], mac: Adapters, memory: bool = True
) -> DeviceEvidence:
    """The artifact's gates under each of ``units`` through ``mac.load``: a cached decoder's
    cache gates, a window decoder's, an encoder's or a decision model's output gates; then each
    package's compute plan per units setting and (``memory``) the memory census."""
    from converter.recheck import read_manifest

    manifest = read_manifest(artifact)
    probe = mac.probe if memory else None
    if manifest.kv_cache is not None:
        evidence = cached_check(artifact, units, mac.load, probe, mac.recorded)
    elif manifest.task == "text-generation":
        evidence = window_check(artifact, manifest, units, mac.load, probe, mac.recorded)
    else:  # an encoder, with or without a decision head
        evidence = encoder_check(artifact, manifest, units, mac.load, probe, mac.recorded)
    evidence.plans = {
        p["file"]: plan_section(mac.plans(artifact / p["file"], list(units)))
        for p in evidence.packages
    }
    return evidence
