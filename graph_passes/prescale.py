"""Choose power-of-two prescales for norms from measured input ranges (SPEC section 2).

A norm's input is divided by ``a = 2^k`` inside the norm so that no fp16 intermediate
overflows; `graph_passes.norms.RMSNorm` explains why the result is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from graph_passes.norms import RMSNorm

# The norm stores sum_c (x/a)^2 per position, so the bound is on the per-position L2 norm:
# ||x/a|| <= 64 keeps that sum <= 4096, 16x below fp16's 65504, so inputs whose L2 norm is up
# to 4x the largest one measured on the fixtures still do not overflow (nor does any single
# square, which the sum bounds).
TARGET_L2 = 64.0


@dataclass(frozen=True)
class NormScale:
    """The measured range at one norm's input and the prescale chosen for it."""

    name: str
    max_l2: float  # largest per-position L2 norm over the channels
    prescale: float
    eps: float
    # C * eps / a^2 (the constant added to the sum of squares) as the fp16 program stores it;
    # rounds to 0 once a^2 is large.
    scaled_eps: float
    fp16_scaled_eps: float


def choose_prescale(max_l2: float, target_l2: float = TARGET_L2) -> float:
    """The smallest power of two ``a >= 1`` with ``max_l2 / a <= target_l2``."""
    if max_l2 <= target_l2:
        return 1.0
    return 2.0 ** math.ceil(math.log2(max_l2 / target_l2))


def measure_norm_inputs(
    norms: Sequence[tuple[str, nn.Module]], run: Callable[[], object], centred: bool = False
) -> dict[str, float]:
    """Largest per-position L2 norm (over channels, axis 1) reaching each norm during ``run()``.

    With ``centred``, of the input minus its per-position channel mean: what a LayerNorm
    squares and sums; an RMSNorm squares the input itself.
    """
    maxima = {name: 0.0 for name, _ in norms}
    handles = []
    for name, norm in norms:

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            x = args[0].detach().double()
            if centred:
                x = x - x.mean(dim=1, keepdim=True)
            maxima[name] = max(maxima[name], float(x.norm(dim=1).max()))

        handles.append(norm.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def norm_scale(
    name: str, max_l2: float, prescale: float, channels: int, eps: float, eps_floor: float = 0.0
) -> NormScale:
    """The record of one norm's prescale; the fp16 constant is ``C*eps/a^2`` raised to
    ``eps_floor`` (0: no floor) and rounded to fp16, as the program stores it."""
    scaled_eps = channels * eps / (prescale * prescale)
    return NormScale(
        name=name,
        max_l2=max_l2,
        prescale=prescale,
        eps=eps,
        scaled_eps=scaled_eps,
        fp16_scaled_eps=float(torch.tensor(max(scaled_eps, eps_floor)).half()),
    )


def apply_prescales(
    norms: Iterable[tuple[str, RMSNorm]], maxima: dict[str, float]
) -> list[NormScale]:
    """Set each norm's prescale from its measured maximum; returns what was chosen."""
    chosen = []
    for name, norm in norms:
        scale = choose_prescale(maxima[name])
        norm.set_prescale(scale)
        chosen.append(norm_scale(name, maxima[name], scale, norm.channels, norm.eps))
    return chosen
