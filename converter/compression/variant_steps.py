"""One compressed variant's steps, for every kind of artifact: compress, records and size,
(a cached decoder's cache gates), parity, reports and manifest; then publish or keep as
``.failed``.

A single-program artifact (window decoder, encoder) is one program; a cached decoder is its
window program (the quality vehicle, not published) plus the functions of its packages
(`CachedPrograms`), compressed with the same plan. The orchestration that builds the inputs
lives in ``emit`` (single program) and ``stateful`` (cached decoder).
"""

from __future__ import annotations

import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converter.compression import methods
from converter.compression.cached_programs import (
    HOST_FILES,
    STRUCTURAL,
    WINDOW,
    CachedPrograms,
    cache_report,
    with_chunks,
)
from converter.compression.methods.base import BuildContext, Inspected, Selection
from converter.compression.records import WeightRecord, weight_records, with_extra_bytes
from converter.compression.schemes import apply_plan
from converter.compression.size import SizeReport, size_report
from converter.compression.weight_error import errors_json, errors_text, weight_errors
from converter.coreml.program import function_ops, save_package
from converter.pipeline.hashing import sha256_file
from converter.pipeline.manifest import FileEntry, Manifest
from converter.pipeline.manifest_fields import package_entry
from converter.pipeline.publish import stage_artifact, write_json_atomic
from converter.pipeline.runlog import write_log_into
from converter.pipeline.steps import Advance, Step, run_steps
from converter.recipe.compression_section import Variant
from converter.tasks.kv_parity import write_kv_parity
from converter.tasks.shared import write_parity_files
from parity.memory import release_memory


@dataclass
class VariantResult:
    """What one variant produced; ``passed`` False keeps its reports in ``.failed``."""

    name: str
    suffix: str
    passed: bool
    directory: Path
    size: SizeReport | None = None
    parity: Any = None  # the subject's parity result: .gates (GateResult), .passed
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mib: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A one-screen JSON summary."""
        return {
            "name": self.name,
            "passed": self.passed,
            "directory": str(self.directory),
            "size": self.size.to_json() if self.size else None,
            "gates": [
                {
                    "name": g.name,
                    "implementation": g.implementation,
                    "value": g.value,
                    "threshold": g.threshold,
                    "passed": g.passed,
                }
                for g in (self.parity.gates if self.parity else [])
            ],  # fmt: skip
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()},
            "peak_rss_mib": round(self.peak_rss_mib),
        }


@dataclass
class VariantRun:
    """One compressed variant in progress: what its steps (`converter.pipeline.steps`) read and
    add."""

    ctx: BuildContext
    variant: Variant
    vname: str  # the variant artifact's name: <artifact>-<suffix>
    fp16_dir: Path  # the published fp16 artifact it is derived from
    directory: Path  # its staging directory
    selection: Selection
    source: Any = None  # the fp16 MLModel of the program whose quality is gated
    cached: CachedPrograms | None = None  # a cached decoder's functions (None: one program)
    state: Any = None  # the method's own state between prepare, finish and inspect
    package: Path | None = None  # the gated program's package (a cached decoder's: scratch)
    packages: list[Path] = field(default_factory=list)  # the published packages, call order
    program: Any = None  # the gated program (MIL), held from records to parity
    records: list[WeightRecord] = field(default_factory=list)
    decoded: dict[str, Any] = field(default_factory=dict)
    size: SizeReport | None = None
    errors: list[Any] = field(default_factory=list)
    ops: list[dict[str, int]] = field(default_factory=list)  # per package, its default function
    stream: dict[str, Any] = field(default_factory=dict)
    inspected: Inspected | None = None
    parity: Any = None  # the subject's parity result: .gates (GateResult), .passed
    # a cached decoder's: its packages' sizes, weights stored otherwise somewhere, the cache
    # gates (`KvParity`) and those of them that are gated
    sizes: list[dict[str, Any]] = field(default_factory=list)
    odd: list[str] = field(default_factory=list)
    kv: Any = None
    cache_gates: list[Any] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # `timed` steps' times

    @property
    def method(self) -> Any:
        """The variant's registered compression method."""
        return methods.get(self.variant.method)

    @property
    def extra(self) -> dict[str, Any]:
        """The method's report and manifest entries (a search, activation quantizers)."""
        inspected = self.inspected.doc if self.inspected is not None else {}
        return self.selection.doc | inspected

    @property
    def kv_programs(self) -> CachedPrograms:
        """A cached decoder's functions."""
        assert self.cached is not None
        return self.cached


