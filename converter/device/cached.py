"""``anec device-check`` of a cached decoder: its cache gates run by Core ML per units setting.

For every units setting the cache gates (`parity.kv_gates.check_kv`: prefill, decode against
the checkpoint's fp32 continuations, extend against decode, stale rows) run through the host
loop with Core ML's predictions (`converter.generate.coreml_backend`). The same gates run once
on the emitted program in anec's MIL evaluator (fp16), so each failure says where it comes
from. The gates' own calls give each function's latency; the first load of each function is
timed apart (Core ML compiles then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from converter.coreml_runtime import CoreMLModel, MemoryProbe, ModelLoader
from converter.device.evidence import (
    PROGRAM,
    DeviceEvidence,
    TimedLoader,
    UnitsResult,
    checked_packages,
    implementation,
    memory_census,
)
from converter.errors import InputError
from converter.generate import Runtime, artifact_checkpoint, coreml_backend, mil_backend
from parity.kv_gates import check_kv
from parity.reference import Continuation


def continuations(runtime: Runtime) -> list[Continuation]:
    """The recipe's fixtures' greedy continuations by the checkpoint in fp32, as the
    conversion's cache gates use them (its hash checked against the manifest)."""
    import torch

    from converter.recipe import DecoderRecipe, recipe_from_dict
    from parity.fixtures import build_fixtures
    from parity.reference import continuation, originals

    recipe = recipe_from_dict(runtime.manifest["recipe"])
    assert isinstance(recipe, DecoderRecipe)
    ckpt = artifact_checkpoint(runtime.directory)
    fixtures = build_fixtures(
        recipe.fixtures.prompts, recipe.fixtures.token_ids, ckpt.tokenizer,
        recipe.shapes.sequence_length, int(runtime.manifest["vocab_size"]),
        recipe.fixtures.padded_variants,
    )  # fmt: skip
    ids = runtime.head_ids()
    head_ids = None if ids is None else torch.from_numpy(ids)
    steps = recipe.cache.decode_steps
    return [continuation(ckpt.model, f, steps, head_ids) for f in originals(fixtures)]


def cached_check(
    artifact: Path,
    units: Sequence[str],
    load: ModelLoader,
    probe: MemoryProbe | None,
    recorded: dict[str, Any],
) -> DeviceEvidence:
    """Run a cached decoder's cache gates under each of ``units`` through ``load``;
    ``probe`` (None: no memory census) reads memory; ``recorded`` says where this ran."""
    runtime = Runtime.from_artifact(artifact)
    choice = (runtime.manifest.get("head_output") or {}).get("choice", "logits")
    if choice != "logits":
        # Core ML returns only a program's choice per chunk; the gates compare logits.
        raise InputError(
            f"{artifact}: head_output.choice is {choice}; device-check compares logits with the "
            "checkpoint's: convert the same recipe with io.output: logits"
        )
    packages = checked_packages(artifact)
    references = continuations(runtime)
    extend = int(runtime.functions["extend"].shape.tokens)
    program = check_kv(mil_backend(runtime), references, "prefill", extend, PROGRAM).gates
    baseline = {g.name: g for g in program}
    results = []
    for unit in units:
        timed = TimedLoader(load, {p: f for f, p in runtime.function_packages.items()})
        make = coreml_backend(runtime, unit, timed)
        gates = check_kv(make, references, "prefill", extend, implementation(unit)).gates
        results.append(UnitsResult(unit, gates, baseline, timed.functions))
    memory = None
    if probe is not None:
        memory = memory_census(_loader_of(runtime, units[-1], load), list(runtime.functions),
                               units[-1], probe)  # fmt: skip
    return DeviceEvidence(artifact.name, packages, recorded, program, results, memory)


def _loader_of(
    runtime: Runtime, units: str, load: ModelLoader
) -> Callable[[list[str]], list[CoreMLModel]]:
    packages = runtime.packages or [runtime.package]

    def load_set(names: list[str]) -> list[CoreMLModel]:
        if runtime.function_packages:  # one package per function, its function main
            return [load(runtime.function_packages[n], "main", units) for n in names]
        return [load(p, n, units) for p in packages for n in names]

    return load_set
