"""The BC1L decoder: one implementation that runs any decoder `CanonicalModel`.

Activations live as ``h[b, c, 0, l]`` from the first layer to the last; the only layout change
is at the entry, where ``(B, L, D)`` embedding rows become ``(B, D, 1, L)``.

I/O contract (fixed shapes, batch B, window L):

* ``input_ids`` (B, L) int32, or ``inputs_embeds`` (B, L, D) - rows of the embedding table
  gathered on the host;
* ``key_mask`` (B, L) additive: 0 for a real token, ``masks.MASKED`` for padding;
* ``logits_<k>`` (B, V_k, 1, n) for each LM-head chunk k: the logits of tokens
  ``[k*chunk, k*chunk + V_k)`` at the last n window positions.

Padding is on the left, so the last real token always sits in slot L-1. Slot ``l`` has RoPE
position ``l``; left padding by p shifts every real token's position by p, which leaves the
attention scores unchanged because RoPE depends only on position differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from graph_passes.attention import Attention, conv1x1
from graph_passes.masks import causal_mask
from graph_passes.mlp import SwiGLU
from graph_passes.norms import RMSNorm
from graph_passes.spec import CanonicalModel, LayerSpec, NormSpec

InputKind = Literal["token-ids", "embeddings"]


@dataclass(frozen=True)
class DecoderIO:
    """Fixed shapes and I/O choices of one emitted decoder function."""

    batch: int
    length: int
    inputs: InputKind
    logit_positions: int  # the last n window positions get logits (n = length for all)
    lm_head_chunk: int


def build_norm(spec: NormSpec, weight: torch.Tensor) -> RMSNorm:
    """The norm module for a spec (only RMSNorm for decoders so far)."""
    return RMSNorm(weight, spec.eps, spec.weight_offset)


class DecoderLayer(nn.Module):
    """Pre-norm layer: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``."""

    def __init__(
        self, spec: LayerSpec, weights: dict[str, torch.Tensor], index: int, positions: torch.Tensor
    ) -> None:
        super().__init__()
        p = f"layers.{index}"
        self.input_norm = build_norm(spec.input_norm, weights[f"{p}.input_norm.weight"])
        self.attention = Attention(spec.attention, weights, f"{p}.attn", positions)
        self.post_attention_norm = build_norm(
            spec.post_attention_norm, weights[f"{p}.post_attn_norm.weight"]
        )
        self.mlp = SwiGLU(spec.mlp, weights, f"{p}.mlp")

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.input_norm(x), mask)
        return h + self.mlp(self.post_attention_norm(h))


def chunk_sizes(vocab: int, chunk: int) -> list[int]:
    """Sizes of the LM-head chunks: ``chunk`` each, the remainder last."""
    sizes = [chunk] * (vocab // chunk)
    if vocab % chunk:
        sizes.append(vocab % chunk)
    return sizes


class BC1LDecoder(nn.Module):
    """A decoder-only transformer with an LM head, in BC1L layout."""

    causal: torch.Tensor

    def __init__(self, model: CanonicalModel, io: DecoderIO) -> None:
        super().__init__()
        spec = model.spec
        self.spec = spec
        self.io = io
        w = model.weights
        positions = torch.arange(io.length)
        self.embed: nn.Embedding | None = None
        if io.inputs == "token-ids":
            self.embed = nn.Embedding.from_pretrained(w["embed.weight"].clone(), freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(layer, w, i, positions) for i, layer in enumerate(spec.layers)
        )
        self.final_norm = build_norm(spec.final_norm, w["final_norm.weight"])
        head = model.lm_head_weight()
        self.chunk_sizes = chunk_sizes(spec.vocab_size, io.lm_head_chunk)
        # Separate convs and separate outputs: concatenating them would rebuild the
        # vocab-wide axis that exceeds the NE's per-axis limit (16384 on M1-M3).
        self.lm_head = nn.ModuleList(
            conv1x1(part, None) for part in head.split(self.chunk_sizes, dim=0)
        )
        self.register_buffer("causal", causal_mask(io.length))

    def norms(self) -> list[tuple[str, RMSNorm]]:
        """Every norm with its stable name, in execution order."""
        named: list[tuple[str, RMSNorm]] = []
        for i, layer in enumerate(self.decoder_layers()):
            named.append((f"layers.{i}.input_norm", layer.input_norm))
            named.append((f"layers.{i}.post_attention_norm", layer.post_attention_norm))
        named.append(("final_norm", self.final_norm))
        return named

    def decoder_layers(self) -> list[DecoderLayer]:
        """The transformer layers, typed."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def embed_bc1l(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, L) or embedding rows (B, L, D) -> (B, D, 1, L)."""
        if self.embed is not None:
            x = self.embed(x)
        return x.transpose(1, 2).unsqueeze(2)

    def attention_mask(self, key_mask: torch.Tensor) -> torch.Tensor:
        """One combined mask (B, L, 1, L) for all layers and heads, keys on axis 1 like the
        scores: the causal mask plus the key mask (B, L)."""
        return self.causal + key_mask.reshape(-1, self.io.length, 1, 1)

    def run_layers(self, x: torch.Tensor, key_mask: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream after each layer, each (B, D, 1, L)."""
        h = self.embed_bc1l(x)
        mask = self.attention_mask(key_mask)
        states = []
        for layer in self.decoder_layers():
            h = layer(h, mask)
            states.append(h)
        return states

    def head(self, h: torch.Tensor) -> list[torch.Tensor]:
        """Final norm and the LM-head chunks on ``h`` (B, D, 1, n)."""
        h = self.final_norm(h)
        return [conv(h) for conv in self.lm_head]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        last = self.run_layers(x, key_mask)[-1]
        n = self.io.logit_positions
        if n < self.io.length:
            # The norm and head act per position, so slicing before them is exact.
            last = last[:, :, :, self.io.length - n :]
        return tuple(self.head(last))
