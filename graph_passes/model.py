"""The one BC1L block: a transformer layer of any `LayerSpec`, decoder or encoder.

`Block` runs the layer in the placement its spec names (`graph_passes.spec.NormPlacement`):
``pre`` (Llama, Qwen, ModernBERT), ``post`` (BERT) or ``both`` (Gemma's four norms per layer),
with the attention (GQA, RoPE, q/k norms, window, scale) and MLP (gated or plain, its exact
activation) the spec describes. `BC1LDecoder` and `BC1LEncoder` only add what differs around
the layers: embeddings, masks, LM head or task tail.
"""

from __future__ import annotations

import torch
from torch import nn

from graph_passes.attention import Attention, KeyValues
from graph_passes.layer_norm import LayerNorm
from graph_passes.mlp import build_mlp
from graph_passes.norms import RMSNorm
from graph_passes.spec import LayerSpec, NormSpec

Norm = RMSNorm | LayerNorm

# Canonical name of each norm slot of a layer (its weights are ``layers.i.<name>.weight``).
NORM_SLOTS = (
    ("attention_norm", "attn_norm"),
    ("attention_out_norm", "attn_out_norm"),
    ("mlp_norm", "mlp_norm"),
    ("mlp_out_norm", "mlp_out_norm"),
)


def build_norm(spec: NormSpec, weights: dict[str, torch.Tensor], name: str) -> Norm:
    """The norm ``spec`` describes, with weights ``name.weight`` (and ``name.bias``)."""
    if spec.kind == "rms":
        if spec.bias:
            raise ValueError(f"{name}: an RMSNorm has no bias")
        return RMSNorm(weights[f"{name}.weight"], spec.eps, spec.weight_offset)
    if spec.weight_offset:
        raise ValueError(f"{name}: LayerNorm with a weight offset is not implemented")
    bias = weights[f"{name}.bias"] if spec.bias else None
    return LayerNorm(weights[f"{name}.weight"], bias, spec.eps)


def _optional_norm(
    spec: NormSpec | None, weights: dict[str, torch.Tensor], name: str
) -> Norm | None:
    return None if spec is None else build_norm(spec, weights, name)


class Block(nn.Module):
    """One transformer layer in BC1L layout ``h[b, c, 0, l]``; see `LayerSpec`."""

    def __init__(
        self,
        spec: LayerSpec,
        weights: dict[str, torch.Tensor],
        index: int,
        positions: torch.Tensor,
    ) -> None:
        super().__init__()
        p = f"layers.{index}"
        self.placement = spec.placement
        self.window = spec.attention.window
        self.attention = Attention(spec.attention, weights, f"{p}.attn", positions)
        self.attention_norm = _optional_norm(spec.attention_norm, weights, f"{p}.attn_norm")
        self.attention_out_norm = _optional_norm(
            spec.attention_out_norm, weights, f"{p}.attn_out_norm"
        )
        self.mlp = build_mlp(spec.mlp, weights, f"{p}.mlp")
        self.mlp_norm: Norm = build_norm(spec.mlp_norm, weights, f"{p}.mlp_norm")
        self.mlp_out_norm = _optional_norm(spec.mlp_out_norm, weights, f"{p}.mlp_out_norm")

    @property
    def input_norm(self) -> Norm:
        """The norm before attention (a decoder's ``input_layernorm``)."""
        if self.attention_norm is None:
            raise AttributeError("this layer's attention norm is the identity")
        return self.attention_norm

    @property
    def post_attention_norm(self) -> Norm:
        """The norm before the MLP (a Llama decoder's ``post_attention_layernorm``)."""
        return self.mlp_norm

    def norms(self, prefix: str) -> list[tuple[str, nn.Module]]:
        """Every norm of the layer with its stable name, in execution order: the q/k norms
        inside attention come right after the attention norm."""
        named: list[tuple[str, nn.Module]] = []
        for attr, name in NORM_SLOTS:
            norm = getattr(self, attr)
            if norm is not None:
                named.append((f"{prefix}.{name}", norm))
            if attr == "attention_norm":
                for qk in ("q_norm", "k_norm"):
                    head_norm = getattr(self.attention, qk)
                    if head_norm is not None:
                        named.append((f"{prefix}.attn.{qk}", head_norm))
        return named

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keys: KeyValues | None = None
    ) -> torch.Tensor:
        """The layer on ``x`` (B, D, 1, L); ``mask`` and ``keys`` as `Attention.forward`
        takes them (``keys``: a cached decoder's cache, None: the window's own keys)."""
        if self.placement == "post":
            h = self.attention(x, mask, keys) + x
            if self.attention_norm is not None:
                h = self.attention_norm(h)
            return self.mlp_norm(self.mlp(h) + h)
        normed = x if self.attention_norm is None else self.attention_norm(x)
        branch = self.attention(normed, mask, keys)
        if self.attention_out_norm is not None:
            branch = self.attention_out_norm(branch)
        h = x + branch
        branch = self.mlp(self.mlp_norm(h))
        if self.mlp_out_norm is not None:
            branch = self.mlp_out_norm(branch)
        return h + branch
