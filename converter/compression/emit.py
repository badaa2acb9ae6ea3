"""Emit every compressed variant of a converted model as its own artifact ``OUT/<name>-<suffix>/``.

What differs between methods (``lut``, ``int8``, ``w8a8``, ``mixed``) lives in their modules
(``compress/methods/``); what differs between a decoder and an encoder - what a variant is
compared on, its baselines and gates - in the `Subject` handed in (``compress.decoder``,
``compress.encoder``). This module only runs the steps in order.

Runs after the fp16 artifact is published. Each variant is built from the fp16 package, saved
into its own staging directory with the host files it needs (embeddings, tokenizer), measured
(size, torch and MIL-level parity) and published only when its own gates pass; otherwise its
reports stay in ``OUT/<name>-<suffix>.failed/``. A failing variant blocks only itself.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from converter.compression import methods
from converter.compression.methods.base import BuildContext, Inspected, Selection, Subject
from converter.compression.records import WeightRecord, weight_records, with_extra_bytes
from converter.compression.schemes import apply_plan
from converter.compression.sites import weight_sites
from converter.compression.size import SizeReport, size_report
from converter.compression.weight_error import errors_json, errors_text, weight_errors
from converter.coreml.program import save_package
from converter.errors import InputError
from converter.pipeline.hashing import sha256_file
from converter.pipeline.manifest import FileEntry, Manifest
from converter.pipeline.manifest_fields import package_entry
from converter.pipeline.progress import Steps
from converter.pipeline.publish import stage_artifact, write_json_atomic, write_text_atomic
from converter.pipeline.runlog import write_log_into
from converter.pipeline.steps import Advance, Step, run_steps
from converter.recipe.compression_section import Compression, Variant
from graph_passes.decoder import BC1LDecoder
from parity.compression_gates import HeldOut
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit_variants(
    compression: Compression,
    name: str,
    fp16_dir: Path,
    module: BC1LDecoder,
    embed_table: torch.Tensor,
    held_out: HeldOut,
    out_dir: Path,
    mil_fp32_threshold: float,
    force: bool = False,
    steps: Steps | None = None,
) -> list[VariantResult]:
    """Build, measure and publish every variant of a decoder (in recipe order)."""
    from converter.compression.decoder_variants import DecoderSubject

    subject = DecoderSubject(
        module, embed_table, held_out, mil_fp32_threshold, acceptance=compression.acceptance
    )
    return emit(compression, name, fp16_dir, subject, out_dir, force, steps)


def emit(
    compression: Compression,
    name: str,
    fp16_dir: Path,
    subject: Subject,
    out_dir: Path,
    force: bool = False,
    steps: Steps | None = None,
) -> list[VariantResult]:
    """Build, measure and publish every variant of ``compression`` (in recipe order) of the
    single-program artifact ``fp16_dir``; ``subject`` says what the variants are compared on."""
    import coremltools as ct

    from parity.mil import load_package

    steps = steps or Steps(quiet=True)
    for i, variant in enumerate(compression.variants):
        tasks = methods.get(variant.method).tasks
        if tasks is not None and subject.task not in tasks:
            raise InputError(
                f"compression.variants[{i}].method: {variant.method} is implemented for "
                f"{', '.join(sorted(tasks))} only, not {subject.task}"
            )
    package = fp16_dir / f"{name}.mlpackage"
    if not package.is_dir():
        raise FileNotFoundError(f"{package}: no single-program artifact to compress")
    mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
    with steps.step("compression: fp16 baselines", total=subject.baseline_steps) as advance:
        program = load_package(package)
        sites = weight_sites(program.functions["main"], dict(subject.module.named_parameters()))
        subject.baselines(program, advance)
        del program
    release_memory()
    results = []
    for variant in compression.variants:
        keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
        ctx = BuildContext(subject, sites, keep, compression.min_weight_elements, package, steps)
        vname = f"{name}-{variant.suffix}"
        start = partial(VariantRun, ctx, variant, vname, fp16_dir, source=mlmodel)
        own = single_program_steps(variant.suffix)
        results.append(publish_variant(ctx, variant, vname, start, own, out_dir, force))
    return results


@dataclass
class VariantRun:
    """One compressed variant in progress: what its steps (`converter.pipeline.steps`) read and
    add.
    """

    ctx: BuildContext
    variant: Variant
    vname: str  # the variant artifact's name: <artifact>-<suffix>
    fp16_dir: Path  # the published fp16 artifact it is derived from
    directory: Path  # its staging directory
    selection: Selection
    source: Any = None  # the fp16 MLModel its package is built from (single-program)
    state: Any = None  # the method's own state between prepare, finish and inspect
    package: Path | None = None  # its (first) package
    program: Any = None  # the program whose quality is gated (the window program's variant)
    records: list[WeightRecord] = field(default_factory=list)
    decoded: dict[str, Any] = field(default_factory=dict)
    size: SizeReport | None = None
    errors: list[Any] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    stream: dict[str, Any] = field(default_factory=dict)
    inspected: Inspected | None = None
    parity: Any = None  # the subject's parity result: .gates (GateResult), .passed
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
        peak = _peak_rss_mib()
        if not run.parity.passed:
            write_log_into(stage.path, f"a variant gate failed; reports kept in {vname}.failed")
            where = stage.keep_as_failed()
            return VariantResult(vname, variant.suffix, False, where, run.size, run.parity,
                                 seconds, peak)  # fmt: skip
        write_log_into(stage.path, f"every variant gate passed; publishing {out_dir / vname}")
        final = stage.commit()
    return VariantResult(vname, variant.suffix, True, final, run.size, run.parity, seconds, peak)


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
    """Apply the plan to the fp16 program, save the package, copy the host files."""
    ctx, variant, method, plan = run.ctx, run.variant, run.method, run.selection.plan
    source, state = method.prepare(ctx, variant, run.source, plan)
    compressed = apply_plan(source, plan, ctx.sites)
    del source
    compressed, run.state = method.finish(ctx, variant, compressed, plan, state)
    run.package = run.directory / f"{run.vname}.mlpackage"
    save_package(compressed, run.package)  # canonical bytes: a reproducible hash
    del compressed
    release_memory()
    for host in ctx.subject.host_files:
        if (run.fp16_dir / host).is_file():
            shutil.copyfile(run.fp16_dir / host, run.directory / host)


def _records(run: VariantRun, advance: Advance) -> None:
    """What the package stores per weight, its size against the fp16 package's, each
    weight's error, live ops, what the NE would stream, and what the method added."""
    from parity.mil import load_package

    subject, method = run.ctx.subject, run.method
    assert run.package is not None
    run.program = load_package(run.package)
    function = run.program.functions["main"]
    plan, kept = run.selection.plan, run.selection.kept
    records, run.decoded = weight_records(function, run.ctx.sites, plan, kept)
    run.records = with_extra_bytes(records, method.extra_bytes(run.state))
    run.size = size_report(run.records, run.ctx.fp16_package, run.package)
    fp16 = {n: subject.module.get_parameter(n).detach().half().numpy() for n in run.decoded}
    run.errors = weight_errors(method.effective(run.decoded, run.state), fp16)
    run.ops = _live_ops(run.program)
    run.stream = ne_stream({run.vname: run.program})
    run.inspected = method.inspect(function, run.state, run.selection)


