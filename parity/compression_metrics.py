"""Peak signal-to-noise ratio of a compressed variant's outputs, the figure Apple's Core AI
export gates 4-bit weights on (PSNR >= 35 dB).

``psnr_db = 20 log10(max|z_ref| / RMS(z - z_ref))`` over one position's full logit vector (a
decoder) or one sentence's task output (an encoder): the error's RMS against the reference's
peak. Identical outputs give +inf; a non-finite candidate gives -inf.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from parity.result import clean_json


def psnr_db(candidate: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """PSNR in dB of each row (the last axis is one output vector) of ``candidate``."""
    cand, ref = candidate.double(), reference.double()
    if cand.dim() == 1:
        cand, ref = cand[None], ref[None]
    cand, ref = cand.reshape(-1, cand.shape[-1]), ref.reshape(-1, ref.shape[-1])
    peak = ref.abs().amax(-1)
    rms = (cand - ref).pow(2).mean(-1).sqrt()
    out = []
    finite = torch.isfinite(cand).all(-1).tolist()
    for p, r, ok in zip(peak.tolist(), rms.tolist(), finite, strict=True):
        if not ok:
            out.append(-math.inf)
        elif r == 0.0:
            out.append(math.inf)
        else:
            out.append(20.0 * math.log10(p / r) if p > 0 else -math.inf)
    return out


@dataclass(frozen=True)
class PsnrSummary:
    """PSNR over a set of positions or sentences: the worst, the median and the mean (dB)."""

    count: int
    min_db: float
    median_db: float
    mean_db: float

    def to_json(self) -> dict[str, object]:
        """JSON-ready data (infinities as strings)."""
        return {k: clean_json(v) for k, v in vars(self).items()} | {
            "definition": "20 log10(max|z_ref| / RMS(z - z_ref)) per output vector, dB"
        }


def summarize_psnr(values: list[float]) -> PsnrSummary:
    """The summary of ``values`` (NaN figures when there are none)."""
    if not values:
        return PsnrSummary(0, math.nan, math.nan, math.nan)
    ordered = sorted(values)
    # The mean skips identical outputs (+inf); a non-finite output (-inf) makes it -inf.
    finite = [v for v in ordered if math.isfinite(v)]
    if ordered[0] == -math.inf:
        mean = -math.inf
    else:
        mean = sum(finite) / len(finite) if finite else math.inf
    return PsnrSummary(len(ordered), ordered[0], statistics.median(ordered), mean)
