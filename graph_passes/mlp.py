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
