"""Rotary position embedding per head, split-half, in BC1L layout.

Each head rotates its own channels: the first half of *that head* with its second half
(`rotate_half`). All heads are rotated in one go by viewing ``(B, n*d, 1, L)`` as
``(B, n, d, L)`` - the same memory, so the view is free - instead of slicing every head.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_tables(
    head_dim: int, theta: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables of shape (1, 1, head_dim, L) for the given positions.

    ``rotate_half(x) = concat(-x2, x1)``; the minus sign is folded into the first half of the
    sin table (negation is exact), so the module only swaps halves.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = inv_freq[:, None] * positions.to(torch.float64)[None, :]  # (d/2, L)
    cos = torch.cat([angles.cos(), angles.cos()], dim=0)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=0)
    return (
        cos.to(torch.float32).reshape(1, 1, head_dim, -1),
        sin.to(torch.float32).reshape(1, 1, head_dim, -1),
    )


class Rope(nn.Module):
    """Apply RoPE to ``x[b, n*d, 0, l]`` holding ``n`` heads of ``d`` channels each."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, positions: torch.Tensor) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.length = int(positions.shape[0])
        cos, sin = rope_tables(head_dim, theta, positions)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        # Python ints, not x.shape: traced shape reads become int casts coremltools rejects.
        d, length = self.head_dim, self.length
        heads = x.reshape(-1, num_heads, d, length)
        first, second = heads.split(d // 2, dim=2)
        swapped = torch.cat([second, first], dim=2)
        rotated = heads * self.cos + swapped * self.sin
        return rotated.reshape(-1, num_heads * d, 1, length)
