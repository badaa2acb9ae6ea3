"""``anec device-check``: which check an artifact's kind allows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from converter.device.cached_check import prepare_cached
from converter.device.encoder_check import prepare_encoder
from converter.device.evidence_file import (
    Adapters,
    DeviceEvidence,
    checked_packages,
    measure,
    plan_section,
)
from converter.device.window_check import prepare_window
from converter.errors import InputError
from converter.pipeline.progress import Steps

DEFAULT_UNITS = ("CPU_ONLY", "CPU_AND_NE")


def device_check(
    artifact: Path,
    units: Sequence[str],
    mac: Adapters,
    memory: bool = True,
    steps: Steps | None = None,
) -> DeviceEvidence:
    """The artifact's gates under each of ``units`` through ``mac.load``: a cached decoder's
    cache gates, a window decoder's, an encoder's or a decision model's output gates, each
    read against the same gates on the program in the MIL evaluator; then each package's
    compute plan per units setting and (``memory``) the memory census. ``steps`` shows
    progress (default: none)."""
    from converter.evidence.recheck import read_manifest

    steps = steps or Steps(quiet=True)
    manifest = read_manifest(artifact)
    if manifest.compression is not None:
        # Its gates compare against the fp16 program as well as the checkpoint (level
        # compression), which the device's outputs alone do not show.
        raise InputError(f"{artifact}: a compressed variant; device-check runs fp16 artifacts")
    packages = checked_packages(artifact)  # before the checkpoint is loaded
    with steps.step("reference (checkpoint)"):
        if manifest.kv_cache is not None:
            kind = prepare_cached(artifact)
        elif manifest.task == "text-generation":
            kind = prepare_window(artifact, manifest)
        else:  # an encoder, with or without a decision head
            kind = prepare_encoder(artifact, manifest)
    evidence = measure(artifact, packages, kind, units, mac, memory, steps)
    with steps.step("compute plans"):
        evidence.plans = {
            p["file"]: plan_section(mac.plans(artifact / p["file"], list(units))) for p in packages
        }
    return evidence
