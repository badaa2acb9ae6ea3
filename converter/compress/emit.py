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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from converter.compress import methods
from converter.compress.methods.base import BuildContext, Subject
from converter.compress.records import WeightRecord, weight_records, with_extra_bytes
from converter.compress.schemes import apply_plan
from converter.compress.sites import weight_sites
from converter.compress.size import SizeReport, size_report
from converter.compress.weight_error import errors_json, errors_text, weight_errors
from converter.coreml import save_package
from converter.errors import InputError
from converter.hashing import mlpackage_content_files, mlpackage_content_hash, sha256_file
from converter.manifest import FileEntry, Manifest, PackageEntry
from converter.progress import Steps
from converter.publish import stage_artifact, write_json_atomic, write_text_atomic
from converter.recipe.compression import Compression, Variant
from converter.runlog import write_log_into
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
    from converter.plan.ops import op_table
    from converter.plan.streamed import streamed_section

    return {name: streamed_section(op_table(program)) for name, program in programs.items()}


def ne_stream_text(stream: dict[str, Any]) -> str:
    """``ne_stream`` as parity.txt lines."""
    from converter.plan.streamed import streamed_lines

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
    from converter.compress.decoder import DecoderSubject

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
        results.append(_emit_one(ctx, variant, name, fp16_dir, mlmodel, out_dir, force))
    return results


def _emit_one(
    ctx: BuildContext,
    variant: Variant,
    name: str,
    fp16_dir: Path,
    mlmodel: Any,
    out_dir: Path,
    force: bool,
) -> VariantResult:
    from parity.mil import load_package

    subject, sites, steps = ctx.subject, ctx.sites, ctx.progress
    method = methods.get(variant.method)
    vname = f"{name}-{variant.suffix}"
    seconds: dict[str, float] = {}
    with stage_artifact(out_dir, vname, force=force) as stage:
        selection = method.select(ctx, variant)
        seconds.update(selection.seconds)
        plan, kept = selection.plan, selection.kept
        with steps.step(f"{variant.suffix}: compress"):
            start = time.perf_counter()
            source, state = method.prepare(ctx, variant, mlmodel, plan)
            compressed = apply_plan(source, plan, sites)
            del source
            compressed, state = method.finish(ctx, variant, compressed, plan, state)
            path = stage.path / f"{vname}.mlpackage"
            save_package(compressed, path)  # canonical bytes: a reproducible hash
            del compressed
            release_memory()
            for host in subject.host_files:
                if (fp16_dir / host).is_file():
                    shutil.copyfile(fp16_dir / host, stage.path / host)
            seconds["compress"] = time.perf_counter() - start
        with steps.step(f"{variant.suffix}: records and size"):
            program = load_package(path)
            function = program.functions["main"]
            records, decoded = weight_records(function, sites, plan, kept)
            records = with_extra_bytes(records, method.extra_bytes(state))
            size = size_report(records, fp16_dir / f"{name}.mlpackage", path)
            fp16 = {n: subject.module.get_parameter(n).detach().half().numpy() for n in decoded}
            errors = weight_errors(method.effective(decoded, state), fp16)
            ops = _live_ops(program)
            stream = ne_stream({vname: program})
            inspected = method.inspect(function, state, selection)
            extra = selection.doc | (inspected.doc if inspected is not None else {})

        with steps.step(
            f"{variant.suffix}: parity (torch, MIL)", total=subject.parity_steps
        ) as advance:
            start = time.perf_counter()
            parity = subject.parity(variant, program, decoded, advance, inspected)
            seconds["parity"] = time.perf_counter() - start
        del program, decoded
        release_memory()
        parity_doc, parity_txt = subject.report(parity)
        doc = parity_doc | {
            "variant": vname,
            "size": size.to_json(),
            "weight_errors": errors_json(errors),
            "ne_weight_stream": stream,
            **extra,
        }
        act_text = inspected.text if inspected is not None else ""
        sections = [parity_txt, size.to_text(), ne_stream_text(stream), errors_text(errors)]
        sections.append(act_text)
        text = "\n\n".join(s for s in sections if s)
        write_reports(stage.path, doc, text)
        manifest = _manifest(
            fp16_dir, stage.path, vname, variant, path, ops, records, size,
            method.manifest(variant) | extra, subject.not_compressed,
        )  # fmt: skip
        write_json_atomic(stage.path / "manifest.json", manifest.model_dump(mode="json"))
        peak = _peak_rss_mib()
        if not parity.passed:
            write_log_into(stage.path, f"a variant gate failed; reports kept in {vname}.failed")
            where = stage.keep_as_failed()
            return VariantResult(vname, variant.suffix, False, where, size, parity, seconds, peak)
        write_log_into(stage.path, f"every variant gate passed; publishing {out_dir / vname}")
        final = stage.commit()
    return VariantResult(vname, variant.suffix, True, final, size, parity, seconds, peak)


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
            "package": PackageEntry(
                file=package.name,
                content_sha256=mlpackage_content_hash(package),
                files=mlpackage_content_files(package),
                function="main",
                live_ops=ops,
            ),
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
