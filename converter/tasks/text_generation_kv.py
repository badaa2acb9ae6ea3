"""The text-generation task with a KV cache (``cache.style`` state or io): its steps.

    load -> rewrite to BC1L (the window module, + prescales) -> cache reference (greedy
        continuations, full recompute in fp32) -> reference -> torch parity (window)
        -> convert prefill / decode / extend, combine into one multifunction package
        -> parity through the cache (MIL evaluator fp16) -> manifest -> plan (static)

The cached functions run the window module's own layers (`graph_passes.cached_decoder`), so
the rewrite's gates (torch fp32 per layer, fp16) cover their weights and norms; the cache
gates (`parity.kv_gates`) cover what the cache adds, on the emitted program.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml import combine_functions, live_ops, load_program, save_package
from converter.manifest_fields import write_npy
from converter.progress import Steps
from converter.publish import write_json_atomic
from converter.steps import Advance, Step, Stop
from converter.targets import TARGETS
from converter.tasks import text_generation as window_task
from converter.tasks.base import Program, load, need
from converter.tasks.decoder_contract import head_output_section
from converter.tasks.kv_contract import (
    DEFAULT_FUNCTION,
    function_calls,
    function_contract,
    kv_manifest_section,
    state_contract,
)
from graph_passes.cache_host import CallShape
from graph_passes.cached_decoder import CachedDecoder, cached_functions
from parity.kv_gates import KvParity, check_kv
from parity.kv_reference import Continuation, continuation, originals
from parity.kv_session import CacheSession, FunctionShape, MilFunctions, rope_rows
from parity.report_files import write_parity_reports
from parity.threads import with_torch_threads

SCRATCH = "functions.tmp"  # single-function packages, combined and then removed
WEIGHTS = Path("Data") / "com.apple.CoreML" / "weights" / "weight.bin"


@dataclass
class KvRun(window_task.DecoderRun):
    """A cached decoder conversion in progress."""

    continuations: list[Continuation] = field(default_factory=list)
    functions: dict[str, CachedDecoder] = field(default_factory=dict)
    sizes: dict[str, Any] = field(default_factory=dict)
    kv: KvParity | None = None

    @property
    def cache(self) -> Any:
        """The recipe's cache section."""
        return self.recipe.cache


def package_bytes(path: Path) -> int:
    """Bytes of every file under a package."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def session_for(
    functions: dict[str, CachedDecoder], runner: Any, states: Any, embed: Any
) -> CacheSession:
    """A fresh host loop over ``functions`` run by ``runner``."""
    first = functions[DEFAULT_FUNCTION]
    shapes = {
        name: FunctionShape(
            name,
            CallShape(m.io.cache_length, m.io.tokens, tuple(m.windows), m.io.style),
            m.io.logits,
        )
        for name, m in functions.items()
    }
    token_input = "input_ids" if first.io.inputs == "token-ids" else "inputs_embeds"
    return CacheSession(
        shapes, rope_rows(first), first.cache_shape(), runner, token_input, embed, states=states
    )


# ---- steps -----------------------------------------------------------------------------------


def cache_reference(run: KvRun, advance: Advance) -> None:
    """Greedy continuations of every fixture by the original model and its fp32 logits."""
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    steps = run.cache.decode_steps
    for fixture in originals(rw.fixtures):
        if len(fixture.token_ids) + steps > run.cache.length:
            raise ValueError(
                f"fixtures.{fixture.name}: {len(fixture.token_ids)} tokens + {steps} decode "
                f"steps exceed cache.length {run.cache.length}"
            )
        run.continuations.append(continuation(ckpt.model, fixture, steps))
        advance()


@dataclass
class Emitted:
    """The multifunction package and what was measured while building it."""

    package: Path
    sizes: dict[str, Any]
    decode: Program  # the default function's contract and converted model


def convert_singles(
    functions: dict[str, CachedDecoder],
    dtype: Any,
    precision: Any,
    target: Any,
    scratch: Path,
    advance: Advance = lambda: None,
) -> tuple[dict[str, Path], Program]:
    """Trace and convert each function (a state for the ``state`` style) and save each as
    its own single-function package in ``scratch``; also the default function's program."""
    from converter.coreml import to_mlprogram, trace

    scratch.mkdir(parents=True, exist_ok=True)
    singles: dict[str, Path] = {}
    decode: Program | None = None
    for name, module in functions.items():
        inputs, outputs = function_contract(module, dtype)
        traced = trace(module, inputs)
        mlmodel = to_mlprogram(traced, inputs, outputs, target, precision, state_contract(module))
        singles[name] = save_package(mlmodel, scratch / f"{name}.mlpackage")
        if name == DEFAULT_FUNCTION:
            decode = Program(name, inputs, outputs, scratch, mlmodel, live_ops(mlmodel))
        advance()
    return singles, need(decode, "the decode function")


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
    singles, decode = convert_singles(functions, dtype, precision, target, scratch, advance)
    sizes = combine_measured(singles, package)
    shutil.rmtree(scratch)
    return Emitted(package, sizes, replace(decode, path=package))


