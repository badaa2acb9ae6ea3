"""A chunked cached decoder run as one: a `FunctionRunner` that calls its chunks in order.

A decoder split by ``cache.package_budget_mb`` (`converter.tasks.kv_chunks`) is one package
per chunk of consecutive layers, each with its own cache (state or io). One call of a
function (prefill, decode, extend) runs chunk 0 .. n-1 in order with the same host inputs
(RoPE rows, masks, ``cache_valid``, ``write_slots``; each chunk takes the ones its layers
read): chunk 0 reads the tokens, each later chunk the ``hidden_out`` its predecessor
returned, and the last returns the LM-head outputs. So `CacheSession`, the cache gates,
``anec generate`` and ``anec speculate`` run a chunked artifact with their logic unchanged.

The ``io`` style: the session keeps one host cache in the one-package layout (2N, KV, S, d);
chunk [a, b) is given its own (2(b - a), KV, S, d) cache - rows a..b-1 (keys) and N+a..N+b-1
(values) - and its ``new_kv`` rows are put back at those rows. A runtime may as well keep one
cache per chunk; the manifest states both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from graph_passes.cached_decoder import HIDDEN_IN, HIDDEN_OUT
from parity.kv_session import CallObserver, FunctionRunner, MilFunctions


@dataclass(frozen=True)
class ChunkMeta:
    """What the host needs to call one chunk: its layers [start, stop) of ``layers``, the
    input names its functions take and its cache's shape."""

    start: int
    stop: int
    layers: int  # N: every layer of the model
    inputs: frozenset[str]
    cache_shape: tuple[int, ...]

    @property
    def first(self) -> bool:
        """Reads the tokens."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Returns the LM-head outputs."""
        return self.stop == self.layers

    def cache_rows(self) -> list[int]:
        """The rows of the one-package cache layout this chunk's cache holds, in order."""
        keys = list(range(self.start, self.stop))
        return keys + [self.layers + i for i in keys]


def handoff(fed: dict[str, np.ndarray], returned: dict[str, np.ndarray]) -> np.ndarray:
    """What the next chunk reads as ``hidden_in``: the stream this chunk returned."""
    return returned[HIDDEN_OUT]


def chain_runner(chunks: Sequence[ChunkMeta], runners: Sequence[FunctionRunner]) -> FunctionRunner:
    """One runner over every chunk, in call order (see the module docstring)."""
    if not chunks or not chunks[0].first or not chunks[-1].last:
        raise ValueError("a chain runs chunks from layer 0 to the last layer")
    for a, b in zip(chunks, chunks[1:], strict=False):
        if a.stop != b.start:
            raise ValueError(f"chunks [{a.start}, {a.stop}) and [{b.start}, {b.stop}) do not meet")

    def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        hidden: np.ndarray | None = None
        whole = inputs.get("kv_cache_in")
        rows: list[tuple[ChunkMeta, np.ndarray]] = []
        out: dict[str, np.ndarray] = {}
        for chunk, runner in zip(chunks, runners, strict=True):
            feed = {k: v for k, v in inputs.items() if k in chunk.inputs}
            if not chunk.first:
                assert hidden is not None
                feed[HIDDEN_IN] = hidden
            if whole is not None:
                feed["kv_cache_in"] = whole[chunk.cache_rows()]
            returned = runner(function, feed)
            if "new_kv" in returned:
                rows.append((chunk, returned["new_kv"]))
            if chunk.last:
                out = {k: v for k, v in returned.items() if k != "new_kv"}
            else:
                hidden = handoff(feed, returned)
        if rows:
            n = chunks[0].layers
            first = rows[0][1]
            new = np.zeros((2 * n, *first.shape[1:]), dtype=first.dtype)
            for chunk, r in rows:
                new[chunk.cache_rows()] = r
            out["new_kv"] = new
        return out

    return run


class ChainStates(Mapping[str, np.ndarray]):
    """Every chunk's state values, keyed ``chunk<i>.<state>``, read through to the dicts the
    chunks' runners hold (a run replaces a state's array, so a copy would go stale)."""

    def __init__(self, parts: Sequence[dict[str, np.ndarray]]) -> None:
        self.parts = list(parts)

    def _split(self, key: str) -> tuple[int, str]:
        head, _, name = key.partition(".")
        return int(head.removeprefix("chunk")), name

    def __getitem__(self, key: str) -> np.ndarray:
        i, name = self._split(key)
        return self.parts[i][name]

    def __iter__(self) -> Iterator[str]:
        return iter([f"chunk{i}.{name}" for i, part in enumerate(self.parts) for name in part])

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


class MilChain:
    """The chunks' packages prepared once in the MIL evaluator under one profile;
    `session` gives a chained runner with fresh (zero) states, as `MilFunctions` does."""

    def __init__(
        self,
        programs: Sequence[object],
        profile: str,
        functions: list[str],
        chunks: Sequence[ChunkMeta],
        chunk_sizes: list[int] | None = None,
        observers: Sequence[CallObserver | None] | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.parts = [
            MilFunctions(
                p, profile, functions, c.cache_shape, chunk_sizes if c.last else None, observer
            )
            for p, c, observer in zip(
                programs, chunks, observers or [None] * len(chunks), strict=True
            )
        ]
        self.check = self.parts[-1].check  # the LM head's choice outputs are the last chunk's

    def session(self) -> tuple[FunctionRunner, ChainStates]:
        """A chained runner and every chunk's state values (`ChainStates`; empty for the
        ``io`` style)."""
        runners: list[FunctionRunner] = []
        held: list[dict[str, np.ndarray]] = []
        for part in self.parts:
            runner, states = part.session()
            runners.append(runner)
            held.append(states)
        return chain_runner(self.chunks, runners), ChainStates(held)
