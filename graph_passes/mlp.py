"""SwiGLU feed-forward in BC1L layout: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from graph_passes.attention import conv1x1
from graph_passes.spec import MlpSpec


class SwiGLU(nn.Module):
    """Gate and up projections fused into one D -> 2I conv, split on channels."""

    def __init__(self, spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size
        bias = None
        if spec.bias:
            bias = torch.cat([weights[f"{prefix}.gate.bias"], weights[f"{prefix}.up.bias"]])
        self.gate_up = conv1x1(
            torch.cat([weights[f"{prefix}.gate.weight"], weights[f"{prefix}.up.weight"]]), bias
        )
        self.down = conv1x1(weights[f"{prefix}.down.weight"], weights.get(f"{prefix}.down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=1)
        return self.down(nn.functional.silu(gate) * up)


class GeluMLP(nn.Module):
    """BERT's feed-forward: ``down(gelu(up(x)))`` with exact (erf) GELU, never the tanh form."""

    def __init__(self, spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.up = conv1x1(weights[f"{prefix}.up.weight"], weights.get(f"{prefix}.up.bias"))
        self.down = conv1x1(weights[f"{prefix}.down.weight"], weights.get(f"{prefix}.down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class GeGLU(nn.Module):
    """ModernBERT's feed-forward: one fused D -> 2I conv split into value and gate,
    ``down(gelu(value) * gate)`` with exact (erf) GELU on the value (the first half)."""

    def __init__(self, spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size
        bias = None
        if spec.bias:
            bias = torch.cat([weights[f"{prefix}.value.bias"], weights[f"{prefix}.gate.bias"]])
        self.value_gate = conv1x1(
            torch.cat([weights[f"{prefix}.value.weight"], weights[f"{prefix}.gate.weight"]]), bias
        )
        self.down = conv1x1(weights[f"{prefix}.down.weight"], weights.get(f"{prefix}.down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.value_gate(x).split(self.intermediate, dim=1)
        return self.down(nn.functional.gelu(value) * gate)