def convert_functions(run: KvRun, advance: Advance) -> None:
    """Convert prefill, decode and extend and combine them into one multifunction package."""
    rw = need(run.rewrite, "the rewrite")
    cache = run.cache
    run.functions = cached_functions(
        rw.module, cache.style, cache.length, function_calls(cache.prefill, cache.extend)
    )
    emitted = emit_functions(
        run.functions,
        run.recipe.io.dtype,
        run.recipe.precision,
        TARGETS[run.recipe.target].ct_target(),
        run.job.directory / f"{run.recipe.name}.mlpackage",
        advance,
    )
    run.sizes = emitted.sizes
    run.programs.append(emitted.decode)


def published_functions(run: KvRun, advance: Advance) -> None:
    """``anec parity``: the cached modules of the published package, and its sizes (the
    single-function sizes as the manifest recorded them; the combined package measured)."""
    import json

    rw = need(run.rewrite, "the rewrite")
    cache = run.cache
    run.functions = cached_functions(
        rw.module, cache.style, cache.length, function_calls(cache.prefill, cache.extend)
    )
    package = run.main.path
    manifest = json.loads((package.parent / "manifest.json").read_text(encoding="utf-8"))
    recorded = manifest["kv_cache"]["sizes"]
    sizes = dict(recorded)
    sizes["multifunction_package_bytes"] = package_bytes(package)
    sizes["multifunction_weight_bytes"] = (package / WEIGHTS).stat().st_size
    sizes["package_ratio"] = sizes["multifunction_package_bytes"] / max(
        recorded["single_function_package_bytes"].values()
    )
    sizes["weight_ratio"] = sizes["multifunction_weight_bytes"] / max(
        recorded["single_function_weight_bytes"].values()
    )
    run.sizes = sizes


def cache_gates(
    package: Path,
    functions: dict[str, CachedDecoder],
    continuations: list[Continuation],
    extend: int,
    table: np.ndarray,
    sizes: dict[str, Any],
    advance: Advance = lambda: None,
) -> KvParity:
    """Every cache gate on the multifunction ``package`` in the MIL evaluator's fp16 profile,
    and whether it stores its weights once (``sizes`` from `combine_measured`)."""
    from parity.gate import gate

    program = load_program(package)
    first = functions[DEFAULT_FUNCTION]
    chunks = first.window.chunk_sizes
    mil = MilFunctions(program, "fp16", list(functions), first.cache_shape(), chunks)

    def make_session() -> CacheSession:
        runner, states = mil.session()
        advance()
        return session_for(functions, runner, states, lambda ids: table[ids])

    kv = check_kv(make_session, continuations, "prefill", extend, "mil-fp16")
    if mil.check is not None:
        kv.gates.append(
            gate("kv-cache", "kv_head_choice_mismatches").check(
                float(len(mil.check.mismatches)),
                implementation="mil-fp16",
                where=", ".join(mil.check.mismatches[:2]),
                detail=f"{mil.check.positions} positions of every call the gates made",
            )
        )
    kv.gates.append(
        gate("kv-cache", "kv_weights_stored_once").check(
            sizes["weight_ratio"],
            implementation="package",
            detail=f"package bytes ratio {sizes['package_ratio']:.4f}",
        )
    )
    return kv


