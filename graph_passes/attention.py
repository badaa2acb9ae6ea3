"""Self-attention in BC1L layout, one head at a time, softmax on the key axis.

Shapes: queries and values stay ``(B, d, 1, L)``; keys are transposed once per kv head to
``(B, L, 1, d)``; scores are ``score[b, key, 0, query]`` so the softmax runs on axis 1, the
channel axis the NE prefers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from graph_passes.rope import Rope
from graph_passes.spec import AttentionSpec


def conv1x1(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Conv2d:
    """A 1x1 Conv2d computing ``W @ x`` over channels: ``K[o, i, 0, 0] = W[o, i]``."""
    out_ch, in_ch = weight.shape
    conv = nn.Conv2d(in_ch, out_ch, kernel_size=1, bias=bias is not None)
    with torch.no_grad():
        conv.weight.copy_(weight.reshape(out_ch, in_ch, 1, 1))
        if bias is not None:
            conv.bias.copy_(bias)  # type: ignore[union-attr]
    return conv


class Attention(nn.Module):
    """Per-head attention with GQA: query head h reads kv head ``h // (H / KV)``."""

    def __init__(
        self,
        spec: AttentionSpec,
        weights: dict[str, torch.Tensor],
        prefix: str,
        positions: torch.Tensor,
    ) -> None:
        super().__init__()
        self.spec = spec
        d = spec.head_dim
        # 1/sqrt(d) folded into the query rows (and bias): scaling commutes with the linear
        # RoPE and the dot product, so the function is unchanged; for d = 64 the factor 1/8 is
        # a power of two and the fold is exact in floating point too.
        scale = 1.0 / math.sqrt(d)
        wq, wk, wv = (weights[f"{prefix}.{n}.weight"] for n in "qkv")
        bias = None
        if spec.qkv_bias:
            bq, bk, bv = (weights[f"{prefix}.{n}.bias"] for n in "qkv")
            bias = torch.cat([bq * scale, bk, bv])
        # One conv for q, k and v: one weight read, one op; the output channels are split.
        self.qkv = conv1x1(torch.cat([wq * scale, wk, wv]), bias)
        self.o = conv1x1(weights[f"{prefix}.o.weight"], weights.get(f"{prefix}.o.bias"))
        # Absolute-position models (BERT) have no rotation: spec.rope is False.
        self.rope = Rope(d, spec.rope_theta, positions) if spec.rope else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` (B, D, 1, L) normalised input; ``mask`` (B, L, 1, L) additive, key on axis 1."""
        s = self.spec
        d = s.head_dim
        qk, v = self.qkv(x).split([(s.num_heads + s.num_kv_heads) * d, s.num_kv_heads * d], dim=1)
        if self.rope is not None:
            qk = self.rope(qk, s.num_heads + s.num_kv_heads)
        heads = qk.split(d, dim=1)
        queries, keys = heads[: s.num_heads], heads[s.num_heads :]
        keys_t = [k.transpose(1, 3) for k in keys]  # (B, L, 1, d)
        values = v.split(d, dim=1)
        outputs = []
        for h, q in enumerate(queries):
            g = h // s.group_size
            score = torch.einsum("bkhc,bchq->bkhq", keys_t[g], q)
            weight = torch.softmax(score + mask, dim=1)
            outputs.append(torch.einsum("bchk,bkhq->bchq", values[g], weight))
        return self.o(torch.cat(outputs, dim=1))
