"""Calibration-data passes over a decoder for the data-dependent methods (``gptq``, ``skm``).

Both read only the recipe's calibration text (``compression.calibration``), never the
held-out slice, and run the BC1L module in fp32 with its weights rounded to fp16 first (the
values the fp16 program holds), so what they compute starts from the program's weights.
Padded slots are left out: only each text's real positions reach a Hessian or a loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converter.compress.sites import WeightSite
from graph_passes.decoder import BC1LDecoder
from parity.fixtures import Fixture, make_batches
from parity.gates import module_inputs


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


def fp16_copy(module: BC1LDecoder) -> BC1LDecoder:
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


@contextlib.contextmanager
def captured_inputs(convs: dict[str, nn.Conv2d], starts: list[int], sink: Any) -> Iterator[None]:
    """While active, ``sink(name, inputs, outputs)`` gets each conv's real-position input and
    output on every forward call (inputs (1, C, 1, N))."""
    handles = []
    for name, conv in convs.items():

        def hook(_: Any, args: Any, out: Any, name: str = name) -> None:
            sink(name, real_columns(args[0].detach(), starts), real_columns(out.detach(), starts))

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
