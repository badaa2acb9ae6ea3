"""Trace and convert each cached function (prefill, decode, extend, ...) to its own
single-function package, with what the manifest and the plan need of it.

``ct.convert`` runs on one core. On a host with a second core (`converter.pipeline.beside`)
the functions are dealt to this process and up to one forked child per core; each conversion
is the same code on the same module (coremltools clears its op-name counter per conversion),
so each package has the same bytes.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.coreml.program import live_ops, save_package
from converter.pipeline.beside import Pending, beside, can_fork
from converter.pipeline.resources import children_with_room
from converter.pipeline.steps import Advance
from converter.placement.ops import Function, OpTable
from converter.tasks.kv_contract import DEFAULT_FUNCTION, function_contract, state_contract
from converter.tasks.shared import Program, need
from graph_passes.cached_decoder import CachedDecoder
from parity.memory import release_memory

log = logging.getLogger(__name__)

# What one function's conversion adds to memory, per parameter of its module, above what it
# shares with the conversion's process: SmolLM2 KV's child converting prefill and extend grew
# 0.46 GiB (3.7 bytes per parameter; its convert.log, 2026-12-07), so three times that.
CONVERT_BYTES_PER_PARAMETER = 12


@dataclass(frozen=True)
class Converted:
    """One function's package and what was read off its program before it was dropped."""

    package: Path
    table: Function  # the plan's op rows
    live: collections.Counter[str]


def convert_function(
    name: str, module: CachedDecoder, dtype: Any, precision: Any, target: Any, scratch: Path
) -> Converted:
    """Trace and convert one function (a state for the ``state`` style) to
    ``scratch/NAME.mlpackage``."""
    from converter.coreml.program import to_mlprogram, trace
    from converter.placement.ops import function_table
    from graph_passes.markers import mark_layer_outputs

    inputs, outputs = function_contract(module, dtype)
    traced = trace(module, inputs)
    # Each layer's output named, for the per-layer MIL fp32 check (`parity.kv_mil`).
    mark_layer_outputs(traced, module.num_layers, first=module.start)
    mlmodel = to_mlprogram(traced, inputs, outputs, target, precision, state_contract(module))
    package = save_package(mlmodel, scratch / f"{name}.mlpackage")
    done = Converted(package, function_table(name, mlmodel._mil_program.functions["main"]),
                     live_ops(mlmodel))  # fmt: skip
    del mlmodel
    release_memory()
    return done


def convert_singles(
    functions: dict[str, CachedDecoder],
    dtype: Any,
    precision: Any,
    target: Any,
    scratch: Path,
    advance: Advance = lambda: None,
) -> tuple[dict[str, Path], dict[str, Program]]:
    """Every function converted (`convert_function`) and saved as its own single-function
    package in ``scratch``; also each function's program (its contract and live ops), the
    default function's with the plan table of every function under its own name."""
    scratch.mkdir(parents=True, exist_ok=True)
    names = list(functions)
    groups = _groups(functions)  # the first converts here, each other one in a child

    def convert(name: str) -> Converted:
        return convert_function(name, functions[name], dtype, precision, target, scratch)

    def converter_of(group: list[str]) -> Callable[[Advance], dict[str, Converted]]:
        def run(advance: Advance) -> dict[str, Converted]:
            done = {}
            for name in group:
                done[name] = convert(name)
                advance()
            return done

        return run

    children: list[Pending[dict[str, Converted]]] = []
    try:
        for group in groups[1:]:
            children.append(beside(converter_of(group), advance, f"converting {', '.join(group)}"))
        converted = converter_of(groups[0])(advance)
        for child in children:
            converted.update(child.result())
    except BaseException:
        for child in children:  # any still running: no child outlives the step
            child.cancel()
        raise
    # The plan's op tables, not the programs: held to the plan step, each chunk's programs
    # kept their fp16 weights through the cache parity.
    tables = OpTable([converted[name].table for name in names])
    programs: dict[str, Program] = {}
    for name in names:
        inputs, outputs = function_contract(functions[name], dtype)
        table = tables if name == DEFAULT_FUNCTION else None
        done = converted[name]
        programs[name] = Program(name, inputs, outputs, done.package, None, done.live, table)
    need(programs.get(DEFAULT_FUNCTION), "the decode function")
    return {name: converted[name].package for name in names}, programs


def _groups(functions: dict[str, CachedDecoder]) -> list[list[str]]:
    """The functions dealt in turn to this process and up to one child per core, as many as
    fork (`can_fork`) and the memory budget's room allow: with three functions on two cores,
    a process converting two of them one after the other set the step's time."""
    names = list(functions)
    children = min(len(names) - 1, len(os.sched_getaffinity(0))) if can_fork() else 0
    if children:
        first = next(iter(functions.values()))
        each = CONVERT_BYTES_PER_PARAMETER * sum(p.numel() for p in first.parameters())
        room = children_with_room(each, children)
        if room < children:
            log.info("%d children convert functions: the memory budget has room for no more", room)
            children = room
    return [names[i :: children + 1] for i in range(children + 1)]
