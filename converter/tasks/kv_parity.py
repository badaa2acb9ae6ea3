"""The KV task's MIL-level gates on emitted cached functions (one package per chunk): the
per-call fp32 check of every function (`parity.kv_mil`), the fp32 cache level over whole
continuations (`parity.kv_fp32`) and the fp16 cache gates through the host loop
(`parity.kv_gates`); also the variants' cache gates (`converter.compression.stateful`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from converter.pipeline.beside import beside
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.resources import GIB, children_with_room
from converter.pipeline.steps import Advance
from converter.tasks.kv_chunks import chunk_meta
from converter.tasks.kv_contract import DEFAULT_FUNCTION
from graph_passes.cached_decoder import CachedDecoder
from parity.gate_registry import GateResult, gate
from parity.kv_fp32 import PROFILE as FP32_LEVEL
from parity.kv_fp32 import LayerCapture, cached_fp32_level, reference
from parity.kv_gates import RULE, KvParity, check_kv
from parity.kv_mil import PROFILE, Recorder, Weights, cached_fp32_run, record_calls
from parity.kv_sequence import torch_fp16_errors
from parity.kv_session import CacheSession, MilChain, MilFunctions, session_for
from parity.lockstep import Lockstep
from parity.mil.program import load_function_set, load_package
from parity.mil_level import Fp32Run, MilSubject, run_mil_level
from parity.reference import Continuation
from parity.report import level_row


@dataclass(frozen=True)
class CacheBounds:
    """What the cached functions are held to: the program's precision and the recipe's
    thresholds (fp32: whether the fp32 levels run; ``anec parity --profile`` may leave them
    out)."""

    precision: str
    mil_fp32_layer_rel_error: float
    fp32_layer_rel_error: float
    fp32_logits_rel_error: float
    kv_max_abs_dprob: float
    fp32: bool = True


def function_gates(
    packages: list[Path],
    chunks: list[dict[str, CachedDecoder]],
    continuations: list[Continuation],
    extend: int,
    table: np.ndarray,
    sizes: list[dict[str, Any]],
    bounds: CacheBounds,
    weights: Weights = None,
    advance: Advance = lambda: None,
    function_packages: dict[str, Path] | None = None,
) -> tuple[list[GateResult], KvParity]:
    """Every MIL level of the cached functions on ``packages`` (one per chunk, call order),
    each loaded once: the per-call fp32 gate and the fp32 cache level (unless
    ``bounds.fp32`` is off) against the module holding ``weights`` where given, and the fp16
    cache gates. ``function_packages``: the per-function layout's packages, run as one
    program (`parity.mil.program.FunctionSet`: the host's copy of the state between them is
    exact, so one state stands for it)."""
    programs: list[Any] = (
        [load_function_set(function_packages)]
        if function_packages
        else [load_package(p) for p in packages]
    )

    found: list[KvParity] = []

    def fp16() -> list[GateResult]:
        found.append(cache_gates(packages, programs, chunks, continuations, extend, table, sizes,
                                 bounds.kv_max_abs_dprob, advance))  # fmt: skip
        return found[0].gates

    if bounds.fp32:
        subject = MilSubject(
            lambda tick: cached_fp32_check(programs, chunks, continuations, table,
                                           bounds.precision, tick, weights),
            fp16, bounds.mil_fp32_layer_rel_error,
            lambda tick: cache_fp32_level(programs, chunks, continuations, extend, table,
                                          bounds, tick, weights),
        )  # fmt: skip
        # The fp32 part and the fp16 gates share only what is loaded: on a second core the
        # first runs in a child while this process runs the second (`converter.pipeline.
        # beside`), when the memory budget has room for what the child adds.
        room = children_with_room(child_bytes(chunks), 1) == 1
        level = run_mil_level(subject, advance, lambda work: beside(
            work, advance, "the fp32 cache levels", room))  # fmt: skip
        layers = level.fp32_gates
    else:  # `anec parity --profile` left the fp32 profile out: the fp16 gates alone
        fp16()
        layers = []
    kv = found[0]
    if weights is None and kv.drift is not None and kv.drift.over:
        kv.drift.torch_fp16 = _torch_fp16_at(chunks[0][DEFAULT_FUNCTION], table, continuations,
                                             kv.drift.over)  # fmt: skip
    return layers, kv


# What the fp32 levels' child adds to memory, per parameter of the cached modules, above what it
# shares with the conversion: 0.86 and 0.96 GiB for SmolLM2's 135M in two runs (6.8 and 7.6
# bytes; `anec convert recipes/smollm2-135m-draft-kv.yaml`'s log, 2026-12-07), so 8 bytes (an
# fp64 copy of the weights) and 1 GiB more.
CHILD_BYTES_PER_PARAMETER = 8


def child_bytes(chunks: list[dict[str, CachedDecoder]]) -> int:
    """The room a child running the fp32 levels needs (`CHILD_BYTES_PER_PARAMETER`)."""
    parameters = sum(p.numel() for c in chunks for p in c[DEFAULT_FUNCTION].parameters())
    return CHILD_BYTES_PER_PARAMETER * parameters + GIB


def _torch_fp16_at(
    module: CachedDecoder,
    table: np.ndarray,
    continuations: list[Continuation],
    over: list[tuple[str, int, float]],
) -> list[float]:
    """The torch-fp16 module's |logit error| with no cache at each of the positions
    ``over`` lists (fixture, position, ...), for the fp16-sensitive positions' report."""
    out = []
    for c in continuations:
        positions = [p for name, p, _ in over if name == c.name]
        if positions:
            out += torch_fp16_errors(module.window, table, c, positions)
    return out


