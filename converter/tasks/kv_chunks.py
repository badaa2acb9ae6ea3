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

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.coreml.program import DType, TensorIO
from converter.errors import InputError
from converter.pipeline.manifest import Manifest
from converter.tasks.kv_contract import DEFAULT_FUNCTION, function_contract, kv_manifest_section
from graph_passes.cached_decoder import HIDDEN_IN, HIDDEN_OUT, CachedDecoder
from parity.kv_session import ChunkMeta

FIELD = "cache.package_budget_mb"
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


def package_file(name: str, chunk: Chunk, count: int) -> str:
    """The package file of ``chunk``: ``<name>.mlpackage`` for one chunk (as without a
    budget), ``<name>.chunk<i>.mlpackage`` for each of several."""
    return f"{name}.mlpackage" if count == 1 else f"{name}.chunk{chunk.index}.mlpackage"


def chunk_meta(module: CachedDecoder) -> ChunkMeta:
    """What the chained host loop needs to call the chunk ``module`` belongs to."""
    tokens = {"input_ids", "inputs_embeds"} if module.first else set()
    return ChunkMeta(
        module.start,
        module.stop,
        module.spec.num_layers,
        frozenset(tokens | set(module.input_names())),
        module.cache_shape(),
    )


def _tensors(items: list[TensorIO]) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "meaning": t.meaning}
        for t in items
    ]


def chunking_section(split: list[Chunk], budget: int, files: list[str]) -> dict[str, Any]:
    """The manifest's ``kv_cache.chunking``: the budget and how many packages it gave (one:
    the package holds every layer, as without a budget)."""
    return {
        "package_budget_bytes": budget,
        "chunks": len(split),
        "call_order": files,
        "weight_bytes": [c.weight_bytes for c in split],
        "meaning": "stored weight bytes per package (parameters in the storage dtype; the "
        "LM head and final norm in the last chunk, an in-program embedding table in the "
        "first) stay within package_budget_bytes",
    }


def chunk_entries(
    split: list[Chunk],
    chunks: list[dict[str, CachedDecoder]],
    contracts: list[dict[str, tuple[list[TensorIO], list[TensorIO]]]],
    sizes: list[dict[str, Any]],
    files: list[str],
) -> list[dict[str, Any]]:
    """The manifest's ``kv_cache.chunks``, in call order: each chunk's package, layers,
    cache, functions' tensors and the tensor it passes to the next chunk."""
    entries = []
    for chunk, functions, contract, size, file in zip(
        split, chunks, contracts, sizes, files, strict=True
    ):
        module = functions[next(iter(functions))]
        n = module.spec.num_layers
        passes = None
        if not chunk.last:
            per = {}
            for name, (_, outputs) in contract.items():
                (hidden,) = [t for t in outputs if t.name == HIDDEN_OUT]
                per[name] = {
                    "shape": list(hidden.shape),
                    "bytes": math.prod(hidden.shape) * DTYPE_BYTES[hidden.dtype],
                }
            passes = {
                "to_chunk": chunk.index + 1,
                "output": HIDDEN_OUT,
                "input": HIDDEN_IN,
                "dtype": contract["decode"][1][0].dtype,
                "per_call": per,
                "meaning": "the residual stream (times the manifest's stream scale) after "
                f"layer {chunk.stop - 1}, every slot, [0, channel, 0, slot]",
            }
        entries.append(
            {
                "index": chunk.index,
                "package": file,
                "layers": [chunk.start, chunk.stop],
                "weight_bytes": chunk.weight_bytes,
                "reads": "the tokens"
                if chunk.first
                else f"{HIDDEN_IN} from chunk {chunk.index - 1}",
                "returns": "the LM-head outputs" if chunk.last else f"{HIDDEN_OUT}",
                "cache": {
                    "shape": list(module.cache_shape()),
                    "dtype": "float16",
                    "rows_in_one_package_layout": {
                        "keys": [chunk.start, chunk.stop],
                        "values": [n + chunk.start, n + chunk.stop],
                    },
                    "kind": "its own Core ML state (one make_state() per chunk)"
                    if module.io.style == "state"
                    else "its own host array, passed as kv_cache_in; new_kv holds its rows",
                },
                "functions": {
                    name: {"inputs": _tensors(ins), "outputs": _tensors(outs)}
                    for name, (ins, outs) in contract.items()
                },
                "passes_to_next": passes,
                "sizes": size,
            }
        )
    return entries


