"""Logit metrics of SPEC section 4, per position, and their summaries over slices.

A candidate's logits are compared with the reference's at each real position: argmax kept,
|dp| (softmax at T=1), KL(p_ref || p_cand), top-k overlap, the largest logit error delta and
the reference margin top1 - top2. ``margin > 2 delta`` certifies the argmax: no logit moved by
delta can overtake one that leads by more than 2 delta.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TOP_K = 5
# A narrow margin, fixed before measuring: top1 - top2 below one logit (at T=1 the top token
# is less than e times as likely as the runner-up).
NARROW_MARGIN = 1.0


@dataclass(frozen=True)
class PositionRow:
    """One real position of one fixture, compared with the reference."""

    fixture: str
    slice: str
    tokens: int  # the fixture's real length
    position: int  # 0..tokens-1, as the reference numbers it
    margin: float  # reference top1 - top2
    logit_error: float  # delta: max over the vocabulary of |logit' - logit|
    argmax_kept: bool
    abs_dprob: float  # max over the vocabulary of |p' - p|
    kl: float  # KL(p_ref || p_cand), nats
    topk_overlap: float  # |topk(ref) & topk(cand)| / k

    @property
    def certified(self) -> bool:
        """True when the margin proves the argmax is kept (margin > 2 delta)."""
        return self.margin > 2 * self.logit_error


def compare_positions(
    fixture: str,
    slice_name: str,
    tokens: int,
    positions: list[int],
    candidate: torch.Tensor,
    reference: torch.Tensor,
) -> list[PositionRow]:
    """Rows for ``positions`` given candidate and reference logits (len(positions), V)."""
    cand, ref = candidate.double(), reference.double()
    finite = torch.isfinite(cand).all(dim=-1)
    top2 = ref.topk(2, dim=-1).values
    p_ref = ref.softmax(-1)
    log_ref = ref.log_softmax(-1)
    k = min(TOP_K, ref.shape[-1])
    rows = []
    for i, pos in enumerate(positions):
        ok = bool(finite[i])  # a non-finite candidate: every figure at its worst
        log_cand = cand[i].log_softmax(-1)
        overlap = set(ref[i].topk(k).indices.tolist()) & set(cand[i].topk(k).indices.tolist())
        rows.append(
            PositionRow(
                fixture=fixture,
                slice=slice_name,
                tokens=tokens,
                position=pos,
                margin=float(top2[i, 0] - top2[i, 1]),
                logit_error=float((cand[i] - ref[i]).abs().max()) if ok else math.inf,
                argmax_kept=ok and bool(cand[i].argmax() == ref[i].argmax()),
                abs_dprob=float((log_cand.exp() - p_ref[i]).abs().max()) if ok else math.inf,
                kl=float((p_ref[i] * (log_ref[i] - log_cand)).sum().clamp_min(0.0))
                if ok
                else math.inf,
                topk_overlap=len(overlap) / k if ok else 0.0,
            )
        )
    return rows


@dataclass
class Summary:
    """Aggregates over a set of positions (a slice, or all of them)."""

    positions: int = 0
    argmax_agreement: float = 0.0
    max_abs_dprob: float = 0.0
    max_kl: float = 0.0
    mean_kl: float = 0.0
    mean_topk_overlap: float = 0.0
    max_logit_error: float = 0.0
    certified_share: float = 0.0
    uncertified: list[str] = field(default_factory=list)  # "fixture@position"


def summarize(rows: Iterable[PositionRow]) -> Summary:
    """Summary of ``rows``; an empty set gives zero positions and no figures."""
    rows = list(rows)
    if not rows:
        return Summary()
    n = len(rows)
    return Summary(
        positions=n,
        argmax_agreement=sum(r.argmax_kept for r in rows) / n,
        max_abs_dprob=max(r.abs_dprob for r in rows),
        max_kl=max(r.kl for r in rows),
        mean_kl=sum(r.kl for r in rows) / n,
        mean_topk_overlap=sum(r.topk_overlap for r in rows) / n,
        max_logit_error=max(r.logit_error for r in rows),
        certified_share=sum(r.certified for r in rows) / n,
        uncertified=[f"{r.fixture}@{r.position}" for r in rows if not r.certified],
    )


def slices(rows: list[PositionRow], length: int) -> dict[str, Summary]:
    """The separate slices of SPEC section 4 over ``rows`` (window length ``length``).

    ``narrow-margin``: reference margin below NARROW_MARGIN; ``padded`` and ``full-window``:
    the fixture's slice; ``boundary-length``: fixtures of 1, 2, L-1 or L real tokens.
    """
    boundary = {1, 2, length - 1, length}
    return {
        "all": summarize(rows),
        "narrow-margin": summarize(r for r in rows if r.margin < NARROW_MARGIN),
        "padded": summarize(r for r in rows if r.slice == "padded"),
        "full-window": summarize(r for r in rows if r.slice == "full-window"),
        "boundary-length": summarize(r for r in rows if r.tokens in boundary),
    }


def rel_error_np(
    candidate: Any, reference: Any, norms: dict[Any, float] | None = None, key: Any = None
) -> float:
    """``||c - r|| / ||r||`` in fp64 (inf if c is not finite); ``norms`` keeps ``||r||`` by
    ``key`` for a reference compared in several profiles. `parity.result.rel_error` in numpy:
    torch's small-tensor overhead made it a tenth of this level's time on SmolLM2."""
    c = np.asarray(candidate, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if not np.isfinite(c).all():
        return math.inf
    norms = {} if norms is None else norms
    if key not in norms:
        norms[key] = _norm(r)
    return _norm(c - r) / max(norms[key], 1e-30)


def _norm(x: np.ndarray) -> float:
    """``||x||`` summed on this thread (einsum's loop): BLAS's dot (``np.linalg.norm``) split
    the sum across cores, so the reports' last digits depended on the core count
    (tests/test_reproducible.py), and it stalled on a busy second core."""
    flat = x.ravel()
    return math.sqrt(float(np.einsum("i,i->", flat, flat)))
