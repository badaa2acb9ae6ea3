"""Chunking a cached decoder across packages by a per-package weight budget.

A package that holds every layer of a larger draft decoder can exceed what one Core ML file
should carry on a device (about 1 GB on iOS, 2 GB on macOS: Anemll 0.3.5 chunks its packages
by size for that reason; ../shared/research/anchors_runtime.md). The recipe's
``cache.package_budget_mb`` sets the budget; `split_layers` splits the layers into
consecutive chunks whose stored weight bytes each stay within it:

* a layer's bytes are its parameters in the package's storage dtype;
* the chunk holding the last layer also holds the final norm and the LM head;
* the chunk holding layer 0 also holds the embedding table when the program gathers its own
  rows (``io.inputs: token-ids``); with host embeddings the table is a host file.

The split uses as few chunks as the budget allows, then balances them: among the splits with
that many chunks, the one whose largest chunk is smallest. One chunk when everything fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from converter.errors import InputError

MB = 1_000_000  # package_budget_mb counts decimal megabytes
FIELD = "cache.package_budget_mb"
# Defaults by platform: about 1 GB per package on iOS, 2 GB on macOS (Anemll's chunk sizes).
DEFAULT_BUDGET_MB = {"iOS": 1000, "macOS": 2000}
DTYPE_BYTES = {"float16": 2, "float32": 4}


@dataclass(frozen=True)
class WeightBytes:
    """Stored weight bytes of a decoder, by where they land in a chunked program."""

    layers: tuple[int, ...]  # per transformer layer
    head: int  # final norm + LM head: in the chunk holding the last layer
    embed: int  # the embedding table when the program holds it (else 0): in the first chunk

    @property
    def total(self) -> int:
        """Every stored weight byte."""
        return sum(self.layers) + self.head + self.embed


def weight_bytes(
    named: Iterable[tuple[str, int]], num_layers: int, dtype: str, embed_in_program: bool
) -> WeightBytes:
    """Bytes of ``named`` (parameter name, element count) in ``dtype``, under the BC1L /
    canonical names: ``layers.<i>.*``, ``embed.*``, ``final_norm.*``, ``lm_head*``. A name
    outside them is an error (it would be left out of every chunk's count)."""
    per = DTYPE_BYTES[dtype]
    layers = [0] * num_layers
    head = embed = 0
    for name, count in named:
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += count * per
        elif name.startswith(("final_norm.", "lm_head")):
            head += count * per
        elif name.startswith("embed."):
            embed += count * per if embed_in_program else 0
        else:
            raise ValueError(f"weight {name}: not a layer, head or embedding weight")
    return WeightBytes(tuple(layers), head, embed)


@dataclass(frozen=True)
class Chunk:
    """One package of a chunked decoder: layers [start, stop) and its stored weight bytes."""

    index: int
    start: int
    stop: int
    weight_bytes: int
    first: bool
    last: bool

    @property
    def layers(self) -> tuple[int, int]:
        """(start, stop)."""
        return (self.start, self.stop)


def budget_bytes(budget_mb: float | None, platform: str) -> int:
    """The per-package budget in bytes: the recipe's, or the platform's default."""
    mb = DEFAULT_BUDGET_MB[platform] if budget_mb is None else budget_mb
    return int(mb * MB)


def _chunk_bytes(w: WeightBytes, start: int, stop: int) -> int:
    n = len(w.layers)
    return sum(w.layers[start:stop]) + (w.embed if start == 0 else 0) + (w.head if stop == n else 0)


def _greedy(w: WeightBytes, capacity: int) -> list[tuple[int, int]] | None:
    """Fill chunks from the last layer backwards, each as full as ``capacity`` allows; None
    when a single layer (with the end's extras) does not fit."""
    ranges: list[tuple[int, int]] = []
    stop = len(w.layers)
    while stop > 0:
        start = stop
        while start > 0 and _chunk_bytes(w, start - 1, stop) <= capacity:
            start -= 1
        if start == stop:
            return None
        ranges.append((start, stop))
        stop = start
    return ranges[::-1]


def _too_big(w: WeightBytes, budget: int, dtype: str) -> str | None:
    """What alone exceeds the budget, named, or None."""
    n = len(w.layers)
    limit = f"{FIELD} ({budget:,} bytes)"
    if w.head > budget:
        return f"the LM head and final norm: {w.head:,} bytes ({dtype}) exceed {limit}"
    for i, b in enumerate(w.layers):
        alone = _chunk_bytes(w, i, i + 1)
        if alone > budget:
            parts = [f"layer {i}: {b:,} bytes ({dtype})"]
            if i == 0 and w.embed:
                parts.append(f"with the embedding table {w.embed:,} (inside the program)")
            if i == n - 1:
                parts.append(f"with the LM head and final norm {w.head:,}")
            return f"{', '.join(parts)}: {alone:,} bytes exceed {limit}"
    return None


def split_layers(w: WeightBytes, budget: int, dtype: str = "float16") -> list[Chunk]:
    """Consecutive chunks of the layers, each within ``budget`` stored bytes (see the module
    docstring); InputError naming the field, the layer (or the head), its bytes and the budget
    when one of them alone does not fit."""
    if budget <= 0:
        raise InputError(f"{FIELD}: expected a positive budget, got {budget} bytes")
    if not w.layers:
        raise ValueError("a decoder without layers cannot be chunked")
    problem = _too_big(w, budget, dtype)
    ranges = _greedy(w, budget)
    if problem is not None or ranges is None:
        raise InputError(problem or f"{FIELD}: no split fits {budget:,} bytes")
    # Balance: the smallest capacity that still needs no more chunks than the budget did.
    low, high = max(_chunk_bytes(w, i, i + 1) for i in range(len(w.layers))), budget
    while low < high:
        mid = (low + high) // 2
        found = _greedy(w, mid)
        if found is not None and len(found) <= len(ranges):
            high = mid
        else:
            low = mid + 1
    best = _greedy(w, high)
    assert best is not None and len(best) == len(ranges)
    n = len(w.layers)
    return [Chunk(i, a, b, _chunk_bytes(w, a, b), a == 0, b == n) for i, (a, b) in enumerate(best)]
