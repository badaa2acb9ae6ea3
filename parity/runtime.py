"""The Core ML runtime level: predictions of the emitted package with CPU_AND_NE on macOS.

A thin adapter: on any other platform it reports "not run on this platform" and produces no
figures, never a substitute. Requesting CPU_AND_NE does not show where ops ran (SPEC section
5): these outputs say what Core ML computed, not which engine computed it.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

NOT_RUN = "not run on this platform"
IMPLEMENTATION = "coreml-cpu-and-ne"


def availability() -> tuple[bool, str]:
    """Whether Core ML can run here, and why not when it cannot."""
    system = f"{platform.system()} {platform.machine()}"
    if platform.system() != "Darwin":
        return False, f"{NOT_RUN} ({system}): Core ML predictions need macOS"
    try:
        import coremltools.libcoremlpython  # noqa: F401
    except ImportError as e:
        return False, f"{NOT_RUN} ({system}): coremltools cannot load Core ML: {e}"
    return True, f"Core ML on {system}, compute units CPU_AND_NE"


def predictor(package: Path) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A function running the package with Core ML (CPU_AND_NE); macOS only."""
    import coremltools as ct

    model: Any = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.CPU_AND_NE)

    def predict(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in model.predict(inputs).items()}

    return predict
