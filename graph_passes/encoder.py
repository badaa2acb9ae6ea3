"""The BC1L encoder: one implementation that runs any `EncoderModel` (BERT, ModernBERT).

Batch folding. The B samples of a call are folded into one sequence of B*L slots,
``h[0, c, 0, b*L + l]``, from the embedding norm to the last layer, and a block-diagonal mask
keeps each sample's attention inside its own block. Why: every projection is a 1x1 conv, which
acts per slot, so folding changes nothing there; attention then runs as batch-1 matmuls, keeping
the batch axis out of the activation-by-activation matmuls that are reported to push a program
off the Neural Engine, with the op count of a B=1 program (per-sample attention would multiply
the attention ops by B). Why exact: a key of another sample gets ``MASKED`` (-1e4) added to its
score, ``exp`` of which is exactly 0 in fp16 and fp32, so each softmax row equals the
per-sample one - the same argument as for padding. The price is B times more score entries
(for B=3, L=64, D=768 about 4 % more FLOPs per layer than per-sample attention).

I/O contract (fixed shapes, batch B, window L, right padding: slot l of a sample is position
l, so BERT's absolute positions and RoPE positions both start at 0 for the first real token):

* ``input_ids`` (B, L) int32 [+ ``token_type_ids`` (B, L) int32 for BERT], or
  ``inputs_embeds`` (B, L, D): embedding rows already normalised on the host (partition);
* ``key_mask`` (B, L) additive: 0 for a real token, ``masks.MASKED`` for padding. It masks
  keys only; padded queries are computed like real ones (the checkpoint's rule in transformers'
  eager attention) and never read by the tail;
* the task output (see the tails below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from graph_passes.attention import conv1x1
from graph_passes.layer_norm import LayerNorm
from graph_passes.masks import folded_band_mask
from graph_passes.model import Block
from graph_passes.spec import ClassifierSpec, EncoderModel, EncoderSpec, NormSpec

EncoderInputs = Literal["token-ids", "embeddings"]
# last-hidden-state: (B, L, D) after the final norm; sentence-embedding: masked mean over real
# tokens then L2 normalisation (B, D); logits: the classifier head (B, labels).
EncoderOutput = Literal["last-hidden-state", "sentence-embedding", "logits"]


@dataclass(frozen=True)
class EncoderIO:
    """Fixed shapes and I/O choices of one emitted encoder function."""

    batch: int
    length: int
    inputs: EncoderInputs
    output: EncoderOutput

    @property
    def slots(self) -> int:
        """B*L: the folded sequence length every layer runs on."""
        return self.batch * self.length


def build_layer_norm(spec: NormSpec, weights: dict[str, torch.Tensor], name: str) -> LayerNorm:
    """The LayerNorm for ``spec`` with weights ``name.weight`` (and ``name.bias``)."""
    if spec.kind != "layer":
        raise ValueError(f"{name}: encoder norms are LayerNorms, got {spec.kind!r}")
    bias = weights[f"{name}.bias"] if spec.bias else None
    return LayerNorm(weights[f"{name}.weight"], bias, spec.eps)


def fold(rows: torch.Tensor) -> torch.Tensor:
    """(B, L, D) rows -> (1, D, 1, B*L): sample b's slot l becomes slot b*L + l."""
    # No shape reads: traced shape reads become int casts coremltools rejects.
    return rows.flatten(0, 1).transpose(0, 1).unsqueeze(0).unsqueeze(2)


