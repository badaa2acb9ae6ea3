"""The boundary partition of an encoder (SPEC section 2): host embedding | NE island | tail.

* **host embedding** - what the runtime does on the CPU: gather the token rows (the tables are
  shipped in fp16), add position and type rows, apply the embedding LayerNorm in fp32 with the
  original epsilon, hand fp16 rows to the island. Where the norm reads the token row alone
  (ModernBERT) the table may be normalised offline instead (``prenormalized``): the same real
  arithmetic, different rounding, checked by its own parity run. Not where the norm reads word +
  position + type rows (BERT): a sum of rows cannot be normalised row by row.
* **island** - one program with every transformer layer and the final norm (nothing per layer
  crosses an engine boundary).
* **tail** - pooling, selection, heads: a second small program (feature extraction has none:
  the island returns the last hidden state).

`HostEmbedding` is the executable description of the host step; the runtime reimplements it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graph_passes.encoder import BC1LEncoder, fold
from graph_passes.spec import EncoderModel

# The island program's output and the tail's input: the folded last hidden state.
ISLAND_OUTPUT = "hidden"


@dataclass
class HostEmbedding:
    """The host-side embedding step and the tables it ships, in the island's input dtype
    (fp16 for an fp16 program, fp32 for an fp32 one: what ships is what the gates run)."""

    word: torch.Tensor  # (V, D); normalised rows when ``prenormalized``
    position: torch.Tensor | None  # (L, D): the rows of positions 0..L-1
    types: torch.Tensor | None  # (T, D)
    norm_weight: torch.Tensor | None  # (D,) fp32, None when prenormalized
    norm_bias: torch.Tensor | None
    eps: float
    prenormalized: bool

    def __call__(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """(B, L) ids -> (B, L, D) normalised embedding rows in the tables' dtype, as the
        runtime computes them."""
        x = self.word[input_ids].float()
        if self.prenormalized:
            return x.to(self.word.dtype)
        if self.types is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.types[types].float()
        if self.position is not None:
            x = x + self.position.float()
        # fp32 on the host: BERT's epsilon 1e-12 is kept exactly here (unlike in fp16).
        assert self.norm_weight is not None
        y = nn.functional.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, self.eps)
        return y.to(self.word.dtype)


def host_embedding(
    model: EncoderModel, length: int, prenormalize: bool, dtype: torch.dtype = torch.float16
) -> HostEmbedding:
    """The host step for ``model`` with tables in ``dtype``; ``prenormalize`` only where the
    norm reads the token row alone (raises ValueError otherwise)."""
    spec, w = model.spec.embedding, model.weights
    if prenormalize and not spec.norm_reads_token_row_alone:
        raise ValueError(
            "prenormalize_embeddings: the embedding norm reads word + position + type rows; "
            "it cannot be applied to the token table alone"
        )
    weight = w["embed.norm.weight"]
    bias = w.get("embed.norm.bias")
    word = w["embed.word.weight"]
    if prenormalize:
        # LayerNorm of each row in fp64, rounded once to dtype: the same real arithmetic as
        # normalising the gathered row, with one rounding instead of two.
        word64 = word.double()
        word = nn.functional.layer_norm(
            word64,
            (word64.shape[-1],),
            weight.double(),
            None if bias is None else bias.double(),
            spec.norm.eps,
        )
    return HostEmbedding(
        word=word.to(dtype),
        position=w["embed.position.weight"][:length].to(dtype) if spec.max_positions else None,
        types=w["embed.type.weight"].to(dtype) if spec.type_vocab_size else None,
        norm_weight=None if prenormalize else weight.float(),
        norm_bias=None if prenormalize or bias is None else bias.float(),
        eps=spec.norm.eps,
        prenormalized=prenormalize,
    )


class Island(nn.Module):
    """Every transformer layer and the final norm: (B, L, D) rows, key mask -> the folded last
    hidden state (1, D, 1, B*L), or (B, L, D) for feature extraction (no tail)."""

    def __init__(self, encoder: BC1LEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.returns_task_output = encoder.io.output == "last-hidden-state"

    def forward(self, inputs_embeds: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder.finish(self.encoder.run_layers(fold(inputs_embeds), key_mask)[-1])
        if self.returns_task_output:
            return self.encoder.tail(h, key_mask)
        return h


class Tail(nn.Module):
    """Pooling / selection / heads on the island's folded hidden state."""

    def __init__(self, encoder: BC1LEncoder) -> None:
        super().__init__()
        self.tail = encoder.tail

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.tail(hidden, key_mask)


def prenormalized_table_check(
    model: EncoderModel, host: HostEmbedding, chunk: int = 8192
) -> dict[str, float]:
    """The pre-normalised table's own parity check, over every row of the vocabulary.

    Against the exact norm of each fp32 row (fp64), the largest absolute error of the shipped
    pre-normalised fp16 row and of what the host would compute without it (fp32 norm of the
    fp16 row, rounded to fp16). Both are rounding-level; the partitioned parity run gates the
    effect on the model's output.
    """
    w = model.weights
    weight, bias = w["embed.norm.weight"].double(), w.get("embed.norm.bias")
    bias64 = None if bias is None else bias.double()
    eps = model.spec.embedding.norm.eps
    worst_pre = worst_host = 0.0
    table = w["embed.word.weight"]
    for start in range(0, table.shape[0], chunk):
        rows = table[start : start + chunk]
        d = rows.shape[-1]
        exact = nn.functional.layer_norm(rows.double(), (d,), weight, bias64, eps)
        shipped = host.word[start : start + chunk].double()
        on_host = nn.functional.layer_norm(
            rows.half().float(),
            (d,),
            weight.float(),
            None if bias64 is None else bias64.float(),
            eps,
        )
        worst_pre = max(worst_pre, float((shipped - exact).abs().max()))
        worst_host = max(worst_host, float((on_host.half().double() - exact).abs().max()))
    return {
        "rows": float(table.shape[0]),
        "max_abs_error_prenormalized_fp16": worst_pre,
        "max_abs_error_host_norm_of_fp16_rows": worst_host,
    }
