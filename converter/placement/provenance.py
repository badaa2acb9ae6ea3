"""Where a compute-plan dump or a device measurement was recorded, checked and printed.

Evidence labelled ``compute-plan`` or ``observed`` (SPEC section 5) claims Apple software or
hardware produced it, so a file is accepted only when it says where: the macOS writer
(``anec plan-inspect --dump``, ``anec bench-device``) records ``origin: macos`` with the
macOS version, the chip and the coremltools version (``dump.recording_metadata``). Every
report then prints that provenance beside the figures.

anec's tests cannot record on a Mac; their fixtures say ``origin: stand-in``. A stand-in is
refused unless ``ANEC_ACCEPT_STAND_IN_EVIDENCE=1`` is set (TEST-ONLY: anec's test suite sets
it; never set it in CI or for real reports), and every report then prints STAND-IN where
the provenance would be, so a stand-in figure can never read as Apple's.
"""

from __future__ import annotations

import os
from typing import Any

from converter.errors import InputError

ORIGIN_MACOS = "macos"
ORIGIN_STAND_IN = "stand-in"
# Test-only switch: accept fixture evidence that was not recorded on a Mac.
STAND_IN_ENV = "ANEC_ACCEPT_STAND_IN_EVIDENCE"
REQUIRED = ("macos", "chip", "coremltools")
STAND_IN_TEXT = "STAND-IN: a test fixture, not recorded on a Mac; no Apple software produced it"


def stand_ins_accepted() -> bool:
    """True when the test-only switch is set."""
    return os.environ.get(STAND_IN_ENV) == "1"


def check_recorded(recorded: Any, where: str) -> dict[str, Any]:
    """The ``recorded`` block of a dump entry or measurement, checked; InputError otherwise.

    ``where`` names the file (and entry) in the message.
    """
    writers = "anec plan-inspect --dump and anec bench-device write it on a Mac"
    if not isinstance(recorded, dict):
        raise InputError(
            f"{where}: no 'recorded' block saying where the evidence was recorded (origin, "
            f"{', '.join(REQUIRED)}); {writers}"
        )
    origin = recorded.get("origin")
    if origin == ORIGIN_STAND_IN:
        if not stand_ins_accepted():
            raise InputError(
                f"{where}: recorded.origin is 'stand-in' (a test fixture, not a recording on a "
                f"Mac); stand-ins are accepted only by anec's tests ({STAND_IN_ENV}=1)"
            )
        return dict(recorded)
    if origin != ORIGIN_MACOS:
        raise InputError(
            f"{where}: recorded.origin is {origin!r}, expected {ORIGIN_MACOS!r}; {writers}"
        )
    missing = [k for k in REQUIRED if not isinstance(recorded.get(k), str) or not recorded[k]]
    if missing:
        raise InputError(
            f"{where}: recorded.{missing[0]} is missing or empty: evidence must carry the "
            f"macOS version, chip and coremltools version it was recorded with "
            f"(missing: {', '.join(missing)}); {writers}"
        )
    return dict(recorded)


def is_stand_in(recorded: dict[str, Any]) -> bool:
    """True for a fixture's record (only ever accepted behind the test-only switch)."""
    return recorded.get("origin") == ORIGIN_STAND_IN


def provenance_text(recorded: dict[str, Any]) -> str:
    """One line for reports: STAND-IN for a fixture, else where and with what it was recorded."""
    if is_stand_in(recorded):
        return STAND_IN_TEXT
    chip = recorded.get("chip")
    machine = recorded.get("machine")
    text = f"recorded on macOS {recorded.get('macos')}, {chip}"
    text += f" ({machine})" if machine else ""
    text += f", coremltools {recorded.get('coremltools')}"
    return text + (f", {recorded['date']}" if recorded.get("date") else "")


def provenance_json(recorded: dict[str, Any]) -> dict[str, Any]:
    """The provenance fields a JSON report carries beside ``recorded``."""
    return {"provenance": provenance_text(recorded), "stand_in": is_stand_in(recorded)}
