"""``anec device-check`` of a cached decoder: its cache gates run by Core ML per units setting.

For every units setting the cache gates (`parity.kv_gates.check_kv`: prefill, decode against
the checkpoint's fp32 continuations, extend against decode, stale rows) run through the host
loop with Core ML's predictions (`converter.drafts.host_loop.coreml_backend`). The same gates run
once
on the emitted program in anec's MIL evaluator (fp16), so each failure says where it comes
from (`converter.device.evidence_file.measure` runs them).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from converter.coreml.runtime import CoreMLModel, ModelLoader
from converter.device.evidence_file import PROGRAM, Prepared, implementation
from converter.drafts.host_loop import Runtime, artifact_checkpoint, coreml_backend, mil_backend
from parity.gate_registry import GateResult
from parity.kv_gates import check_kv
from parity.lockstep import Lockstep
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


def prepare_cached(artifact: Path) -> Prepared:
    """A cached decoder's cache gates, its continuations rebuilt from the checkpoint."""
    runtime = Runtime.from_artifact(artifact)
    # Core ML returns only a program's choice per chunk; the gates compare logits.
    runtime.require_logits("device-check compares logits with the checkpoint's")
    references = continuations(runtime)
    extend = int(runtime.functions["extend"].shape.tokens)
    # The recipe's bound, as the conversion gated the program (older recipes: the default).
    dprob = float((runtime.manifest["recipe"].get("gates") or {}).get("kv_max_abs_dprob", 0.03))

    def program() -> list[GateResult]:
        lockstep = Lockstep()  # the continuations side by side, as the conversion runs them
        make = mil_backend(runtime, lockstep=lockstep)
        return check_kv(make, references, "prefill", extend, PROGRAM, dprob, lockstep).gates

    def on_device(unit: str, load: ModelLoader) -> list[GateResult]:
        make = coreml_backend(runtime, unit, load)
        return check_kv(make, references, "prefill", extend, implementation(unit), dprob).gates

    return Prepared(
        program, on_device, partial(_load_functions, runtime), list(runtime.functions),
        {p: f for f, p in runtime.function_packages.items()},
    )  # fmt: skip


def _load_functions(
    runtime: Runtime, load: ModelLoader, units: str, names: list[str]
) -> list[CoreMLModel]:
    if runtime.function_packages:  # one package per function, its function main
        return [load(runtime.function_packages[n], "main", units) for n in names]
    return [load(p, n, units) for p in runtime.packages or [runtime.package] for n in names]
