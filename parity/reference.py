"""The reference: the original transformers model, run on each fixture without padding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


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


def run_reference(model: nn.Module, token_ids: tuple[int, ...]) -> ReferenceRun:
    """Run the unpadded sequence at positions 0..n-1, as the checkpoint itself would."""
    with layer_states(decoder_layers(model)) as hidden, torch.no_grad():
        ids = torch.tensor([token_ids], dtype=torch.int64)
        logits = model(input_ids=ids, use_cache=False).logits[0]
    return ReferenceRun(hidden=hidden, logits=logits.detach().float())