def _reports(run: VariantRun, advance: Advance) -> None:
    """parity.json, parity.txt and manifest.json of the variant."""
    assert run.size is not None and run.package is not None
    parity_doc, parity_txt = run.ctx.subject.report(run.parity)
    doc = parity_doc | {
        "variant": run.vname,
        "size": run.size.to_json(),
        "weight_errors": errors_json(run.errors),
        "ne_weight_stream": run.stream,
        **run.extra,
    }
    sections = [parity_txt, run.size.to_text(), ne_stream_text(run.stream)]
    sections += [errors_text(run.errors), run.inspected.text if run.inspected else ""]
    write_reports(run.directory, doc, "\n\n".join(s for s in sections if s))
    manifest = _manifest(
        run.fp16_dir, run.directory, run.vname, run.variant, run.package, run.ops, run.records,
        run.size, run.method.manifest(run.variant) | run.extra, run.ctx.subject.not_compressed,
    )  # fmt: skip
    write_json_atomic(run.directory / "manifest.json", manifest.model_dump(mode="json"))


def single_program_steps(suffix: str) -> tuple[Step[VariantRun], ...]:
    """A single-program variant's steps (window decoder, encoder)."""
    return (
        timed("compress", Step(f"{suffix}: compress", _compress)),
        Step(f"{suffix}: records and size", _records),
        timed("parity", parity(f"{suffix}: parity (torch, MIL)")),
        Step(f"{suffix}: reports and manifest", _reports),
    )


def _manifest(
    fp16_dir: Path,
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
    """The fp16 artifact's manifest with this variant's name, package, report and records."""
    base = Manifest.model_validate(json.loads((fp16_dir / "manifest.json").read_text()))
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


def _live_ops(program: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in program.functions["main"].operations:
        if op.op_type != "const":
            counts[op.op_type] = counts.get(op.op_type, 0) + 1
    return dict(sorted(counts.items()))


def write_reports(directory: Path, doc: dict[str, Any], text: str) -> None:
    """``parity.json`` and ``parity.txt`` of a variant, atomically."""
    write_json_atomic(directory / "parity.json", doc)
    write_text_atomic(directory / "parity.txt", text + "\n")
