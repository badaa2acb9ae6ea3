"""``anec device-check``: which check an artifact's kind allows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from converter.coreml_runtime import MemoryProbe, ModelLoader
from converter.device.cached import cached_check
from converter.device.evidence import DeviceEvidence
from converter.device.window import window_check
from converter.errors import InputError

DEFAULT_UNITS = ("CPU_ONLY", "CPU_AND_NE")


def device_check(
    artifact: Path,
    units: Sequence[str],
    load: ModelLoader,
    probe: MemoryProbe | None,
    recorded: dict[str, Any],
) -> DeviceEvidence:
    """The artifact's gates under each of ``units`` through ``load``: a cached decoder's
    cache gates, a window decoder's output gates; ``probe`` (None: no memory census) reads
    memory; ``recorded`` says where this ran. InputError for other kinds."""
    from converter.recheck import read_manifest

    manifest = read_manifest(artifact)
    if manifest.kv_cache is not None:
        return cached_check(artifact, units, load, probe, recorded)
    if manifest.task == "text-generation":
        return window_check(artifact, manifest, units, load, probe, recorded)
    raise InputError(
        f"{artifact}: task {manifest.task}; device-check runs decoders (window or cached). "
        "For an encoder, anec parity runs the Core ML level (CPU_AND_NE) on macOS"
    )