def chunked_manifest(
    doc: Manifest,
    split: list[Chunk],
    chunks: list[dict[str, CachedDecoder]],
    programs: list[Any],
    sizes: list[dict[str, Any]],
    whole: dict[str, CachedDecoder],
    dtype: DType,
    rope: dict[str, Any],
) -> None:
    """Fill ``doc`` for a chunked decoder: ``kv_cache`` describes a call as a whole (the
    functions over every layer, the cache in the one-package layout) and lists the chunks
    in call order; ``package`` is chunk 0, ``extra_packages`` the others, ``pieces`` all."""
    from converter.pipeline.manifest import PieceEntry, TensorEntry
    from converter.pipeline.manifest_fields import package_entry

    calls = {name: function_contract(m, dtype) for name, m in whole.items()}
    totals = {
        "per_chunk": "kv_cache.chunks[i].sizes",
        "package_bytes": sum(s["multifunction_package_bytes"] for s in sizes),
        "weight_bytes": sum(s["multifunction_weight_bytes"] for s in sizes),
    }
    doc.kv_cache = kv_manifest_section(whole, calls, totals, rope)
    doc.kv_cache["cache"]["kind"] = (
        "one cache per chunk (kv_cache.chunks[i].cache); this shape is the one-package layout "
        "their rows map into (chunks[i].cache.rows_in_one_package_layout)"
    )
    files = [p.path.name for p in programs]
    contracts = [{name: function_contract(m, dtype) for name, m in c.items()} for c in chunks]
    doc.kv_cache["chunks"] = chunk_entries(split, chunks, contracts, sizes, files)

    def entry(t: TensorIO) -> TensorEntry:
        return TensorEntry(name=t.name, shape=list(t.shape), dtype=t.dtype, meaning=t.meaning)

    doc.inputs = [entry(t) for t in calls[DEFAULT_FUNCTION][0]]
    doc.outputs = [entry(t) for t in calls[DEFAULT_FUNCTION][1]]
    extra = [package_entry(p.path, p.ops) for p in programs[1:]]
    for e in extra:
        e.function = DEFAULT_FUNCTION
    doc.extra_packages = extra
    doc.pieces = [
        PieceEntry(
            name=f"chunk{c.index}",
            runs_on="neural-engine",
            files=[file],
            inputs=[t.name for t in contract[DEFAULT_FUNCTION][0]],
            outputs=[t.name for t in contract[DEFAULT_FUNCTION][1]],
            meaning=f"layers {c.start}..{c.stop - 1} of a chunked cached decoder (kv_cache.chunks)",
        )
        for c, file, contract in zip(split, files, contracts, strict=True)
    ]


def plan_chunks(programs: list[Any], directory: Path, platform: str, gates: Any) -> list[str]:
    """Each chunk's static plan (its decode function, as for one package) with the recipe's
    plan gates, written as ``plan.chunk<i>.json`` / ``.txt``; the failed gates' lines."""
    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.placement.artifact_gate import plan_artifact

    failures: list[str] = []
    for i, program in enumerate(programs):
        scratch = directory / f".plan-chunk{i}"
        scratch.mkdir()
        result = plan_artifact(
            program.plan_table,
            program.path,
            mlpackage_content_hash(program.path),
            platform,
            gates.plan_min_ne_flop_share,
            gates.plan_max_ne_segments,
            scratch,
        )
        for f in sorted(scratch.iterdir()):
            f.rename(directory / f"{f.stem}.chunk{i}{f.suffix}")
        scratch.rmdir()
        failures += [f"chunk {i}: {line}" for line in result.failures()]
    return failures
