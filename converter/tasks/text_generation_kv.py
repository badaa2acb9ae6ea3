"""The text-generation task with a KV cache (``cache.style`` state or io): its steps.

    load -> rewrite to BC1L (the window module, + prescales) -> cache reference (greedy
        continuations, full recompute in fp32) -> reference -> torch parity (window)
        -> convert prefill / decode / extend, combine into one multifunction package
        -> parity of the functions (MIL evaluator: fp32 per call and layer, fp16 through the
        cache) -> manifest -> plan (static)

The cached functions run the window module's own layers (`graph_passes.cached_decoder`), so
the rewrite's gates (torch fp32 per layer, fp16) cover their weights and norms; on the emitted
program, the per-layer fp32 gate (`parity.kv_mil`) covers what coremltools made of each
function and the cache gates (`parity.kv_gates`) what the cache adds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.coreml.program import combine_functions, save_package
from converter.coreml.targets import TARGETS, package_budget_bytes
from converter.errors import InputError
from converter.pipeline.manifest_fields import write_npy
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.steps import Advance, Step, Stop
from converter.tasks import text_generation as window_task
from converter.tasks.decoder_contract import head_output_section
from converter.tasks.kv_chunks import (
    Chunk,
    chunked_manifest,
    chunking_section,
    package_file,
    plan_chunks,
    split_layers,
    weight_bytes,
)
from converter.tasks.kv_contract import (
    DEFAULT_FUNCTION,
    function_calls,
    function_contract,
    kv_manifest_section,
)
from converter.tasks.kv_convert import convert_singles
from converter.tasks.kv_layout import (
    PER_FUNCTION,
    WEIGHTS,
    add_to_plan,
    package_bytes,
    per_function_sizes,
    publish_singles,
    resident_predicted,
)
from converter.tasks.kv_parity import (
    KV_LEVELS,
    PROFILE,
    CacheBounds,
    function_gates,
    write_kv_parity,
)
from converter.tasks.shared import Program, load, need, write_parity_reports
from graph_passes.cached_decoder import CachedDecoder, cached_functions
from parity.gate_registry import GateResult
from parity.kv_gates import RULE, KvParity
from parity.kv_session import rope_rows
from parity.reference import Continuation, continuation, originals
from parity.torch_settings import with_parity_torch

SCRATCH = "functions.tmp"  # single-function packages, combined and then removed


@dataclass
class KvRun(window_task.DecoderRun):
    """A cached decoder conversion in progress."""

    continuations: list[Continuation] = field(default_factory=list)
    split: list[Chunk] = field(default_factory=list)  # the packages' layer ranges, call order
    # Each chunk's functions and sizes, in call order; `functions` / `sizes` are the first's
    # (the only one's, without chunking).
    chunks: list[dict[str, CachedDecoder]] = field(default_factory=list)
    chunk_sizes: list[dict[str, Any]] = field(default_factory=list)
    functions: dict[str, CachedDecoder] = field(default_factory=dict)
    sizes: dict[str, Any] = field(default_factory=dict)
    kv: KvParity | None = None
    budget: int = 0  # bytes per package (cache.package_budget_mb or the target's default)
    # cache.layout per-function: each function's published program (empty: multifunction)
    function_programs: dict[str, Program] = field(default_factory=dict)

    @property
    def cache(self) -> Any:
        """The recipe's cache section."""
        return self.recipe.cache

    @property
    def function_packages(self) -> dict[str, Path]:
        """The per-function layout's package of each function (empty: multifunction)."""
        return {f: p.path for f, p in self.function_programs.items()}


# ---- steps -----------------------------------------------------------------------------------


def cache_reference(run: KvRun, advance: Advance) -> None:
    """Greedy continuations of every fixture by the original model and its fp32 logits."""
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    steps = run.cache.decode_steps
    trimmed = run.vocabulary
    head_ids = None if trimmed is None else torch.from_numpy(trimmed.kept.ids)
    for fixture in originals(rw.fixtures):
        if len(fixture.token_ids) + steps > run.cache.length:
            raise ValueError(
                f"fixtures.{fixture.name}: {len(fixture.token_ids)} tokens + {steps} decode "
                f"steps exceed cache.length {run.cache.length}"
            )
        run.continuations.append(continuation(ckpt.model, fixture, steps, head_ids))
        advance()


@dataclass
class Emitted:
    """The multifunction package and what was measured while building it."""

    package: Path
    sizes: dict[str, Any]
    decode: Program  # the default function's contract and converted model