def publish_variant(
    ctx: BuildContext,
    variant: Variant,
    vname: str,
    start: Callable[[Path, Selection], VariantRun],
    steps: Sequence[Step[Any]],
    out_dir: Path,
    force: bool,
) -> VariantResult:
    """Stage the variant ``vname``, choose its plan (once: a searched plan is searched once),
    run ``steps`` on the run ``start`` makes, and publish it when its gates pass (else keep
    its reports in ``.failed``)."""
    with stage_artifact(out_dir, vname, force=force) as stage:
        selection = methods.get(variant.method).select(ctx, variant)
        run = start(stage.path, selection)
        run_steps(steps, run, ctx.progress)
        seconds = selection.seconds | run.seconds
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if not run.parity.passed:
            write_log_into(stage.path, f"a variant gate failed; reports kept in {vname}.failed")
            where = stage.keep_as_failed()
            return VariantResult(vname, variant.suffix, False, where, run.size, run.parity,
                                 seconds, peak)  # fmt: skip
        write_log_into(stage.path, f"every variant gate passed; publishing {out_dir / vname}")
        final = stage.commit()
    return VariantResult(vname, variant.suffix, True, final, run.size, run.parity, seconds, peak)


def variant_steps(suffix: str, cached: CachedPrograms | None) -> tuple[Step[VariantRun], ...]:
    """A variant's steps; a cached decoder's (``cached``) compress its functions too and add
    the cache gates."""
    compress, window = f"{suffix}: compress", ""
    cache: tuple[Step[VariantRun], ...] = ()
    if cached is not None:
        compress, window = f"{compress} window + {len(cached.models)} functions", " window"
        name = f"{suffix}: parity of the functions (MIL evaluator)"
        cache = (timed("kv_parity", Step(name, _cache_gates)),)
    return (
        timed("compress", Step(compress, _compress)),
        Step(f"{suffix}: records and size", _records),
        *cache,
        timed("parity", parity(f"{suffix}: parity (torch, MIL{window})")),
        Step(f"{suffix}: reports and manifest", _reports),
    )


def timed(key: str, step: Step[Any]) -> Step[Any]:
    """``step``, its time kept under ``key`` in the run's ``seconds`` (`VariantResult`)."""

    def run(state: Any, advance: Advance) -> None:
        start = time.perf_counter()
        step.run(state, advance)
        state.seconds[key] = time.perf_counter() - start

    return Step(step.name, run, step.total)


def parity(name: str) -> Step[VariantRun]:
    """The step that runs the subject's parity levels on the variant (``name``: what it says
    it compares)."""

    def measure(run: VariantRun, advance: Advance) -> None:
        run.parity = run.ctx.subject.parity(
            run.variant, run.program, run.decoded, advance, run.inspected
        )
        run.program, run.decoded = None, {}
        release_memory()

    return Step(name, measure, lambda run: int(run.ctx.subject.parity_steps))


def _compress(run: VariantRun, advance: Advance) -> None:
    """Apply the plan to the fp16 program (and to every function of a cached decoder, then
    combined into its packages, one per chunk), save the packages, copy the host files."""
    ctx, variant, method, plan = run.ctx, run.variant, run.method, run.selection.plan
    source, state = method.prepare(ctx, variant, run.source, plan)
    compressed = apply_plan(source, plan, ctx.sites)
    del source
    compressed, run.state = method.finish(ctx, variant, compressed, plan, state)
    hosts: tuple[str, ...] = ctx.subject.host_files
    if run.cached is None:  # canonical bytes: a reproducible hash
        run.package = save_package(compressed, run.directory / f"{run.vname}.mlpackage")
        run.packages = [run.package]
    else:
        run.cached.scratch.mkdir(parents=True)
        run.package = save_package(compressed, run.cached.scratch / f"{WINDOW}.mlpackage")
        run.packages, run.sizes = run.cached.compress(plan, run.directory, run.vname)
        hosts = HOST_FILES
    del compressed
    release_memory()
    for host in hosts:
        if (run.fp16_dir / host).is_file():
            shutil.copyfile(run.fp16_dir / host, run.directory / host)


def _records(run: VariantRun, advance: Advance) -> None:
    """What the gated program stores per weight, its size against the fp16 packages, each
    weight's error, live ops, what the NE would stream, what the method added; for a cached
    decoder also whether every function stores every weight as the window program does."""
    from parity.mil import load_package

    subject, method = run.ctx.subject, run.method
    assert run.package is not None
    run.program = load_package(run.package)
    function = run.program.functions["main"]
    plan, kept = run.selection.plan, run.selection.kept
    records, run.decoded = weight_records(function, run.ctx.sites, plan, kept)
    run.records = with_extra_bytes(records, method.extra_bytes(run.state))
    fp16 = {n: subject.module.get_parameter(n).detach().half().numpy() for n in run.decoded}
    run.errors = weight_errors(method.effective(run.decoded, run.state), fp16)
    run.inspected = method.inspect(function, run.state, run.selection)
    if run.cached is None:
        run.size = size_report(run.records, run.ctx.fp16_package, run.package)
        run.ops = [function_ops(function)]
        run.stream = ne_stream({run.vname: run.program})
        return
    combined = {package.name: load_package(package) for package in run.packages}
    run.odd, run.ops = run.cached.stored_alike(run.records, list(combined.values()), plan, kept)
    fp16_packages = [
        run.fp16_dir / run.cached.build.package_file(run.fp16_dir.name, i)
        for i in range(len(run.packages))
    ]
    run.size = size_report(run.records, fp16_packages, run.packages)
    run.stream = ne_stream(combined)


