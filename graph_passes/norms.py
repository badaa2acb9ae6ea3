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

    def __init__(
        self, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, gain: float = 1.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        channels = weight.shape[0]
        self.channels = channels
        # sqrt(C) * (offset + w) stored as one constant: one op fewer, same real value. ``gain``
        # folds a constant factor on the output in too (an attention scale after a q norm).
        gamma = (weight + weight_offset) * (channels**0.5 * gain)
        self.register_buffer("gamma", self._shape_gamma(gamma))
        # Kept as buffers so a half() module rounds them exactly as the fp16 program stores them.
        self.register_buffer("inv_scale", torch.tensor(1.0))
        self.register_buffer("scaled_eps", torch.tensor(float(eps) * channels))
        self.prescale = 1.0

    def _shape_gamma(self, gamma: torch.Tensor) -> torch.Tensor:
        return gamma.reshape(1, -1, 1, 1).clone()

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


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each head separately: ``x[b, n*d, 0, l]`` holds ``heads`` heads of ``d``
    channels and each is normalised over its own ``d`` channels with the same ``(offset + w)``
    (Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``). Viewing ``(B, n*d, 1, L)`` as
    ``(B, n, d, L)`` is free (the same memory); the prescale works as in `RMSNorm`."""

    def __init__(
        self,
        weight: torch.Tensor,
        eps: float,
        heads: int,
        length: int,
        weight_offset: float = 0.0,
        gain: float = 1.0,
    ) -> None:
        self.heads = heads
        self.length = length
        super().__init__(weight, eps, weight_offset, gain)

    def _shape_gamma(self, gamma: torch.Tensor) -> torch.Tensor:
        return gamma.reshape(1, 1, -1, 1).clone()

    def forward(self, x: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """``x`` (B, n*d, 1, L); ``length`` L where it is not the module's own (a cached
        decoder's T tokens)."""
        # Python ints, not x.shape: traced shape reads become int casts coremltools rejects.
        length = self.length if length is None else length
        heads = x.reshape(-1, self.heads, self.channels, length)
        if self.prescale != 1.0:
            heads = heads * self.inv_scale
        sum_square = (heads * heads).sum(dim=2, keepdim=True)
        y = heads * torch.rsqrt(sum_square + self.scaled_eps) * self.gamma
        return y.reshape(-1, self.heads * self.channels, 1, length)