def combine_measured(singles: dict[str, Path], package: Path) -> dict[str, Any]:
    """Combine single-function packages into the multifunction ``package`` (weights stored
    once) and measure both: bytes of each, and the multifunction / largest single ratios."""
    combine_functions(singles, package, DEFAULT_FUNCTION)
    single = {name: package_bytes(p) for name, p in singles.items()}
    single_weights = {name: (p / WEIGHTS).stat().st_size for name, p in singles.items()}
    sizes: dict[str, Any] = {
        "single_function_package_bytes": single,
        "single_function_weight_bytes": single_weights,
        "multifunction_package_bytes": package_bytes(package),
        "multifunction_weight_bytes": (package / WEIGHTS).stat().st_size,
    }
    sizes["package_ratio"] = sizes["multifunction_package_bytes"] / max(single.values())
    sizes["weight_ratio"] = sizes["multifunction_weight_bytes"] / max(single_weights.values())
    return sizes


def emit_functions(
    functions: dict[str, CachedDecoder],
    dtype: Any,
    precision: Any,
    target: Any,
    package: Path,
    advance: Advance = lambda: None,
) -> Emitted:
    """Convert each function into a scratch folder beside ``package``, combine them into the
    multifunction ``package`` (weights stored once) and measure both; the scratch folder is
    removed."""
    scratch = package.parent / SCRATCH
    if scratch.exists():
        raise FileExistsError(f"{scratch}: a scratch folder is in the way")
    singles, programs = convert_singles(functions, dtype, precision, target, scratch, advance)
    sizes = combine_measured(singles, package)
    shutil.rmtree(scratch)
    return Emitted(package, sizes, replace(programs[DEFAULT_FUNCTION], path=package))


def split_packages(run: KvRun, advance: Advance) -> None:
    """Split the layers into chunk packages within the recipe's weight budget (one chunk when
    everything fits), and build each chunk's cached functions."""
    rw, recipe = need(run.rewrite, "the rewrite"), run.recipe
    cache, module = run.cache, rw.module
    named = ((n, p.numel()) for n, p in module.named_parameters())
    weights = weight_bytes(
        named, module.spec.num_layers, recipe.precision, module.io.inputs == "token-ids"
    )
    budget = package_budget_bytes(cache.package_budget_mb, TARGETS[recipe.target].platform)
    run.budget = budget
    run.split = split_layers(weights, budget, recipe.precision)
    if cache.layout == PER_FUNCTION and len(run.split) > 1:
        raise InputError(
            f"cache.layout: per-function: the weights need {len(run.split)} packages within "
            f"the target's {budget / 1e6:.0f} MB per package, and a per-function layout is not "
            "chunked; use layout multifunction (chunked) or a target with a larger budget"
        )
    calls = function_calls(cache.prefill, cache.extend)
    run.chunks = [
        cached_functions(module, cache.style, cache.length, calls, c.layers) for c in run.split
    ]
    run.functions = run.chunks[0]


def convert_functions(run: KvRun, advance: Advance) -> None:
    """Convert prefill, decode and extend of each chunk and combine them into one
    multifunction package per chunk (or publish each as its own: cache.layout)."""
    target = TARGETS[run.recipe.target].ct_target()
    if run.cache.layout == PER_FUNCTION:
        scratch = run.job.directory / SCRATCH
        singles, programs = convert_singles(
            run.functions, run.recipe.io.dtype, run.recipe.precision, target, scratch, advance
        )
        run.function_programs = publish_singles(
            singles, programs, run.job.directory, run.recipe.name
        )
        shutil.rmtree(scratch)
        run.sizes = per_function_sizes(run.function_packages)
        run.chunk_sizes, run.programs = [run.sizes], [run.function_programs[DEFAULT_FUNCTION]]
        return
    for chunk, functions in zip(run.split, run.chunks, strict=True):
        emitted = emit_functions(
            functions,
            run.recipe.io.dtype,
            run.recipe.precision,
            target,
            run.job.directory / package_file(run.recipe.name, chunk, len(run.split)),
            advance,
        )
        run.chunk_sizes.append(emitted.sizes)
        run.programs.append(emitted.decode)
    run.sizes = run.chunk_sizes[0]


def published_functions(run: KvRun, advance: Advance) -> None:
    """``anec parity``: the sizes of the published packages (the single-function sizes as
    the manifest recorded them; each combined package measured)."""
    import json

    directory = run.main.path.parent
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    kv = manifest["kv_cache"]
    if kv.get("layout") == PER_FUNCTION:
        run.function_programs = {
            f: replace(run.main, piece=f, path=directory / e["package"])
            for f, e in kv["functions"].items()
        }
        run.sizes = per_function_sizes(run.function_packages)
        run.chunk_sizes = [run.sizes]
        return
    records = [c["sizes"] for c in kv["chunks"]] if "chunks" in kv else [kv["sizes"]]
    for program, recorded in zip(run.programs, records, strict=True):
        package = program.path
        sizes = dict(recorded)
        sizes["multifunction_package_bytes"] = package_bytes(package)
        sizes["multifunction_weight_bytes"] = (package / WEIGHTS).stat().st_size
        sizes["package_ratio"] = sizes["multifunction_package_bytes"] / max(
            recorded["single_function_package_bytes"].values()
        )
        sizes["weight_ratio"] = sizes["multifunction_weight_bytes"] / max(
            recorded["single_function_weight_bytes"].values()
        )
        run.chunk_sizes.append(sizes)
    run.sizes = run.chunk_sizes[0]


