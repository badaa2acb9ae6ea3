"""How far each compressed weight decodes from its fp16 value.

A per-tensor palette has one table for the whole tensor: a handful of outlier weights (the
ones that feed an attention sink, say) can be pulled into an ordinary cluster and lose most of
their magnitude, and the model with them. ``peak_kept`` shows that directly: the decoded value
of the weight with the largest magnitude, as a share of that magnitude.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WeightError:
    """One compressed weight against its fp16 value."""

    weight: str
    rel_error: float  # ||decoded - fp16|| / ||fp16||
    peak: float  # the largest |fp16 value|
    peak_kept: float  # decoded / fp16 at that element (1.0: kept exactly)


def weight_errors(decoded: dict[str, np.ndarray], fp16: dict[str, np.ndarray]) -> list[WeightError]:
    """Errors of every decoded weight, worst relative error first."""
    rows = []
    for name, value in decoded.items():
        w = np.asarray(fp16[name], np.float32).reshape(-1)
        d = np.asarray(value, np.float32).reshape(-1)
        if w.shape != d.shape:
            raise ValueError(f"{name}: decodes to {d.size} values, the fp16 weight has {w.size}")
        norm = float(np.linalg.norm(w))
        i = int(np.argmax(np.abs(w)))
        rel = float(np.linalg.norm(d - w)) / norm if norm else 0.0
        kept = float(d[i] / w[i]) if w[i] else 1.0
        rows.append(WeightError(name, rel, float(abs(w[i])), kept))
    return sorted(rows, key=lambda r: r.rel_error, reverse=True)


def errors_json(errors: list[WeightError]) -> list[dict[str, Any]]:
    """JSON-ready rows, in the same order."""
    return [asdict(e) for e in errors]


def errors_text(errors: list[WeightError], worst: int = 5) -> str:
    """The worst weights by relative error and by lost peak, as a short table."""
    if not errors:
        return "Weight errors: no weight compressed"
    by_peak = sorted(errors, key=lambda e: abs(1.0 - e.peak_kept), reverse=True)[:worst]
    shown = errors[:worst] + [e for e in by_peak if e not in errors[:worst]]
    lines = [
        f"Weight errors ({len(errors)} compressed weights; the worst by relative error, "
        "then by how much of its largest value a weight lost):",
        f"  {'weight':<44} {'rel error':>9} {'peak':>8} {'peak kept':>9}",
    ]
    for e in shown:
        lines.append(f"  {e.weight:<44} {e.rel_error:9.4f} {e.peak:8.3f} {e.peak_kept:9.3f}")
    return "\n".join(lines)
