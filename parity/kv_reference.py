"""The reference a cached decoder is gated against: greedy continuations of the fixtures by
the original model, and that model's full recompute of every position in fp32."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from parity.fixtures import Fixture


@dataclass(frozen=True)
class Continuation:
    """A fixture's prompt, its greedy continuation, and the reference logits."""

    name: str
    prompt: tuple[int, ...]
    ids: tuple[int, ...]  # prompt + continuation
    # (len(ids) - len(prompt) + 1, V) fp32: the full-recompute logits at positions
    # len(prompt) - 1 .. len(ids) - 1 (each predicts the next token).
    logits: np.ndarray

    def reference(self, position: int) -> np.ndarray:
        """The reference logits (V,) at ``position`` (>= len(prompt) - 1)."""
        return self.logits[position - (len(self.prompt) - 1)]


@torch.no_grad()
def greedy_ids(model: nn.Module, prompt: tuple[int, ...], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` by the original model with transformers' own
    KV cache (the gates compare against a full recompute of the whole sequence afterwards;
    which tokens are fed only has to be the same for both)."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    chosen: list[int] = []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        chosen.append(token)
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return chosen


@torch.no_grad()
def continuation(model: nn.Module, fixture: Fixture, steps: int) -> Continuation:
    """The fixture's greedy continuation of ``steps`` tokens and the reference logits."""
    prompt = tuple(fixture.token_ids)
    ids = prompt + tuple(greedy_ids(model, prompt, steps))
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    kept = logits[len(prompt) - 1 :].float().numpy().copy()
    return Continuation(fixture.name, prompt, ids, kept)


def originals(fixtures: list[Fixture]) -> list[Fixture]:
    """The fixtures as given (not their full-window variants)."""
    return [f for f in fixtures if "/" not in f.name]