def kv_parity(run: KvRun, advance: Advance) -> Stop | None:
    """Every function per call (MIL fp32), the fp32 cache level and the fp16 cache gates on
    the emitted packages."""
    rw, report = need(run.rewrite, "the rewrite"), need(run.report, "the torch report")
    fp32 = PROFILE in run.profiles  # `anec parity --profile` may leave it out
    layers, run.kv = function_gates(
        [p.path for p in run.programs], run.chunks, run.continuations, run.cache.extend,
        rw.embed_table.numpy(), run.chunk_sizes, _bounds(run, fp32), advance=advance,
        function_packages=run.function_packages,
    )  # fmt: skip
    report.gates += layers + run.kv.gates
    window_task.diagnose_fp16(run)
    if fp32:
        report.implementations["mil-fp32"] = (
            "anec MIL evaluator, fp32 profile, each call of each cached function"
        )
    report.implementations["mil-fp16"] = "anec MIL evaluator, fp16 profile, through the cache"
    drift = need(run.kv.drift, "the fp16 drift")
    write_kv_parity(run.job.directory, run.kv, run.chunk_sizes)
    levels = KV_LEVELS if fp32 else KV_LEVELS[2:]
    write_parity_reports(run.job.directory, report, None,
                         {"recipe": run.recipe.name, "kv_cache_rule": RULE}, levels,
                         drift.text())  # fmt: skip
    return None if report.passed else Stop("kv-cache", run.kv.flips[:10])


def _bounds(run: KvRun, fp32: bool = True) -> CacheBounds:
    """What the cached functions are held to, from the recipe."""
    g = run.recipe.gates
    return CacheBounds(
        run.recipe.precision, g.mil_fp32_layer_rel_error, g.fp32_layer_rel_error,
        g.fp32_logits_rel_error, g.kv_max_abs_dprob, fp32,
    )  # fmt: skip


def manifest(run: KvRun, advance: Advance) -> None:
    """manifest.json with the kv_cache section, and the host tables (rope.npy)."""
    first = run.functions[DEFAULT_FUNCTION]
    tables = np.stack([np.stack(pair) for pair in rope_rows(first)]).astype(np.float32)
    rope = write_npy(
        run.job.directory / "rope.npy",
        tables,
        "RoPE tables [group, cos|sin, channel, position] for positions 0..cache_length-1 "
        "(sin sign-folded: rotate_half's minus is in its first half)",
    )
    window_task.manifest(run, advance)
    doc = need(run.manifest, "the manifest")
    # The package holds prefill / decode / extend; its default function is decode, not main.
    doc.package.function = DEFAULT_FUNCTION
    dtype, rope_doc = run.recipe.io.dtype, rope.model_dump(mode="json")
    if len(run.split) == 1:
        contracts = {name: function_contract(m, dtype) for name, m in run.functions.items()}
        doc.kv_cache = kv_manifest_section(run.functions, contracts, run.sizes, rope_doc)
        doc.kv_cache["layout"] = run.cache.layout
        doc.kv_cache["resident_predicted"] = resident_predicted(run.sizes, list(run.functions))
        if run.function_packages:
            per_function_manifest(run, doc)
    else:
        cache = run.cache
        whole = cached_functions(
            need(run.rewrite, "the rewrite").module, cache.style, cache.length,
            function_calls(cache.prefill, cache.extend),
        )  # fmt: skip
        chunked_manifest(
            doc, run.split, run.chunks, run.programs, run.chunk_sizes, whole, dtype, rope_doc
        )
    files = [p.path.name for p in run.programs]
    need(doc.kv_cache, "the kv_cache section")["chunking"] = chunking_section(
        run.split, run.budget, files
    )
    positions = {
        name: m.io.tokens if m.io.logits == "all" else 1 for name, m in run.functions.items()
    }
    doc.head_output = head_output_section(need(run.rewrite, "the rewrite").module, positions)
    write_json_atomic(run.job.directory / "manifest.json", doc.model_dump(mode="json"))


def per_function_manifest(run: KvRun, doc: Any) -> None:
    """The per-function layout: decode's package is ``package`` (function ``main``), the
    others ``extra_packages``; each function names its package in ``kv_cache.functions``."""
    from converter.pipeline.manifest_fields import package_entry

    doc.package.function = "main"
    for name, program in run.function_programs.items():
        doc.kv_cache["functions"][name] |= {"package": program.path.name, "function": "main"}
    doc.extra_packages = [
        package_entry(p.path, p.ops) for f, p in run.function_programs.items()
        if f != DEFAULT_FUNCTION
    ]  # fmt: skip


