"""LayerNorm in BC1L layout, in the checkpoint's own affine order and epsilon (SPEC section 2).

``y = ((x - mu) / sqrt(v + eps)) * gamma + beta`` over the channel axis of ``x[b, c, 0, l]``,
with the population variance ``v``. Apple's reference LayerNorm adds beta *before* scaling by
gamma, which is a different function whenever beta is non-zero; this module keeps the original
order. Prescales are chosen from measured ranges like the RMSNorm ones (`graph_passes.prescale`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from graph_passes.prescale import NormScale, choose_prescale, measure_norm_inputs, norm_scale

# The smallest normal fp16 number. A smaller constant is an fp16 subnormal (or 0: BERT's
# C * 1e-12 = 3.8e-10 rounds to 0), which a Neural Engine may flush to zero; a zero epsilon
# turns a constant row (e.g. a zero-filled padded slot) into 0 * inf = NaN that a later matmul
# spreads into real tokens. Real rows have sums of squares many orders above it.
FP16_EPS_FLOOR = 2.0**-14


class LayerNorm(nn.Module):
    """LayerNorm over channels with an optional bias and a power-of-two prescale.

    Computed as ``c = x/a - mean_c(x/a)``,
    ``y = c * rsqrt(sum_c(c^2) + C*eps/a^2) * (sqrt(C) * gamma) + beta``.

    Why exact (in real arithmetic): ``v = sum_c(c^2) / C`` for the centred ``c``, so
    ``1/sqrt(v + eps) = sqrt(C) / sqrt(sum + C*eps)``; the mean and the centring commute with
    the division by ``a``, and ``a`` cancels between ``c`` and ``sqrt(sum + C*eps/a^2)``. For
    ``a = 2^k`` the division only changes exponents. Why this form: the prescale keeps the sum
    of squares inside fp16 where activations are large, and the sum (not the mean) keeps it
    away from fp16's subnormals. gamma and beta are applied in the original order: scale, then
    shift.
    """

    gamma: torch.Tensor
    beta: torch.Tensor | None
    inv_scale: torch.Tensor
    scaled_eps: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> None:
        super().__init__()
        channels = int(weight.shape[0])
        self.channels = channels
        self.eps = eps
        # sqrt(C) * gamma stored as one constant: the same real value, one op fewer.
        self.register_buffer("gamma", (weight * channels**0.5).reshape(1, -1, 1, 1).clone())
        beta = None if bias is None else bias.reshape(1, -1, 1, 1).clone()
        self.register_buffer("beta", beta)
        self.register_buffer("inv_scale", torch.tensor(1.0))
        self.register_buffer("scaled_eps", torch.tensor(float(eps) * channels))
        self.prescale = 1.0
        self.eps_floor = 0.0

    def set_prescale(self, scale: float) -> None:
        """Use ``x / scale`` inside the norm; ``scale`` must be a positive power of two."""
        mantissa, _ = torch.frexp(torch.tensor(scale, dtype=torch.float64))
        if scale <= 0 or float(mantissa) != 0.5:
            raise ValueError(f"prescale must be a positive power of two, got {scale}")
        self.prescale = scale
        self.inv_scale.fill_(1.0 / scale)
        self._store_eps()

    def set_eps_floor(self, floor: float) -> None:
        """Store ``max(C*eps/a^2, floor)``: use `FP16_EPS_FLOOR` for an fp16 program (a
        deviation the manifest records), 0 for the exact fp32 rewrite."""
        self.eps_floor = floor
        self._store_eps()

    @property
    def exact_scaled_eps(self) -> float:
        """``C * eps / a^2`` before any floor."""
        return self.channels * self.eps / (self.prescale * self.prescale)

    def _store_eps(self) -> None:
        self.scaled_eps.fill_(max(self.exact_scaled_eps, self.eps_floor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prescale != 1.0:
            x = x * self.inv_scale
        centred = x - x.mean(dim=1, keepdim=True)
        sum_square = (centred * centred).sum(dim=1, keepdim=True)
        # gamma before the rsqrt factor, so the program does not end in "mul by a constant, add
        # a constant": coremltools fuses that pair into batch_norm with variance 1 and its own
        # epsilon 1e-5, which scales every output by 1/sqrt(1 + 1e-5) (seen in the MiniLM
        # program). Same real value and affine order: normalise and scale, then shift.
        y = centred * self.gamma * torch.rsqrt(sum_square + self.scaled_eps)
        return y if self.beta is None else y + self.beta


def measure_centred_l2(
    norms: Sequence[tuple[str, LayerNorm]], run: Callable[[], object]
) -> dict[str, float]:
    """Largest per-position L2 norm of the *centred* input (what the norm squares and sums)
    reaching each LayerNorm during ``run()``."""
    return measure_norm_inputs(norms, run, centred=True)


def apply_layer_norm_prescales(
    norms: Iterable[tuple[str, LayerNorm]], maxima: dict[str, float], eps_floor: float
) -> list[NormScale]:
    """Set each norm's prescale from its measured maximum and its epsilon floor; returns what
    was chosen, with the constant the program stores (``fp16_scaled_eps``, floor applied)."""
    chosen = []
    for name, norm in norms:
        scale = choose_prescale(maxima[name])
        norm.set_prescale(scale)
        # The module keeps the exact constant (the fp32 rewrite); the fp16 program's module
        # gets the floor (BC1LEncoder.set_eps_floor), and the record says what it stores.
        norm.set_eps_floor(0.0)
        chosen.append(norm_scale(name, maxima[name], scale, norm.channels, norm.eps, eps_floor))
    return chosen