def _cache_gates(run: VariantRun, advance: Advance) -> None:
    """Every function per layer against the module with the decoded weights (MIL fp32), the
    cache's structural gates on the combined packages, and whether every function stores
    every weight as the window program does (before the window's parity step, which lets
    the decoded weights go)."""
    from parity.gate_registry import gate
    from parity.mil import Evaluator
    from parity.variant import evaluator_weights

    # The evaluator's own decoding (the fp32 profile keeps an int8 weight's scale * q
    # unrounded), as the window program's check gives it: the functions hold the same bytes.
    weights, _ = evaluator_weights(Evaluator(run.program, "fp32"), run.decoded)
    run.cache_gates, run.kv = run.kv_programs.build.gates(run.packages, run.sizes, weights)
    del weights
    identical = gate("kv-cache", "kv_weights_identical").check(
        float(len(run.odd)),
        implementation="package",
        where="; ".join(run.odd[:3]),
        detail=f"{len(run.records)} weights x {len(run.kv_programs.programs) + 1} programs "
        "compared",
    )
    run.cache_gates += [g for g in run.kv.gates if g.name in STRUCTURAL] + [identical]


def _reports(run: VariantRun, advance: Advance) -> None:
    """parity.json, parity.txt, parity.html (a cached decoder's kv_parity.json) and
    manifest.json."""
    assert run.size is not None
    run.parity.gates += run.cache_gates
    parity_doc, parity_txt = run.ctx.subject.report(run.parity)
    cache_doc, cache_txt = ({}, "") if run.cached is None else cache_report(run.kv, run.sizes)
    doc = parity_doc | {
        "variant": run.vname,
        "size": run.size.to_json(),
        "weight_errors": errors_json(run.errors),
        **cache_doc,
        "ne_weight_stream": run.stream,
        **run.extra,
    }
    sections = [parity_txt, cache_txt, run.size.to_text(), ne_stream_text(run.stream)]
    sections += [errors_text(run.errors), run.inspected.text if run.inspected else ""]
    write_parity_files(run.directory, doc, "\n\n".join(s for s in sections if s))
    base = Manifest.model_validate_json((run.fp16_dir / "manifest.json").read_text())
    manifest = _manifest(
        base, run.directory, run.vname, run.variant, run.packages[0], run.ops[0], run.records,
        run.size, run.method.manifest(run.variant) | run.extra, run.ctx.subject.not_compressed,
    )  # fmt: skip
    if run.cached is not None:
        write_kv_parity(run.directory, run.kv, run.sizes, gated=list(STRUCTURAL),
                        weights_differing_between_functions=run.odd)  # fmt: skip
        # every package's default function as the fp16 artifact's (decode)
        manifest = with_chunks(manifest, run.packages, run.ops, run.sizes, base.package.function)
        shutil.rmtree(run.cached.scratch)
    write_json_atomic(run.directory / "manifest.json", manifest.model_dump(mode="json"))


def ne_stream(programs: dict[str, Any]) -> dict[str, Any]:
    """Per package (name -> MIL program), the weight bytes its functions store against the
    bytes the NE would read per call (``plan.streamed``'s rules: a prediction)."""
    from converter.placement.ops import op_table
    from converter.placement.stream_rules import streamed_section

    return {name: streamed_section(op_table(program)) for name, program in programs.items()}


def ne_stream_text(stream: dict[str, Any]) -> str:
    """``ne_stream`` as parity.txt lines."""
    from converter.placement.stream_rules import streamed_lines

    lines = []
    for name, section in stream.items():
        head, *rest = streamed_lines(section)
        lines += [f"{name}: {head}", *rest]
    return "\n".join(lines)


def _manifest(
    base: Manifest,
    stage: Path,
    vname: str,
    variant: Variant,
    package: Path,
    ops: dict[str, int],
    records: list[WeightRecord],
    size: SizeReport,
    extra: dict[str, Any],
    not_compressed: str,
) -> Manifest:
    """The fp16 artifact's manifest ``base`` with this variant's name, package, report and
    records."""
    kept = [r for r in records if r.method == "fp16"]
    compression = {
        "variant": variant.model_dump(mode="json"),
        "derived_from": {
            "artifact": base.name,
            "package_content_sha256": base.package.content_sha256,
        },
        "contract": "a compressed variant changes the model (SPEC section 3): its gates are "
        "its own, measured on the held-out slice against the original checkpoint",
        "size": size.to_json(),
        "kept_fp16": {r.weight: r.kept_reason for r in kept},
        "weights": [r.to_json() for r in records],
        "not_compressed": not_compressed,
    }
    compression.update(extra)  # the method's entries, "search" (mixed), "activations" (w8a8)
    parity_path = stage / "parity.json"
    return base.model_copy(
        update={
            "name": vname,
            "package": package_entry(package, ops),
            "parity": FileEntry(file=parity_path.name, sha256=sha256_file(parity_path)),
            "compression": compression,
        }
    )
