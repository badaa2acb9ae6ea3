"""The references every decoder is gated against: the original transformers model, run on each
fixture without padding (`run_reference`); for a cached decoder, greedy continuations of the
fixtures by that model and its full recompute of every position in fp32 (`continuation`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch
from torch import nn

from parity.fixtures import Fixture


@dataclass(frozen=True)
class ReferenceRun:
    """Per-layer hidden states (n, D) and logits (n, V) of one fixture, in fp32."""

    hidden: list[torch.Tensor]
    logits: torch.Tensor


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer layers of a transformers ``*ForCausalLM``."""
    return model.model.layers  # type: ignore[union-attr,return-value]


@contextlib.contextmanager
def layer_states(layers: Iterable[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """While active, the yielded list receives each of the transformer ``layers``' output
    (n, D) of the one (unpadded) sequence the model runs (decoders, encoders, decision
    models' encoders)."""
    hidden: list[torch.Tensor] = []

    def keep(_: nn.Module, __: object, out: object) -> None:
        tensor = out[0] if isinstance(out, tuple) else out
        hidden.append(tensor[0].detach().clone())  # type: ignore[index]

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()


def restrict_head(model: nn.Module, ids: torch.Tensor) -> None:
    """Give a transformers ``*ForCausalLM`` an LM head of the rows ``ids`` only, so its
    logits are the checkpoint's restricted to those ids (a trimmed draft's reference: each
    row is its own dot product, so the kept logits are unchanged). The input embeddings stay
    whole: inputs still range over the whole vocabulary."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    trimmed = nn.Linear(head.in_features, len(ids), bias=head.bias is not None)
    with torch.no_grad():
        trimmed.weight.copy_(head.weight[ids])
        if head.bias is not None:
            trimmed.bias.copy_(head.bias[ids])
    model.set_output_embeddings(trimmed)  # type: ignore[operator]
    model.config.tie_word_embeddings = False  # type: ignore[union-attr]


def run_reference(model: nn.Module, token_ids: tuple[int, ...]) -> ReferenceRun:
    """Run the unpadded sequence at positions 0..n-1, as the checkpoint itself would."""
    with layer_states(decoder_layers(model)) as hidden, torch.no_grad():
        ids = torch.tensor([token_ids], dtype=torch.int64)
        logits = model(input_ids=ids, use_cache=False).logits[0]
    return ReferenceRun(hidden=hidden, logits=logits.detach().float())


class SpilledRows:
    """fp32 rows of one width kept in an unnamed temporary file, read back one at a time.

    A cached decoder's reference holds every decoded position's full-vocabulary logits, from
    the reference step to the cache parity: 3 prompts x 513 positions x 262,144 fp32 values
    for Gemma 3's recipe. Read back row by row, they stay out of the process's memory (the
    page cache is not counted against it). The file has no name and goes with this object.
    """

    def __init__(self, width: int | None = None) -> None:
        self.width = width  # set by the first row when not given
        self._rows = 0
        # Unbuffered: a row is in the file once written, for `os.pread` to read back.
        self._file: IO[bytes] = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 - lives with self

    @classmethod
    def of(cls, rows: np.ndarray) -> SpilledRows:
        """The rows of a (positions, width) array."""
        if rows.ndim != 2:
            raise ValueError(f"logit rows must be 2-D (positions, vocabulary), not {rows.shape}")
        spilled = cls(int(rows.shape[1]))
        spilled._write(rows)
        return spilled

    def append(self, row: np.ndarray) -> None:
        """Add one row (any float dtype; fp16 and fp32 values are kept exactly)."""
        if self.width is None and row.ndim == 1:
            self.width = int(row.shape[0])
        if row.shape != (self.width,):
            raise ValueError(f"a logit row of width {self.width}, not shape {row.shape}")
        self._write(row[None])

    def _write(self, rows: np.ndarray) -> None:
        np.ascontiguousarray(rows, dtype=np.float32).tofile(self._file)
        self._rows += len(rows)

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, row: int) -> np.ndarray:
        """Row ``row`` (negative counts from the end), read-only fp32."""
        n, size = self._rows, (self.width or 0) * 4
        if not -n <= row < n:
            raise IndexError(f"row {row} of {n} logit rows")
        data = os.pread(self._file.fileno(), size, (row % n) * size)
        if len(data) != size:
            raise OSError(f"logit rows: row {row} read {len(data)} of {size} bytes")
        return np.frombuffer(data, dtype=np.float32)


@dataclass(frozen=True)
class Continuation:
    """A fixture's prompt, its greedy continuation, and the reference logits."""

    name: str
    prompt: tuple[int, ...]
    ids: tuple[int, ...]  # prompt + continuation
    # (len(ids) - len(prompt) + 1, V) fp32: the full-recompute logits at positions
    # len(prompt) - 1 .. len(ids) - 1 (each predicts the next token); rows read by index.
    logits: np.ndarray | SpilledRows

    def reference(self, position: int) -> np.ndarray:
        """The reference logits (V,) at ``position`` (>= len(prompt) - 1)."""
        return self.logits[position - (len(self.prompt) - 1)]


# transformers' top-1 minus top-2 logit below this is a near tie: past it, fp16 arithmetic
# (or any other valid order of additions) may pick either token (issue 22).
NEAR_TIE = 0.05


@torch.no_grad()
def greedy_steps(
    model: nn.Module,
    prompt: tuple[int, ...],
    steps: int,
    head_ids: torch.Tensor | None = None,
) -> list[tuple[int, float]]:
    """``steps`` greedy tokens after ``prompt`` by the original model with transformers' own
    KV cache, each with its top-1 minus top-2 logit gap (the gates compare against a full
    recompute of the whole sequence afterwards; which tokens are fed only has to be the same
    for both). ``head_ids``: the model's head is trimmed (`restrict_head`), its row j scores
    token ``head_ids[j]``."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    chosen: list[tuple[int, float]] = []
    for _ in range(steps):
        top2 = out.logits[0, -1].float().topk(2)
        row = int(top2.indices[0])
        token = row if head_ids is None else int(head_ids[row])
        chosen.append((token, float(top2.values[0] - top2.values[1])))
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return chosen


def greedy_ids(
    model: nn.Module,
    prompt: tuple[int, ...],
    steps: int,
    head_ids: torch.Tensor | None = None,
) -> list[int]:
    """``greedy_steps``' tokens alone."""
    return [token for token, _ in greedy_steps(model, prompt, steps, head_ids)]


@dataclass(frozen=True)
class GreedyCheck:
    """A greedy continuation against the reference's, step by step."""

    steps: int
    matched: int  # steps equal before the first difference
    first_near_tie: int | None  # the first step whose reference gap is below NEAR_TIE

    @property
    def passed(self) -> bool:
        """Every step before the first near tie matched (every step, without one)."""
        return self.matched >= (self.steps if self.first_near_tie is None else self.first_near_tie)


def check_greedy(new_ids: list[int], reference: list[tuple[int, float]]) -> GreedyCheck:
    """``new_ids`` against ``greedy_steps``' output of the same length."""
    if len(new_ids) != len(reference):
        raise ValueError(f"{len(new_ids)} generated steps against {len(reference)} reference")
    pairs = zip(new_ids, reference, strict=True)
    matched = next((i for i, (a, (b, _)) in enumerate(pairs) if a != b), len(reference))
    near = next((i for i, (_, gap) in enumerate(reference) if gap < NEAR_TIE), None)
    return GreedyCheck(len(reference), matched, near)


@torch.no_grad()
def continuation(
    model: nn.Module, fixture: Fixture, steps: int, head_ids: torch.Tensor | None = None
) -> Continuation:
    """The fixture's greedy continuation of ``steps`` tokens and the reference logits
    (``head_ids``: of a trimmed head, `greedy_steps`)."""
    prompt = tuple(fixture.token_ids)
    ids = prompt + tuple(greedy_ids(model, prompt, steps, head_ids))
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    kept = SpilledRows.of(logits[len(prompt) - 1 :].float().numpy())
    return Continuation(fixture.name, prompt, ids, kept)


def originals(fixtures: list[Fixture]) -> list[Fixture]:
    """The fixtures as given (not their full-window variants)."""
    return [f for f in fixtures if "/" not in f.name]