def kv_parity(run: KvRun, advance: Advance) -> Stop | None:
    """The cache gates on the emitted package in the MIL evaluator's fp16 profile."""
    rw, report = need(run.rewrite, "the rewrite"), need(run.report, "the torch report")
    run.kv = cache_gates(
        run.main.path, run.functions, run.continuations, run.cache.extend,
        rw.embed_table.numpy(), run.sizes, advance,
    )  # fmt: skip
    report.gates.extend(run.kv.gates)
    report.implementations["mil-fp16"] = "anec MIL evaluator, fp16 profile, through the cache"
    write_json_atomic(
        run.job.directory / "kv_parity.json",
        {
            "gates": [g.to_json() for g in run.kv.gates],
            "flips": run.kv.flips,
            "fixtures": run.kv.rows,
            "sizes": run.sizes,
        },
    )
    write_parity_reports(run.job.directory, report, None, {"recipe": run.recipe.name})
    return None if report.passed else Stop("kv-cache", run.kv.flips[:10])


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
    contracts = {
        name: function_contract(m, run.recipe.io.dtype) for name, m in run.functions.items()
    }
    doc.kv_cache = kv_manifest_section(
        run.functions, contracts, run.sizes, rope.model_dump(mode="json")
    )
    positions = {
        name: m.io.tokens if m.io.logits == "all" else 1 for name, m in run.functions.items()
    }
    doc.head_output = head_output_section(need(run.rewrite, "the rewrite").module, positions)
    write_json_atomic(run.job.directory / "manifest.json", doc.model_dump(mode="json"))


def window_package(run: KvRun, path: Path) -> Path:
    """The fp16 window program of the run's window module, as the window task emits it
    (layer outputs marked), saved as ``path``: the vehicle a compressed variant's quality
    gates are measured on with byte-identical weights."""
    from converter.coreml import to_mlprogram, trace
    from converter.markers import mark_layer_outputs
    from converter.tasks.decoder_contract import tensor_contract

    module = need(run.rewrite, "the rewrite").module
    inputs, outputs = tensor_contract(module, run.recipe.io.dtype)
    traced = trace(module, inputs)
    mark_layer_outputs(traced, module.spec.num_layers)
    target = TARGETS[run.recipe.target].ct_target()
    return save_package(to_mlprogram(traced, inputs, outputs, target, run.recipe.precision), path)


def compress(run: KvRun, published: Path, out_dir: Path, force: bool, progress: Steps) -> list[Any]:
    """Build, gate and publish every compressed variant the recipe asks for, each a stateful
    multifunction package of its own (`converter.compress.stateful`)."""
    compression = run.recipe.compression
    if compression is None or run.held_out is None:
        return []
    from converter.compress.decoder import DecoderSubject
    from converter.compress.stateful import KvBuild, emit_kv_variants

    rw, recipe = need(run.rewrite, "the rewrite"), run.recipe
    target = TARGETS[recipe.target].ct_target()
    table = rw.embed_table.numpy()

    def singles(folder: Path) -> dict[str, Path]:
        out, _ = convert_singles(run.functions, recipe.io.dtype, recipe.precision, target, folder)
        return out

    def gates(package: Path, sizes: dict[str, Any]) -> KvParity:
        return cache_gates(
            package, run.functions, run.continuations, run.cache.extend, table, sizes
        )

    build = KvBuild(
        singles,
        lambda path: window_package(run, path),
        gates,
        combine_measured,
        [n for n, _ in rw.module.named_parameters()],
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
    Step("rewrite to BC1L", with_torch_threads(window_task.rewrite)),
    Step("reference continuations (original model)", with_torch_threads(cache_reference),
         _continuation_count),
    Step("reference (original model)", with_torch_threads(window_task.references),
         window_task._fixture_count),
    Step("parity (torch fp32, fp16)", with_torch_threads(window_task.torch_parity),
         window_task._batch_count),
    Step("convert prefill, decode, extend", convert_functions, lambda run: 3),
    Step("parity through the cache (MIL evaluator)", with_torch_threads(kv_parity),
         lambda run: 3 * _continuation_count(run)),
    Step("write manifest", manifest),
    Step("plan (static)", window_task.plan),
)  # fmt: skip
# `anec parity`: the same gates on the published package, nothing converted or written into it.
RECHECK_STEPS = tuple(
    Step("cached functions of the package", published_functions)
    if s.run is convert_functions
    else s
    for s in CONVERT_STEPS
    if s.run not in (manifest, window_task.plan)
)
