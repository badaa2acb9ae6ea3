"""Calibration-data passes over a model for the data-dependent methods (``gptq``, ``skm``).

Both read only the recipe's calibration text (``compression.calibration``), never the
held-out slice, and run the BC1L module in fp32 with its weights rounded to fp16 first (the
values the fp16 program holds), so what they compute starts from the program's weights.
Padded slots are left out: only each text's real positions reach a Hessian or a loss.

`Stages` is what a layer-by-layer method (GPTQ) walks, for a decoder (`decoder_stages`: the
calibration texts as one left-padded batch) or an encoder (`encoder_stages`: the calibration
sentences in the program's own right-padded, folded (B, L) batches); ``skm`` reads the
decoder's next-token loss (`next_token_loss`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from converter.compression.sites import WeightSite
from graph_passes.decoder import BC1LDecoder
from graph_passes.encoder import BC1LEncoder
from parity.decoder_gates import module_inputs
from parity.fixtures import Fixture, make_batches

M = TypeVar("M", bound=nn.Module)
Columns = Callable[[torch.Tensor], torch.Tensor]  # an activation -> its real columns (1, C, 1, N)


@dataclass
class Calibration:
    """The calibration texts as one padded batch of the module's inputs."""

    x: torch.Tensor  # (B, L) ids or (B, L, D) embedding rows
    key_mask: torch.Tensor
    ids: torch.Tensor  # (B, L) token ids
    starts: list[int]  # first real slot of each row

    @property
    def positions(self) -> int:
        """Real positions over all rows."""
        return sum(self.ids.shape[1] - s for s in self.starts)


def calibration(
    module: BC1LDecoder, fixtures: list[Fixture], embed_table: torch.Tensor, pad_id: int
) -> Calibration:
    """``fixtures`` (the calibration slice) as one fp32 batch for ``module``."""
    if not fixtures:
        raise ValueError("compression.calibration: no calibration text for a calibrated method")
    length = module.io.length
    (batch,) = make_batches(fixtures, len(fixtures), length, pad_id)
    x, key_mask = module_inputs(module, batch, embed_table, torch.float32)
    starts = [length - len(f.token_ids) for f in batch.fixtures]
    return Calibration(x, key_mask, batch.input_ids, starts)


def fp16_copy(module: M) -> M:
    """A deep copy of ``module`` in fp32 with every parameter rounded through fp16."""
    work = copy.deepcopy(module).float().eval()
    with torch.no_grad():
        for p in work.parameters():
            p.copy_(p.half().float())
    return work


def owners(module: nn.Module, sites: list[WeightSite]) -> dict[str, nn.Conv2d]:
    """The 1x1 conv that owns each site's weight (``<owner>.weight``)."""
    modules = dict(module.named_modules())
    out = {}
    for site in sites:
        owner, _, leaf = site.name.rpartition(".")
        conv = modules.get(owner)
        if leaf != "weight" or not isinstance(conv, nn.Conv2d):
            raise TypeError(f"{site.name}: expected the weight of a 1x1 Conv2d, found {conv!r}")
        out[site.name] = conv
    return out


