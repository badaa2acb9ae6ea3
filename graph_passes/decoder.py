"""The BC1L decoder: one implementation that runs any decoder `CanonicalModel`.

Activations live as ``h[b, c, 0, l]`` from the first layer to the last; the only layout change
is at the entry, where ``(B, L, D)`` embedding rows become ``(B, D, 1, L)``.

I/O contract (fixed shapes, batch B, window L):

* ``input_ids`` (B, L) int32, or ``inputs_embeds`` (B, L, D) - rows of the embedding table
  gathered on the host;
* ``key_mask`` (B, L) additive: 0 for a real token, ``masks.MASKED`` for padding;
* ``logits_<k>`` (B, n, 1, V_k) for each LM-head chunk k: the logits of tokens
  ``[k*chunk, k*chunk + V_k)`` at the last n window positions, the vocabulary on the last
  axis (`graph_passes.logits_layout`; manifest schema 3).

Padding is on the left, so the last real token always sits in slot L-1. Slot ``l`` has RoPE
position ``l``; left padding by p shifts every real token's position by p, which leaves the
attention scores unchanged because RoPE depends only on position differences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from graph_passes.attention import conv1x1
from graph_passes.logits_layout import HeadOutput, choose, vocab_last
from graph_passes.masks import causal_mask, causal_window_mask
from graph_passes.model import Block, build_norm
from graph_passes.norms import RMSNorm
from graph_passes.spec import CanonicalModel

InputKind = Literal["token-ids", "embeddings"]
MaskConstant = Callable[[torch.Tensor], torch.Tensor]


def _as_stored(constant: torch.Tensor) -> torch.Tensor:
    """A mask constant as the module holds it."""
    return constant


@dataclass(frozen=True)
class DecoderIO:
    """Fixed shapes and I/O choices of one emitted decoder function."""

    batch: int
    length: int
    inputs: InputKind
    logit_positions: int  # the last n window positions get logits (n = length for all)
    lm_head_chunk: int
    output: HeadOutput = "logits"  # per LM-head chunk: logits, argmax or top-k
    top_k: int = 0  # k of output "topk"


# A decoder layer is the shared block (pre-norm for Llama / Qwen, "both" for Gemma).
DecoderLayer = Block


class HostTable:
    """The host-side embedding table a module refers to: host data, not module state, so
    ``half()`` leaves it fp32 and ``deepcopy`` (an fp16 twin of the module) shares it instead
    of copying a vocab x D table."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __deepcopy__(self, memo: dict[int, object]) -> HostTable:
        return self