def cache_fp32_level(
    programs: list[Any],
    chunks: list[dict[str, CachedDecoder]],
    continuations: list[Continuation],
    extend: int,
    table: np.ndarray,
    bounds: CacheBounds,
    advance: Advance = lambda: None,
    weights: Weights = None,
) -> list[GateResult]:
    """The fp32 cache level (`parity.kv_fp32`) on ``programs`` (one per chunk)."""
    lockstep = Lockstep()
    captures = [LayerCapture(p, c, lockstep) for p, c in zip(programs, chunks, strict=True)]
    mil = _mil_functions(programs, chunks, FP32_LEVEL, captures, lockstep)
    functions = chunks[0]

    def reference_of(c: Continuation) -> Any:
        return reference(functions, c, table, bounds.precision, weights)

    return cached_fp32_level(
        _sessions(mil, functions, table, advance), captures, continuations, reference_of,
        extend, (bounds.fp32_layer_rel_error, bounds.fp32_logits_rel_error), lockstep,
    )  # fmt: skip


def cache_gates(
    packages: list[Path],
    programs: list[Any],
    chunks: list[dict[str, CachedDecoder]],
    continuations: list[Continuation],
    extend: int,
    table: np.ndarray,
    sizes: list[dict[str, Any]],
    max_dprob: float,
    advance: Advance = lambda: None,
) -> KvParity:
    """Every fp16 cache gate on the multifunction ``packages`` (one per chunk, in call order,
    run as one chain; ``programs``: them loaded) in the MIL evaluator's fp16 profile, and
    whether each stores its weights once (``sizes`` from `combine_measured`, per chunk)."""
    lockstep = Lockstep()
    mil = _mil_functions(programs, chunks, "fp16", lockstep=lockstep)
    kv = check_kv(_sessions(mil, chunks[0], table, advance), continuations, "prefill", extend,
                  "mil-fp16", max_dprob, lockstep)  # fmt: skip
    choices = mil.check  # every loop's, combined in order
    if choices is not None:
        kv.gates.append(
            gate("kv-cache", "kv_head_choice_mismatches").check(
                float(len(choices.mismatches)),
                implementation="mil-fp16",
                where=", ".join(choices.mismatches[:2]),
                detail=f"{choices.positions} positions of every call the gates made",
            )
        )
    if "weight_ratio" not in sizes[0]:
        return kv  # one package per function: no package holds two functions' weights
    # Per chunk: the worst chunk's ratio is the gate's value.
    worst = max(range(len(sizes)), key=lambda i: sizes[i]["weight_ratio"])
    kv.gates.append(
        gate("kv-cache", "kv_weights_stored_once").check(
            sizes[worst]["weight_ratio"],
            implementation="package",
            where=f"chunk {worst} ({packages[worst].name})" if len(sizes) > 1 else "",
            detail=f"package bytes ratio {sizes[worst]['package_ratio']:.4f}",
        )
    )
    return kv


