"""A naive (B, L, C) Llama decoder: the baseline bench/convert.py and ``anec plan-baseline`` use.

Written the way a typical hand-written port looks, on purpose: ``nn.Linear`` projections,
heads batched as (B, H, L, d), GQA by ``repeat_interleave`` of k and v, HF-style
``rotate_half`` RoPE on the full head tensor, scores scaled by 1/sqrt(d), an additive causal +
key mask, softmax on the last axis, RMSNorm over the last axis of (B, L, C), SwiGLU and a tied
LM head as one ``nn.Linear`` over the full vocabulary, applied to the last position only.

It is a correct model in fp32 (the bench checks it against transformers), not an fp16-safe
one: SmolLM2's residual stream squares past fp16's range inside RMSNorm. The bench measures its
conversion cost and graph size, not its fp16 numerics.

I/O matches the anec decoder: ``inputs_embeds`` (B, L, D), ``key_mask`` (B, L) additive
(0 real, ``MASKED`` padding, left padding); output ``logits`` (B, 1, vocab).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from graph_passes.archs.config import rope_theta
from graph_passes.masks import MASKED


@dataclass(frozen=True)
class NaiveConfig:
    """The few numbers a Llama-style decoder needs."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool

    @classmethod
    def from_hf(cls, config: object) -> NaiveConfig:
        """Read a transformers ``LlamaConfig`` / ``Qwen2Config`` object."""
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(config.intermediate_size),  # type: ignore[attr-defined]
            num_layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            vocab_size=int(config.vocab_size),  # type: ignore[attr-defined]
            rms_norm_eps=float(config.rms_norm_eps),  # type: ignore[attr-defined]
            # transformers 5 keeps theta in rope_parameters, older versions in rope_theta.
            rope_theta=rope_theta(config),
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )


class RMSNorm(nn.Module):
    """RMSNorm over the last axis of (B, L, C)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: (x1, x2) -> (-x2, x1) on the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Heads-batched attention (B, H, L, d) with GQA by repeating k and v."""

    def __init__(self, cfg: NaiveConfig, length: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.length = length
        d, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        c = self.cfg
        d, length = c.head_dim, self.length
        q = self.q_proj(x).view(-1, length, c.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(-1, length, c.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(-1, length, c.num_kv_heads, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(-1, length, c.num_heads * d))


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: NaiveConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """Pre-norm decoder layer."""

    def __init__(self, cfg: NaiveConfig, length: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, length)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class NaiveLlama(nn.Module):
    """Llama-style decoder over (B, L, C) returning the last position's logits (B, 1, vocab)."""

    cos: torch.Tensor  # buffers, declared for the type checker
    sin: torch.Tensor
    causal: torch.Tensor

    def __init__(self, cfg: NaiveConfig, length: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.length = length
        self.layers = nn.ModuleList(Layer(cfg, length) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Fixed window: positions 0..L-1, tables computed once (HF's default RoPE).
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None])  # (1, 1, L, d)
        self.register_buffer("sin", emb.sin()[None, None])
        causal = torch.triu(torch.full((length, length), MASKED), diagonal=1)
        self.register_buffer("causal", causal[None, None])  # (1, 1, L, L)

    @classmethod
    def from_hf(
        cls, config: object, state_dict: Mapping[str, torch.Tensor], length: int
    ) -> NaiveLlama:
        """Build from a transformers ``*ForCausalLM`` config and state dict (tied head)."""
        model = cls(NaiveConfig.from_hf(config), length)
        ours = {k.removeprefix("model."): v for k, v in state_dict.items()}
        ours.setdefault("lm_head.weight", ours["embed_tokens.weight"])  # tied embeddings
        ours.pop("embed_tokens.weight")  # embeddings are gathered on the host
        ours = {k: v for k, v in ours.items() if "rotary_emb" not in k}
        # Buffers are computed here, not loaded: strict=False, then check both directions.
        result = model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=False)
        missing = set(result.missing_keys) - {"cos", "sin", "causal"}
        if missing or result.unexpected_keys:
            unexpected = result.unexpected_keys[:5]
            raise KeyError(f"missing {sorted(missing)[:5]}, unexpected {unexpected}")
        return model.eval()

    def forward(self, inputs_embeds: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        mask = self.causal + key_mask[:, None, None, :]
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, self.cos, self.sin, mask)
        return self.lm_head(self.norm(h[:, -1:, :]))
