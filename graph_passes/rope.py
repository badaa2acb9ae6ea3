"""Rotary position embedding per head, split-half, in BC1L layout.

Each head rotates its own channels: the first half of *that head* with its second half
(`rotate_half`). All heads are rotated in one go by viewing ``(B, n*d, 1, L)`` as
``(B, n, d, L)`` - the same memory, so the view is free - instead of slicing every head.
With partial rotary (``rotary_dim < d``) only each head's first ``rotary_dim`` channels are
rotated, split-half among themselves, and the rest pass through, as transformers does it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from graph_passes.spec import RopeScaling


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """``1 / theta^(2j / rotary_dim)`` for j < rotary_dim / 2, in fp64, rescaled by
    ``scaling`` where given (`llama3_rescale`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return inv_freq if scaling is None else llama3_rescale(inv_freq, scaling)


def llama3_rescale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.x frequency rescaling, as transformers' ``_compute_llama3_parameters``:
    wavelengths ``2 pi / f`` above ``original / low_freq_factor`` divided by ``factor``, below
    ``original / high_freq_factor`` kept, in between interpolated with
    ``smooth = (original / wavelength - low) / (high - low)``."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, theta: float, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables of shape (1, 1, head_dim, L) for the given positions.

    ``head_dim`` is the number of rotated channels; ``inv_freq`` (head_dim / 2,) overrides the
    default frequencies (RoPE scaling). ``rotate_half(x) = concat(-x2, x1)``; the minus sign
    is folded into the first half of the sin table (negation is exact), so the module only
    swaps halves.
    """
    if inv_freq is None:
        inv_freq = inverse_frequencies(head_dim, theta)
    angles = inv_freq.double()[:, None] * positions.to(torch.float64)[None, :]  # (d/2, L)
    cos = torch.cat([angles.cos(), angles.cos()], dim=0)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=0)
    return (
        cos.to(torch.float32).reshape(1, 1, head_dim, -1),
        sin.to(torch.float32).reshape(1, 1, head_dim, -1),
    )


@dataclass(frozen=True)
class Positions:
    """The positions one call's tokens sit at, when they are not a module's own window: their
    RoPE tables (1, 1, rotary_dim, length) as `rope_tables` makes them, host inputs of a
    cached decoder, and their number."""

    cos: torch.Tensor
    sin: torch.Tensor
    length: int


class Rope(nn.Module):
    """Apply RoPE to ``x[b, n*d, 0, l]`` holding ``n`` heads of ``d`` channels each: at the
    module's own positions (its tables, built once), or at a call's `Positions`."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        theta: float,
        positions: torch.Tensor,
        rotary_dim: int | None = None,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim}: must be even and <= {head_dim}")
        self.length = int(positions.shape[0])
        inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
        cos, sin = rope_tables(self.rotary_dim, theta, positions, inv_freq)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor, num_heads: int, at: Positions | None = None) -> torch.Tensor:
        if at is None:
            return rotate(
                x, num_heads, self.head_dim, self.rotary_dim, self.length, self.cos, self.sin
            )
        return rotate(x, num_heads, self.head_dim, self.rotary_dim, at.length, at.cos, at.sin)


def rotate(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    rotary_dim: int,
    length: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """RoPE on ``x[b, n*d, 0, l]`` with tables ``cos`` / ``sin`` (1, 1, rotary_dim, length) as
    `rope_tables` makes them: module constants (`Rope`) or host inputs (the cached decoder)."""
    # Python ints, not x.shape: traced shape reads become int casts coremltools rejects.
    d, r = head_dim, rotary_dim
    heads = x.reshape(-1, num_heads, d, length)
    passed = None
    if r < d:
        heads, passed = heads.split([r, d - r], dim=2)
    first, second = heads.split(r // 2, dim=2)
    swapped = torch.cat([second, first], dim=2)
    rotated = heads * cos + swapped * sin
    if passed is not None:
        rotated = torch.cat([rotated, passed], dim=2)
    return rotated.reshape(-1, num_heads * d, 1, length)