def _mil_functions(
    programs: list[Any],
    chunks: list[dict[str, CachedDecoder]],
    profile: str,
    observers: list[Any] | None = None,
    lockstep: Lockstep | None = None,
) -> MilFunctions | MilChain:
    """The package's functions (one package per chunk, run as one chain) in the MIL
    evaluator under ``profile``, calling through ``lockstep`` when given."""
    functions = chunks[0]
    first = functions[DEFAULT_FUNCTION]
    heads = first.window.chunk_sizes
    if len(chunks) == 1:
        observer = observers[0] if observers else None
        return MilFunctions(
            programs[0], profile, list(functions), first.cache_shape(), heads, observer, lockstep
        )
    metas = [chunk_meta(c[DEFAULT_FUNCTION]) for c in chunks]
    return MilChain(programs, profile, list(functions), metas, heads, observers, lockstep)


def _sessions(
    mil: MilFunctions | MilChain,
    functions: dict[str, CachedDecoder],
    table: np.ndarray,
    advance: Advance,
) -> Callable[[], CacheSession]:
    """Fresh host loops over ``mil``, each with an empty cache."""

    def make_session() -> CacheSession:
        runner, states = mil.session()
        advance()
        return session_for(functions, runner, states, lambda ids: table[ids])

    return make_session


def cached_fp32_check(
    programs: list[Any],
    chunks: list[dict[str, CachedDecoder]],
    continuations: list[Continuation],
    table: np.ndarray,
    precision: str,
    advance: Advance = lambda: None,
    weights: Weights = None,
) -> Fp32Run:
    """The per-layer MIL fp32 check of every cached function of ``programs`` (one per chunk,
    `load_package`'s) (`parity.kv_mil`)."""
    recorders = [Recorder(p, c) for p, c in zip(programs, chunks, strict=True)]
    mil = _mil_functions(programs, chunks, PROFILE, recorders)
    record_calls(_sessions(mil, chunks[0], table, advance), recorders, continuations)
    return cached_fp32_run(recorders, precision, weights)


# The levels the cached functions are gated at (parity.html's levels table).
KV_LEVELS = [
    level_row(
        "mil-fp32",
        "mil-fp32",
        "the cached module with the program's constants in fp64, per call and layer",
    ),
    level_row(
        "kv-cache",
        "mil-fp32",
        "the window module with the program's constants in fp64 over the whole sequence, no "
        "cache (every call of every function over each whole continuation)",
    ),
    level_row("kv-cache", "mil-fp16", "reference (the original model's full recompute, fp32)"),
]


def write_kv_parity(
    directory: Path, kv: KvParity, sizes: list[dict[str, Any]], **extra: Any
) -> None:
    """``kv_parity.json`` of a cached artifact, fp16 or variant: the cache rule it was judged
    by, every cache gate as measured, the argmax flips, per-fixture figures, the fp16 logit
    error and the packages' sizes (one package's, or ``{"chunks": [...]}``), with ``extra``
    entries (a variant's: which gates it is gated on, weights stored differently)."""
    doc = {
        "rule": RULE,
        "gates": [g.to_json() for g in kv.gates],
        "flips": kv.flips,
        "fixtures": kv.rows,
        "fp16_logit_error": kv.drift.to_json() if kv.drift is not None else None,
        "sizes": sizes[0] if len(sizes) == 1 else {"chunks": sizes},
    }
    write_json_atomic(directory / "kv_parity.json", doc | extra)
