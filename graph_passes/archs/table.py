"""Weight-mapping tables: canonical name <- checkpoint name template, expected shape, split.

An architecture file lists its tensors as `Row`s instead of hand-written loops (llama.cpp's
tensor-name tables are the model). `map_weights` reads a state dict through `WeightReader`,
so every tensor is mapped, deliberately skipped (`Skip`), or named in an error.

Templates: ``{p}`` is the checkpoint's base-model prefix (``""``, ``"model."``, ``"bert."``),
``{i}`` the layer index (a row with ``{i}`` is repeated per layer). Names have no ``.weight``
suffix: a row maps ``.weight``, and ``.bias`` too when its ``bias`` flag is set. Shapes are
tuples of dimension names resolved in a ``dims`` mapping (``"D"``, ``"V"``, ``"I"``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from graph_passes.archs.weights import WeightReader

# A flag is a config-derived bool, or a per-layer predicate (ModernBERT's identity norm).
Flag = bool | Callable[[int], bool]


@dataclass(frozen=True)
class Row:
    """One checkpoint tensor (and its bias) and the canonical name(s) it becomes.

    ``canonical`` of several names is a split rule: the source's rows (dim 0) are cut into
    that many equal parts, in order (ModernBERT's fused ``Wqkv`` into q, k and v).
    """

    canonical: str | tuple[str, ...]
    source: str
    shape: tuple[str, ...]
    bias: str | bool = False  # whether ``.bias`` exists too: always, never, or a flag's name
    when: str | None = None  # flag naming whether the row exists at all

    @property
    def targets(self) -> tuple[str, ...]:
        """The canonical names, one per split part."""
        return (self.canonical,) if isinstance(self.canonical, str) else self.canonical


@dataclass(frozen=True)
class Skip:
    """A checkpoint tensor left out on purpose (an index buffer, an unused pooler)."""

    source: str
    when: str | None = None


def _flag(flags: Mapping[str, Flag], name: str | bool | None, layer: int) -> bool:
    if name is None:
        return True
    if isinstance(name, bool):
        return name
    value = flags[name]
    return value(layer) if callable(value) else bool(value)


def _layers(template: str, num_layers: int) -> range:
    return range(num_layers) if "{i}" in template else range(1)


def map_weights(
    table: Sequence[Row | Skip],
    reader: WeightReader,
    *,
    dims: Mapping[str, int],
    flags: Mapping[str, Flag],
    num_layers: int,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Canonical weights for every row of ``table`` (fp32, read-only), checked against their
    shapes; skipped tensors are marked handled. Call ``reader.finish()`` afterwards."""
    weights: dict[str, torch.Tensor] = {}
    for row in table:
        for i in _layers(row.source, num_layers):
            if not _flag(flags, row.when, i):
                continue
            source = row.source.format(p=prefix, i=i)
            if isinstance(row, Skip):
                reader.skip(source)
                continue
            shape = tuple(dims[d] for d in row.shape)
            targets = [t.format(i=i) for t in row.targets]
            parts = [(".weight", shape)]
            if _flag(flags, row.bias, i):
                parts.append((".bias", shape[:1]))
            for suffix, part_shape in parts:
                tensor = reader.take(source + suffix, part_shape)
                if len(targets) == 1:
                    weights[targets[0] + suffix] = tensor
                    continue
                if part_shape[0] % len(targets):
                    raise ValueError(f"{source}: {part_shape[0]} rows do not split {targets}")
                chunks = tensor.split(part_shape[0] // len(targets))
                for target, chunk in zip(targets, chunks, strict=True):
                    weights[target + suffix] = chunk.clone()
    return weights