def plan(run: KvRun, advance: Advance) -> Stop | None:
    """The static plan of the package (of each chunk's, ``plan.chunk<i>.*``) and the recipe's
    plan gates."""
    if len(run.programs) == 1:
        stop = window_task.plan(run, advance)
        kv = need(need(run.manifest, "the manifest").kv_cache, "the kv_cache section")
        add_to_plan(run.job.directory, kv["resident_predicted"])
        return stop
    platform = TARGETS[run.recipe.target].platform
    failures = plan_chunks(run.programs, run.job.directory, platform, run.recipe.gates)
    return Stop("plan", failures) if failures else None


def window_package(run: KvRun, path: Path) -> Path:
    """The fp16 window program of the run's window module, as the window task emits it
    (layer outputs marked), saved as ``path``: the vehicle a compressed variant's quality
    gates are measured on with byte-identical weights."""
    from converter.coreml.program import to_mlprogram, trace
    from converter.tasks.decoder_contract import tensor_contract
    from graph_passes.markers import mark_layer_outputs

    module = need(run.rewrite, "the rewrite").module
    inputs, outputs = tensor_contract(module, run.recipe.io.dtype)
    traced = trace(module, inputs)
    mark_layer_outputs(traced, module.spec.num_layers)
    target = TARGETS[run.recipe.target].ct_target()
    return save_package(to_mlprogram(traced, inputs, outputs, target, run.recipe.precision), path)


def compress(run: KvRun, published: Path, out_dir: Path, force: bool, progress: Steps) -> list[Any]:
    """Build, gate and publish every compressed variant the recipe asks for, each a stateful
    multifunction package of its own (`converter.compression.stateful`)."""
    compression = run.recipe.compression
    if compression is None or run.held_out is None:
        return []
    from converter.compression.cached_programs import KvBuild
    from converter.compression.decoder_variants import DecoderSubject
    from converter.compression.stateful import emit_kv_variants

    rw, recipe = need(run.rewrite, "the rewrite"), run.recipe
    target = TARGETS[recipe.target].ct_target()
    table = rw.embed_table.numpy()

    def singles(folder: Path) -> list[dict[str, Path]]:
        return [
            convert_singles(c, recipe.io.dtype, recipe.precision, target, folder / f"chunk{i}")[0]
            for i, c in enumerate(run.chunks)
        ]

    def gates(
        packages: list[Path], sizes: list[dict[str, Any]], weights: dict[str, Any]
    ) -> tuple[list[GateResult], KvParity]:
        return function_gates(
            packages, run.chunks, run.continuations, run.cache.extend, table, sizes,
            _bounds(run), weights,
        )  # fmt: skip

    build = KvBuild(
        singles,
        lambda path: window_package(run, path),
        gates,
        combine_measured,
        [n for n, _ in rw.module.named_parameters()],
        lambda name, i: package_file(name, run.split[i], len(run.split)),
    )
    subject = DecoderSubject(
        rw.module, rw.embed_table, run.held_out, recipe.gates.mil_fp32_layer_rel_error,
        acceptance=compression.acceptance,
    )  # fmt: skip
    return emit_kv_variants(
        compression, recipe.name, published, subject, build, out_dir, force, progress
    )


def _continuation_count(run: KvRun) -> int:
    return len(originals(need(run.rewrite, "the rewrite").fixtures))


CONVERT_STEPS: tuple[Step[KvRun], ...] = (
    Step("load checkpoint", load),
    Step("rewrite to BC1L", with_parity_torch(window_task.rewrite)),
    window_task.VOCABULARY_STEP,
    Step("reference continuations (original model)", with_parity_torch(cache_reference),
         _continuation_count),
    Step("reference (original model)", with_parity_torch(window_task.references),
         window_task._fixture_count),
    Step("parity (torch fp32)", with_parity_torch(window_task.torch_parity),
         window_task._torch_batches),
    Step("split into packages (weight budget)", split_packages),
    Step("convert prefill, decode, extend", convert_functions, lambda run: 3 * len(run.split)),
    Step("parity through the cache (MIL evaluator)", with_parity_torch(kv_parity),
         lambda run: (3 + 4 * (PROFILE in run.profiles)) * _continuation_count(run)),
    Step("write manifest", manifest),
    Step("plan (static)", plan),
)  # fmt: skip
# `anec parity`: the same gates on the published package, nothing converted or written into it.
RECHECK_STEPS = tuple(
    Step("cached functions of the package", published_functions)
    if s.run is convert_functions
    else s
    for s in CONVERT_STEPS
    if s.run not in (manifest, plan)
)