def scaled_embeddings(table: torch.Tensor, scale: float) -> torch.Tensor:
    """``table * scale`` as transformers computes a scaled embedding row in fp32 (Gemma's
    ``embed_tokens(ids) * embed_scale`` with an fp32 ``embed_scale``); the table itself when
    the scale is 1."""
    if scale == 1.0:
        return table
    return table * torch.tensor(scale, dtype=torch.float32)


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
        self._host_table = HostTable(
            scaled_embeddings(w["embed.weight"], spec.embed_scale * spec.stream_scale)
        )
        self.embed: nn.Embedding | None = None
        if io.inputs == "token-ids":
            self.embed = nn.Embedding.from_pretrained(self._host_table.table.clone(), freeze=True)
        self.layers = nn.ModuleList(
            Block(layer, w, i, positions) for i, layer in enumerate(spec.layers)
        )
        final_norm = build_norm(spec.final_norm, w, "final_norm")
        if not isinstance(final_norm, RMSNorm):
            raise ValueError("decoder final norms are RMSNorms")
        self.final_norm = final_norm
        head = model.lm_head_weight()
        self.chunk_sizes = chunk_sizes(spec.vocab_size, io.lm_head_chunk)
        # Separate convs and separate outputs: concatenating them would rebuild the
        # vocab-wide axis that exceeds the NE's per-axis limit (16384 on M1-M3).
        self.lm_head = nn.ModuleList(
            conv1x1(part, None) for part in head.split(self.chunk_sizes, dim=0)
        )
        self.register_buffer("causal", causal_mask(io.length))
        # One causal window mask per window size of the local layers (None: global layers). A
        # window of at least L hides no key inside the window of L slots (q - window < 0 <= k),
        # so such layers share the global mask: exact, and no extra constant in the program.
        self.windows = sorted(
            {size for ls in spec.layers if (size := ls.attention.window) and size < io.length}
        )
        for layer_spec in spec.layers:
            rule = layer_spec.attention.window_rule
            if layer_spec.attention.window is not None and rule != "causal-exclusive":
                raise ValueError(f"a decoder's sliding window is causal, got {rule!r}")
        for window in self.windows:
            self.register_buffer(f"causal_{window}", causal_window_mask(io.length, window))

    def keep_head_rows(self, ids: torch.Tensor) -> None:
        """Trim the LM head to the rows ``ids`` (ascending, unique): row j of the trimmed
        head scores token ``ids[j]``; chunked again by ``io.lm_head_chunk``. The body and
        the host embedding table stay whole (a draft vocabulary, `converter.vocabulary`)."""
        head = torch.cat([cast(nn.Conv2d, conv).weight[:, :, 0, 0] for conv in self.lm_head])
        if ids.ndim != 1 or len(ids) == 0 or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("head rows must be a non-empty, ascending list of unique ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= len(head):
            raise ValueError(f"head rows must lie in 0..{len(head) - 1}")
        self.chunk_sizes = chunk_sizes(len(ids), self.io.lm_head_chunk)
        kept = head[ids]
        self.lm_head = nn.ModuleList(
            conv1x1(part, None) for part in kept.split(self.chunk_sizes, dim=0)
        )

    def host_embedding_table(self) -> torch.Tensor:
        """The exact table (vocab, D) a host gathers ``inputs_embeds`` rows from: the
        checkpoint's embeddings times the embedding scale (Gemma: sqrt(D)) and the residual
        stream scale, in fp32."""
        return self._host_table.table

    def norms(self) -> list[tuple[str, RMSNorm]]:
        """Every norm with its stable name, in execution order."""
        named: list[tuple[str, RMSNorm]] = []
        for i, layer in enumerate(self.decoder_layers()):
            named += [(name, cast(RMSNorm, n)) for name, n in layer.norms(f"layers.{i}")]
        named.append(("final_norm", self.final_norm))
        return named

    def decoder_layers(self) -> list[Block]:
        """The transformer layers, typed."""
        return [cast(Block, layer) for layer in self.layers]

    def embed_bc1l(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, L) or embedding rows (B, L, D) -> (B, D, 1, L)."""
        if self.embed is not None:
            x = self.embed(x)
        return x.transpose(1, 2).unsqueeze(2)

    def masks(
        self, key_mask: torch.Tensor, constant: MaskConstant = _as_stored
    ) -> dict[int | None, torch.Tensor]:
        """The combined mask of each window size (None: global), key mask included.

        ``constant`` maps each stored mask constant before the key mask is added: a check
        computing the program's function in another precision passes the program's rounding
        of the constants (fp16) and its own dtype here, and so builds no mask of its own."""
        keys = key_mask.reshape(-1, self.io.length, 1, 1)
        out: dict[int | None, torch.Tensor] = {None: constant(self.causal) + keys}
        for window in self.windows:
            out[window] = constant(getattr(self, f"causal_{window}")) + keys
        return out

    def layer_masks(
        self, key_mask: torch.Tensor, constant: MaskConstant = _as_stored
    ) -> list[torch.Tensor]:
        """The mask each layer attends with, in layer order (`masks`: a local layer gets its
        window's mask, a global layer or a window of at least L the causal one); layers of
        one window share one tensor."""
        masks = self.masks(key_mask, constant)
        return [masks.get(layer.window, masks[None]) for layer in self.decoder_layers()]

    def run_layers(self, x: torch.Tensor, key_mask: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream after each layer, each (B, D, 1, L), times
        ``spec.stream_scale`` (divide by it to compare with the checkpoint's)."""
        h = self.embed_bc1l(x)
        states = []
        for layer, mask in zip(self.decoder_layers(), self.layer_masks(key_mask), strict=True):
            h = layer(h, mask)
            states.append(h)
        return states

    def head(self, h: torch.Tensor) -> list[torch.Tensor]:
        """Final norm and the LM-head chunks on ``h`` (B, D, 1, n)."""
        h = self.final_norm(h)
        return [conv(h) for conv in self.lm_head]

    def head_outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The program's head outputs on ``h`` (B, D, 1, n), per chunk with the vocabulary
        last (see `graph_passes.logits_layout`): the logits (B, n, 1, V_k), or the output
        choice's (index, value) pairs of it (`choose`)."""
        chunks = [vocab_last(chunk) for chunk in self.head(h)]
        if self.io.output == "logits":
            return tuple(chunks)
        return tuple(t for chunk in chunks for t in choose(chunk, self.io.output, self.io.top_k))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        last = self.run_layers(x, key_mask)[-1]
        n = self.io.logit_positions
        if n < self.io.length:
            # The norm and head act per position, so slicing before them is exact.
            last = last[:, :, :, self.io.length - n :]
        return self.head_outputs(last)
