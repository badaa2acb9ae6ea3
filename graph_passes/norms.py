"""Norms in BC1L layout, computed exactly as the checkpoint defines them."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the channel axis of ``x[b, c, 0, l]``, with a power-of-two prescale.

    ``y = x / sqrt(mean_c(x^2) + eps) * (offset + w)``, computed as
    ``x' / sqrt(sum_c(x'^2) + C * eps / a^2) * (sqrt(C) * (offset + w))`` with ``x' = x / a``.

    Why exact (in real arithmetic): ``mean = sum / C``, so
    ``1/sqrt(mean + eps) = sqrt(C) / sqrt(sum + C*eps)``; and for any ``a > 0`` the factor
    ``a`` cancels between numerator and denominator. For ``a = 2^k`` the division only changes
    the exponent, so it adds no rounding. Why this form: the prescale keeps ``x'^2`` inside
    fp16's range where the residual stream is large (SmolLM2 reaches |h| ~ 27k, whose square
    overflows fp16), and the *sum* rather than the mean keeps the stored per-position value
    C times further from fp16's subnormals, where a mean of ordinary positions would land once
    ``a`` is large (measured: the mean form flipped an argmax on SmolLM2, the sum form not).
    """

    gamma: torch.Tensor
    inv_scale: torch.Tensor
    scaled_eps: torch.Tensor

    def __init__(self, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        channels = weight.shape[0]
        self.channels = channels
        # sqrt(C) * (offset + w) stored as one constant: one op fewer, same real value.
        gamma = (weight + weight_offset) * channels**0.5
        self.register_buffer("gamma", gamma.reshape(1, -1, 1, 1).clone())
        # Kept as buffers so a half() module rounds them exactly as the fp16 program stores them.
        self.register_buffer("inv_scale", torch.tensor(1.0))
        self.register_buffer("scaled_eps", torch.tensor(float(eps) * channels))
        self.prescale = 1.0

    def set_prescale(self, scale: float) -> None:
        """Use ``x / scale`` inside the norm; ``scale`` must be a power of two."""
        mantissa, _ = torch.frexp(torch.tensor(scale, dtype=torch.float64))
        if scale <= 0 or float(mantissa) != 0.5:
            raise ValueError(f"prescale must be a positive power of two, got {scale}")
        self.prescale = scale
        self.inv_scale.fill_(1.0 / scale)
        self.scaled_eps.fill_(self.channels * self.eps / (scale * scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prescale != 1.0:
            x = x * self.inv_scale
        sum_square = (x * x).sum(dim=1, keepdim=True)
        return x * torch.rsqrt(sum_square + self.scaled_eps) * self.gamma