def unfold(h: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(1, D, 1, B*L) -> (B, L, D), the inverse of `fold`."""
    return h.flatten(0, 2).transpose(0, 1).reshape(batch, length, -1)


def real_weights(key_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 1 for a real token, 0 for padding, from the additive key mask.

    ``relu(1 + m)``: 1 for ``m = 0`` and 0 for ``m = MASKED`` (or any value <= -1), exactly in
    any precision. Not ``1 - m / MASKED``: coremltools rewrites the division as a product with
    fp16(1 / MASKED), which leaves padded slots a weight of -1.66e-4 unless the product happens
    to round back to 1 (it does in fp16 arithmetic, not in fp32).
    """
    return torch.relu(1.0 + key_mask)


class EncoderEmbedding(nn.Module):
    """Token rows (+ absolute position rows + token-type rows), folded, then the norm."""

    positions: torch.Tensor | None

    def __init__(self, model: EncoderModel, io: EncoderIO) -> None:
        super().__init__()
        w, spec = model.weights, model.spec.embedding
        self.io = io
        self.word = nn.Embedding.from_pretrained(w["embed.word.weight"].clone(), freeze=True)
        self.types: nn.Embedding | None = None
        if spec.type_vocab_size:
            self.types = nn.Embedding.from_pretrained(w["embed.type.weight"].clone(), freeze=True)
        # Positions 0..L-1 are fixed by the shape: constant rows, not a gather.
        positions = None
        if spec.max_positions:
            if io.length > spec.max_positions:
                raise ValueError(f"length {io.length} exceeds {spec.max_positions} positions")
            positions = w["embed.position.weight"][: io.length].clone()
        self.register_buffer("positions", positions)
        self.norm = build_layer_norm(spec.norm, w, "embed.norm")

    def rows(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """The summed embedding rows (B, L, D) before the norm, in the checkpoint's order
        (word + type, then + position, as transformers adds them)."""
        x = self.word(input_ids)
        if self.types is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.types(types)
        if self.positions is not None:
            x = x + self.positions
        return x

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return self.norm(fold(self.rows(input_ids, token_type_ids)))


# An encoder layer is the shared block (post-norm for BERT, pre-norm for ModernBERT).
EncoderLayer = Block


class L2Normalize(nn.Module):
    """``x / max(||x||, eps)`` over channels (sentence-transformers' ``Normalize``), computed as
    ``x' * rsqrt(max(sum_c x'^2, eps^2 / a^2))`` with ``x' = x / a``, ``a`` a power of two.

    Why exact: ``1 / max(||x||, eps) = rsqrt(max(||x||^2, eps^2))`` and ``a`` cancels (the
    floor is scaled with it). In fp16 the floor ``eps^2 = 1e-24`` is not representable; a
    larger floor changes outputs only for ``||x|| < sqrt(floor) * a`` (recorded as a deviation).
    """

    inv_scale: torch.Tensor
    floor: torch.Tensor

    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps
        self.prescale = 1.0
        self.eps_floor = 0.0
        self.register_buffer("inv_scale", torch.tensor(1.0))
        self.register_buffer("floor", torch.tensor(eps * eps))

    @property
    def exact_floor(self) -> float:
        """``eps^2 / a^2`` before any storage floor."""
        return self.eps * self.eps / (self.prescale * self.prescale)

    def set_prescale(self, scale: float) -> None:
        """Divide by ``scale`` (a power of two) before squaring."""
        self.prescale = scale
        self.inv_scale.fill_(1.0 / scale)
        self.floor.fill_(max(self.exact_floor, self.eps_floor))

    def set_eps_floor(self, floor: float) -> None:
        """Store ``max(eps^2 / a^2, floor)`` (fp16 storage; see `layer_norm.FP16_EPS_FLOOR`)."""
        self.eps_floor = floor
        self.floor.fill_(max(self.exact_floor, floor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prescale != 1.0:
            x = x * self.inv_scale
        sum_square = (x * x).sum(dim=1, keepdim=True)
        return x * torch.rsqrt(torch.maximum(sum_square, self.floor))


def masked_mean(h: torch.Tensor, key_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Mean over each sample's real slots: (1, D, 1, B*L) -> (1, D, 1, B).

    ``sum_l h[l] * (w[l] / n)`` with ``w`` from `real_weights` and ``n = sum_l w[l]``: the same
    real value as transformers' and sentence-transformers' ``sum(h * w) / sum(w)``.
    """
    w = real_weights(key_mask)  # (B, L)
    share = (w / w.sum(dim=1, keepdim=True)).reshape(1, 1, batch, length)
    pooled = (h.reshape(1, -1, batch, length) * share).sum(dim=3)
    return pooled.unsqueeze(2)


class HiddenTail(nn.Module):
    """Feature extraction: the last hidden state, unfolded to (B, L, D)."""

    def __init__(self, io: EncoderIO) -> None:
        super().__init__()
        self.io = io

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return unfold(h, self.io.batch, self.io.length)


class SentenceEmbeddingTail(nn.Module):
    """Mean pooling over real tokens, then L2 normalisation (all-MiniLM-L6-v2's modules)."""

    def __init__(self, io: EncoderIO) -> None:
        super().__init__()
        self.io = io
        self.normalize = L2Normalize()

    def pooled(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """The masked mean (1, D, 1, B) before normalisation."""
        return masked_mean(h, key_mask, self.io.batch, self.io.length)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        out = self.normalize(self.pooled(h, key_mask))
        return out.reshape(-1, self.io.batch).transpose(0, 1)  # (B, D)


class ClassifierTail(nn.Module):
    """Pool (CLS slot or masked mean), dense, activation, optional norm, classifier."""

    def __init__(self, spec: ClassifierSpec, weights: dict[str, torch.Tensor], io: EncoderIO):
        super().__init__()
        self.io = io
        self.pooling = spec.pooling
        self.activation = spec.activation
        self.dense = conv1x1(weights["head.dense.weight"], weights.get("head.dense.bias"))
        self.norm: LayerNorm | None = None
        if spec.norm is not None:
            self.norm = build_layer_norm(spec.norm, weights, "head.norm")
        self.classifier = conv1x1(
            weights["head.classifier.weight"], weights.get("head.classifier.bias")
        )

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            # Right padding puts each sample's first token (CLS) in slot b*L: a static slice.
            pooled = h[:, :, :, :: self.io.length]
        else:
            pooled = masked_mean(h, key_mask, self.io.batch, self.io.length)
        x = self.dense(pooled)
        x = torch.tanh(x) if self.activation == "tanh" else nn.functional.gelu(x)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.classifier(x)  # (1, labels, 1, B)
        return logits.reshape(-1, self.io.batch).transpose(0, 1)


class BC1LEncoder(nn.Module):
    """A bidirectional encoder with a task tail, in folded BC1L layout."""

    def __init__(self, model: EncoderModel, io: EncoderIO) -> None:
        super().__init__()
        spec = model.spec
        self.spec: EncoderSpec = spec
        self.io = io
        w = model.weights
        self.embedding = EncoderEmbedding(model, io)
        positions = torch.arange(io.length).repeat(io.batch)  # slot b*L + l has position l
        for layer_spec in spec.layers:
            rule = layer_spec.attention.window_rule
            if layer_spec.attention.window is not None and rule != "symmetric-inclusive":
                raise ValueError(f"an encoder's local window is a symmetric band, got {rule!r}")
        self.layers = nn.ModuleList(
            Block(layer, w, i, positions) for i, layer in enumerate(spec.layers)
        )
        self.final_norm: LayerNorm | None = None
        if spec.final_norm is not None:
            self.final_norm = build_layer_norm(spec.final_norm, w, "final_norm")
        self.windows = sorted(
            {layer.attention.window for layer in spec.layers if layer.attention.window is not None}
        )
        # One structural mask per window (None = global); all zeros for a global B=1 program,
        # which `masks` then leaves out.
        for window in [None, *self.windows]:
            self.register_buffer(
                f"mask_{window or 'global'}", folded_band_mask(io.batch, io.length, window)
            )
        self.tail = self._build_tail(model)

    def _build_tail(self, model: EncoderModel) -> nn.Module:
        if self.io.output == "last-hidden-state":
            return HiddenTail(self.io)
        if self.io.output == "sentence-embedding":
            return SentenceEmbeddingTail(self.io)
        if model.spec.classifier is None:
            raise ValueError("output 'logits' needs a checkpoint with a classifier head")
        return ClassifierTail(model.spec.classifier, model.weights, self.io)

    def encoder_layers(self) -> list[Block]:
        """The transformer layers, typed."""
        return [cast(Block, layer) for layer in self.layers]

    def norms(self) -> list[tuple[str, LayerNorm]]:
        """Every LayerNorm with its stable name, in execution order."""
        named = [("embed.norm", self.embedding.norm)]
        for i, layer in enumerate(self.encoder_layers()):
            for name, norm in layer.norms(f"layers.{i}"):
                if not isinstance(norm, LayerNorm):
                    raise ValueError(f"{name}: encoder norms are LayerNorms")
                named.append((name, norm))
        if self.final_norm is not None:
            named.append(("final_norm", self.final_norm))
        if isinstance(self.tail, ClassifierTail) and self.tail.norm is not None:
            named.append(("head.norm", self.tail.norm))
        return named

    def set_eps_floor(self, floor: float) -> None:
        """Apply an epsilon storage floor to every norm (`FP16_EPS_FLOOR` for fp16 programs)."""
        for _, norm in self.norms():
            norm.set_eps_floor(floor)
        if isinstance(self.tail, SentenceEmbeddingTail):
            self.tail.normalize.set_eps_floor(floor)

    def masks(self, key_mask: torch.Tensor) -> dict[int | None, torch.Tensor]:
        """The additive (1, B*L, 1, B*L) mask of each window, key mask included (keys on axis 1)."""
        keys = key_mask.reshape(1, self.io.slots, 1, 1)
        out: dict[int | None, torch.Tensor] = {}
        for window in [None, *self.windows]:
            if window is None and self.io.batch == 1:
                out[window] = keys  # no structure to add: broadcast over queries
            else:
                out[window] = getattr(self, f"mask_{window or 'global'}") + keys
        return out

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """Token ids -> normalised, folded embeddings (1, D, 1, B*L)."""
        return self.embedding(input_ids, token_type_ids)

    def run_layers(self, h: torch.Tensor, key_mask: torch.Tensor) -> list[torch.Tensor]:
        """The folded residual stream after each layer, each (1, D, 1, B*L)."""
        masks = self.masks(key_mask)
        states = []
        for layer in self.encoder_layers():
            h = layer(h, masks[layer.window])
            states.append(h)
        return states

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm (pre-norm models) on the last layer's output."""
        return h if self.final_norm is None else self.final_norm(h)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """``(input_ids[, token_type_ids], key_mask)`` or ``(inputs_embeds, key_mask)``."""
        *x, key_mask = inputs
        if self.io.inputs == "embeddings":
            h = fold(x[0])
        else:
            h = self.embed(x[0], x[1] if len(x) > 1 else None)
        last = self.run_layers(h, key_mask)[-1]
        return cast(torch.Tensor, self.tail(self.finish(last), key_mask))
