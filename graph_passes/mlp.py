"""Feed-forward blocks in BC1L layout: gated (SwiGLU, GeGLU) and plain (BERT's GELU MLP).

Activations are the checkpoint's exactly: exact (erf) GELU and tanh GELU are different
functions and never substitute for each other. SiLU may be spelled two ways (`spelled_mul_sigmoid`),
both the checkpoint's function: coremltools' torch frontend turns ``silu`` into one ``silu``
op, ``x * sigmoid(x)`` into a ``sigmoid`` and a ``mul`` (kept so by `converter.coreml.program`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from graph_passes.attention import conv1x1
from graph_passes.errors import InputError
from graph_passes.spec import Activation, CanonicalModel, MlpSpec


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


def _silu_mul_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,  # exact (erf)
    "gelu_tanh": _gelu_tanh,  # transformers' gelu_pytorch_tanh
    "silu_mul_sigmoid": _silu_mul_sigmoid,
}


def spelled_mul_sigmoid(canonical: CanonicalModel) -> CanonicalModel:
    """``canonical`` with every SiLU MLP spelled ``x * sigmoid(x)`` (recipe silu_form:
    mul-sigmoid). Raises InputError naming the recipe key when the model has no SiLU."""
    spec = canonical.spec
    if not any(layer.mlp.act == "silu" for layer in spec.layers):
        acts = sorted({layer.mlp.act for layer in spec.layers})
        raise InputError(
            f"silu_form: mul-sigmoid: this {spec.architecture} checkpoint's MLP activation is "
            f"{', '.join(acts)}, not silu: nothing to spell; remove silu_form"
        )
    layers = tuple(
        replace(layer, mlp=replace(layer.mlp, activation="silu_mul_sigmoid"))
        if layer.mlp.act == "silu"
        else layer
        for layer in spec.layers
    )
    return replace(canonical, spec=replace(spec, layers=layers))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (silu), GeGLU (exact or tanh GELU).

    Gate and up projections are fused into one D -> 2I conv (one weight read, one op), split on
    channels; the activation reads the first half.
    """

    def __init__(self, spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size
        self.activation = ACTIVATIONS[spec.act]
        bias = None
        if spec.bias:
            bias = torch.cat([weights[f"{prefix}.gate.bias"], weights[f"{prefix}.up.bias"]])
        self.gate_up = conv1x1(
            torch.cat([weights[f"{prefix}.gate.weight"], weights[f"{prefix}.up.weight"]]), bias
        )
        self.down = conv1x1(weights[f"{prefix}.down.weight"], weights.get(f"{prefix}.down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=1)
        return self.down(self.activation(gate) * up)


# The decoder's historical name for the silu form.
SwiGLU = GatedMLP


class PlainMLP(nn.Module):
    """BERT's feed-forward: ``down(act(up(x)))`` (exact GELU for BERT)."""

    def __init__(self, spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[spec.act]
        self.up = conv1x1(weights[f"{prefix}.up.weight"], weights.get(f"{prefix}.up.bias"))
        self.down = conv1x1(weights[f"{prefix}.down.weight"], weights.get(f"{prefix}.down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


def build_mlp(spec: MlpSpec, weights: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """The MLP module a spec describes."""
    if spec.gated:
        return GatedMLP(spec, weights, prefix)
    return PlainMLP(spec, weights, prefix)
