"""Self-attention in BC1L layout, one head at a time, softmax on the key axis.

Shapes: queries and values stay ``(B, d, 1, L)``; keys are transposed once per kv head to
``(B, L, 1, d)``; scores are ``score[b, key, 0, query]`` so the softmax runs on axis 1, the
channel axis the NE prefers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from graph_passes.norms import HeadRMSNorm
from graph_passes.rope import Positions, Rope
from graph_passes.spec import AttentionSpec


def conv1x1(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Conv2d:
    """A 1x1 Conv2d computing ``W @ x`` over channels: ``K[o, i, 0, 0] = W[o, i]``.

    The kernel is ``weight`` itself, reshaped (a view where ``weight`` is contiguous), not a
    copy: the canonical weights are read-only, and a copy of every matrix was one fp32
    checkpoint more during the rewrite (Gemma 3 270M: 1 GB). Work that changes weights
    (compression, fp16 rounding) does it on a deep copy of the module.
    """
    out_ch, in_ch = weight.shape
    # Built on the meta device: its random initialisation would be thrown away.
    conv = nn.Conv2d(in_ch, out_ch, kernel_size=1, bias=bias is not None, device="meta")
    conv.weight = nn.Parameter(weight.detach().reshape(out_ch, in_ch, 1, 1))
    if bias is not None:
        conv.bias = nn.Parameter(bias.detach())
    return conv


class Attention(nn.Module):
    """Per-head attention with GQA: query head h reads kv head ``h // (H / KV)``.

    With per-head q/k norms (Qwen3, Gemma 3): ``q = rope(q_norm(Wq x))``, likewise ``k``.
    """

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
        length = int(positions.shape[0])
        # The score scale (1/sqrt(d), or the checkpoint's) is folded into the query: into its
        # rows (and bias) without a q norm, into the q norm's gain with one (a norm would undo
        # a scale on its input). Scaling commutes with the linear RoPE and the dot product, so
        # the function is unchanged; a power-of-two scale (1/8 for d = 64, Gemma's 1/16) is
        # exact in floating point too.
        scale = spec.score_scale
        row_scale = 1.0 if spec.qk_norm is not None else scale
        wq, wk, wv = (weights[f"{prefix}.{n}.weight"] for n in "qkv")
        bias = None
        if spec.qkv_bias:
            bq, bk, bv = (weights[f"{prefix}.{n}.bias"] for n in "qkv")
            bias = torch.cat([bq * row_scale, bk, bv])
        # One conv for q, k and v: one weight read, one op; the output channels are split.
        self.qkv = conv1x1(torch.cat([wq * row_scale, wk, wv]), bias)
        self.o = conv1x1(weights[f"{prefix}.o.weight"], weights.get(f"{prefix}.o.bias"))
        self.q_norm: HeadRMSNorm | None = None
        self.k_norm: HeadRMSNorm | None = None
        if spec.qk_norm is not None:
            n = spec.qk_norm
            if n.kind != "rms":
                raise ValueError(f"{prefix}: q/k norms are RMSNorms, got {n.kind!r}")
            self.q_norm = HeadRMSNorm(
                weights[f"{prefix}.q_norm.weight"], n.eps, spec.num_heads, length,
                n.weight_offset, gain=scale,
            )  # fmt: skip
            self.k_norm = HeadRMSNorm(
                weights[f"{prefix}.k_norm.weight"], n.eps, spec.num_kv_heads, length,
                n.weight_offset,
            )  # fmt: skip
        # Absolute-position models (BERT) have no rotation: spec.rope is False.
        self.rope = None
        if spec.rope:
            self.rope = Rope(d, spec.rope_theta, positions, spec.rotary_dim, spec.rope_scaling)

    def project(
        self, x: torch.Tensor, at: Positions | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Queries (already scaled) and keys, both normed and rotated, and values, each
        (B, heads * d, 1, L), at the module's window positions or at ``at``. Without q/k norms
        the queries and keys come as one tensor (the first; the second is None): one RoPE op
        for both, and the `KeyValues` splits them as its layout needs."""
        s = self.spec
        d = s.head_dim
        widths = [(s.num_heads + s.num_kv_heads) * d, s.num_kv_heads * d]
        qk, v = self.qkv(x).split(widths, dim=1)
        if self.q_norm is None or self.k_norm is None:
            if self.rope is not None:
                qk = self.rope(qk, s.num_heads + s.num_kv_heads, at)
            return qk, None, v
        length = None if at is None else at.length
        q, k = qk.split([s.num_heads * d, s.num_kv_heads * d], dim=1)
        q, k = self.q_norm(q, length), self.k_norm(k, length)
        if self.rope is not None:
            q, k = self.rope(q, s.num_heads, at), self.rope(k, s.num_kv_heads, at)
        return q, k, v

    def weights(self, score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention weights from scores ``score[b, key, 0, query]`` and an additive ``mask``
        of the same layout: the softmax over the key axis (axis 1, the channel axis)."""
        return torch.softmax(score + mask, dim=1)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keys: KeyValues | None = None
    ) -> torch.Tensor:
        """``x`` (B, D, 1, L) normalised input; ``mask`` additive, key on axis 1: (B, L, 1, L)
        over the window's own keys, or as ``keys`` lays its keys out (a cached decoder's)."""
        source = WindowKeys() if keys is None else keys
        q, k, v = self.project(x, source.positions)
        return self.o(torch.cat(source.attend(self, q, k, v, mask), dim=1))


class KeyValues(Protocol):
    """Where one attention call's keys and values live, and at which positions its tokens
    sit: what differs between a window (`WindowKeys`) and a cached call
    (`graph_passes.cached_decoder.CachedKeys`). Everything else - projections, biases, q/k
    norms, RoPE, the score scale, the softmax, the output projection - is `Attention`'s, the
    same code for both."""

    @property
    def positions(self) -> Positions | None:
        """The tokens' positions; None: the module's own window positions."""

    def attend(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor,
        mask: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Each query head's output (B, d, 1, L) from `Attention.project`'s ``q, k, v``."""
        ...


class WindowKeys:
    """The window's keys: its L tokens attend to each other (and to nothing else)."""

    positions: Positions | None = None

    def attend(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor,
        mask: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Per head: keys transposed once per kv head to (B, L, 1, d), scores
        ``score[b, key, 0, query]``, weighted values."""
        queries, keys, values = split_heads(attn.spec, q, k, v)
        keys_t = [key.transpose(1, 3) for key in keys]  # (B, L, 1, d)
        outputs = []
        for h, query in enumerate(queries):
            g = h // attn.spec.group_size
            score = torch.einsum("bkhc,bchq->bkhq", keys_t[g], query)
            weight = attn.weights(score, mask)
            outputs.append(torch.einsum("bchk,bkhq->bchq", values[g], weight))
        return outputs


def split_heads(
    s: AttentionSpec, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """Per-head queries, keys and values (B, d, 1, L); queries and keys in one tensor split
    in one op."""
    d = s.head_dim
    if k is None:
        heads = q.split(d, dim=1)
        return heads[: s.num_heads], heads[s.num_heads :], v.split(d, dim=1)
    return q.split(d, dim=1), k.split(d, dim=1), v.split(d, dim=1)