def real_columns(t: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """The real positions of a (B, C, 1, L) activation as one (1, C, 1, N) tensor."""
    return torch.cat([t[r : r + 1, :, :, s:] for r, s in enumerate(starts)], dim=3)


def captured_inputs(
    convs: dict[str, nn.Conv2d], starts: list[int], sink: Any
) -> contextlib.AbstractContextManager[None]:
    """`captured` for a decoder batch left-padded from ``starts``."""
    return captured(convs, lambda t: real_columns(t, starts), sink)


@contextlib.contextmanager
def captured(convs: dict[str, nn.Conv2d], columns: Columns, sink: Any) -> Iterator[None]:
    """While active, ``sink(name, inputs, outputs)`` gets each conv's input and output on every
    forward call, real columns only (``columns``: each (1, C, 1, N))."""
    handles = []
    for name, conv in convs.items():

        def hook(_: Any, args: Any, out: Any, name: str = name) -> None:
            sink(name, columns(args[0].detach()), columns(out.detach()))

        handles.append(conv.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def logits(module: BC1LDecoder, cal: Calibration) -> torch.Tensor:
    """Logits at every slot, (B, V, 1, L), fp32."""
    states = module.run_layers(cal.x, cal.key_mask)
    return torch.cat(module.head(states[-1]), dim=1)


def next_token_loss(module: BC1LDecoder, cal: Calibration) -> torch.Tensor:
    """Mean cross-entropy of each real position's next token (the calibration text itself)."""
    z = logits(module, cal)
    losses = []
    for r, s in enumerate(cal.starts):
        pred = z[r, :, 0, s:-1].T  # positions s..L-2 predict tokens s+1..L-1
        losses.append(nn.functional.cross_entropy(pred, cal.ids[r, s + 1 :], reduction="sum"))
    count = sum(cal.ids.shape[1] - s - 1 for s in cal.starts)
    return torch.stack(losses).sum() / max(count, 1)


@dataclass
class Stages:
    """A working copy of a model (`fp16_copy`) as stages run in order over its calibration
    batches, for methods that round layer by layer: stage ``i < layers`` is transformer layer
    ``i``, stage ``layers`` what follows them (a decoder's final norm and LM head, an
    encoder's final norm and task tail). ``run(i, h, b)`` is stage ``i`` on batch ``b``'s
    input ``h``; ``columns[b]`` picks batch ``b``'s real columns of an activation."""

    module: nn.Module
    inputs: list[torch.Tensor]  # the first layer's input, one per calibration batch
    layers: int
    run: Callable[[int, torch.Tensor, int], torch.Tensor]
    columns: list[Columns]

    def stage_of(self, name: str) -> int:
        """The stage holding parameter ``name`` (``layers.<i>.``: layer i; else the last)."""
        parts = name.split(".")
        if parts[0] == "layers" and parts[1].isdigit():
            return int(parts[1])
        return self.layers


def decoder_stages(
    module: BC1LDecoder, fixtures: list[Fixture], embed_table: torch.Tensor, pad_id: int
) -> Stages:
    """A decoder's stages on its calibration texts, one left-padded batch of them all."""
    work = fp16_copy(module)
    cal = calibration(work, fixtures, embed_table, pad_id)
    layers = work.decoder_layers()
    masks = work.layer_masks(cal.key_mask)

    def run(i: int, h: torch.Tensor, _: int) -> Any:
        if i == len(layers):
            return work.head(h)
        return layers[i](h, masks[i])

    with torch.no_grad():
        first = work.embed_bc1l(cal.x)
    return Stages(work, [first], len(layers), run, [lambda t: real_columns(t, cal.starts)])


def encoder_stages(module: BC1LEncoder, fixtures: list[Fixture], pad_id: int) -> Stages:
    """An encoder's stages on its calibration sentences, in the program's own (B, L) batches
    (right-padded, folded to (1, C, 1, B*L)), with the fp16 program's epsilon floors."""
    from graph_passes.layer_norm import FP16_EPS_FLOOR
    from parity.encoder_gates import encoder_inputs

    if not fixtures:
        raise ValueError("compression.calibration: no calibration text for a calibrated method")
    work = fp16_copy(module)
    work.set_eps_floor(FP16_EPS_FLOOR)
    io, layers = work.io, work.encoder_layers()
    firsts, masks, columns = [], [], list[Columns]()
    for batch in make_batches(fixtures, io.batch, io.length, pad_id, right=True):
        *x, key_mask = encoder_inputs(work, batch, torch.float32)
        with torch.no_grad():
            firsts.append(work.embed(x[0], x[1] if len(x) > 1 else None))
        masks.append((work.masks(key_mask), key_mask))
        real = batch.attention_mask.bool()
        real[len(batch.fixtures) :] = False  # rows filling the last batch repeat a sentence
        columns.append(functools.partial(folded_columns, real=real))

    def run(i: int, h: torch.Tensor, b: int) -> Any:
        by_window, key_mask = masks[b]
        if i == len(layers):
            return work.tail(work.finish(h), key_mask)
        return layers[i](h, by_window[layers[i].window])

    return Stages(work, firsts, len(layers), run, columns)


def folded_columns(t: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The real columns of an encoder activation: a folded (1, C, 1, B*L) one's real slots, or
    a pooled (1, C, 1, B) one's real sentences (``real``: (B, L), True at real tokens)."""
    if t.shape[-1] == real.numel():
        return t[..., real.reshape(-1)]
    if t.shape[-1] == real.shape[0]:
        return t[..., real.any(dim=1)]
    raise ValueError(f"an activation of {t.shape[-1]} columns in a batch of {tuple(real.shape)}")
