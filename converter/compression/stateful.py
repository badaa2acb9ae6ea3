"""Compressed variants of a cached decoder: one stateful multifunction package per variant.

coremltools 9.0's ``palettize_weights`` and ``linear_quantize_weights`` refuse multifunction
packages, so each variant is built function by function and then combined:

    fp16 window program (the quality vehicle) + fp16 single-function packages (prefill,
    decode, extend) -> one plan, chosen once on the window program (a searched plan is
    searched once) -> the same plan applied to the window program and to every function
    -> every function's stored weight bytes compared with the window program's
    -> combined into one multifunction package (``ct.utils.save_multifunction`` stores a
    blob that several functions hold byte for byte once) -> gates -> published

Only methods whose stored values are a function of the weight and its scheme alone are
allowed here (``kv_cache`` in ``compress/methods``): coremltools' k-means (kmeans1d, or
scikit-learn with a fixed seed) and affine int8 give the same bytes for the same fp16 weight,
so the one plan gives identical weights in every function. That is measured, not assumed:
``kv_weights_identical`` counts the weights whose stored payload differs between any function
and the window program, gated at 0, and ``kv_weights_stored_once`` gates the combined
package's weight file at 1.05x the largest single function's.

Gates of a variant: quality is the compression gates (``compress.decoder.DecoderSubject``:
torch fp16 with the decoded weights, and the window program with byte-identical weights in
the MIL evaluator, on the held-out slice, against the original checkpoint); the cache adds
the fp32 cache level against the window module holding the decoded weights (`parity.kv_fp32`)
and its structural fp16 gates on the combined package (finite outputs, extend vs decode,
stale slots, weights stored once), which hold exactly as for the fp16 package. The fp16
package's fidelity gates against the original (``kv_max_abs_dprob``, ``kv_argmax_flips``)
measure the fp16 program's fidelity; a compressed variant changes the model, so they are
reported in ``kv_parity.json`` and not gated (SPEC section 3).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from converter.compression import methods
from converter.compression.emit import (
    VariantResult,
    VariantRun,
    _manifest,
    ne_stream,
    ne_stream_text,
    parity,
    publish_variant,
    timed,
    write_reports,
)
from converter.compression.methods.base import BuildContext
from converter.compression.records import WeightRecord, weight_records
from converter.compression.schemes import apply_plan
from converter.compression.sites import WeightSite, weight_sites
from converter.compression.size import size_report
from converter.compression.weight_error import errors_json, errors_text, weight_errors
from converter.coreml.program import save_package
from converter.errors import InputError
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.steps import Advance, Step
from converter.recipe.compression_section import Compression

# The cache gates that hold for a compressed variant exactly as for the fp16 package.
STRUCTURAL = (
    "kv_finite_outputs",
    "kv_extend_argmax_flips",
    "kv_stale_max_abs_diff",
    "kv_weights_stored_once",
)
HOST_FILES = ("embeddings.npy", "tokenizer.json", "rope.npy", "head_ids.npy")
WINDOW = "window"  # the window program's entry in the identical-weights comparison


@dataclass
class KvBuild:
    """What the cached task hands in: how to make the fp16 programs again (the published
    artifact holds only the combined package) and how to gate a combined package.

    ``singles(folder)`` saves one fp16 single-function package per function of each chunk
    package (one chunk without a weight budget) under ``folder``; ``window(path)`` saves the
    fp16 window program (the same weights, markers on its layer outputs) as ``path``;
    ``gates(packages, sizes, weights)`` runs, on the chunk packages in call order, the
    per-layer MIL fp32 gate of every function against the module holding ``weights`` (the
    variant's decoded weights) and the cache gates (`KvParity`);
    ``package_file(name, i)`` names chunk ``i``'s package of artifact ``name``.
    ``parameters`` are the window module's parameter names."""

    singles: Callable[[Path], list[dict[str, Path]]]
    window: Callable[[Path], Path]
    gates: Callable[[list[Path], list[dict[str, Any]], dict[str, Any]], tuple[list[Any], Any]]
    combine: Callable[[dict[str, Path], Path], dict[str, Any]]
    parameters: list[str]
    package_file: Callable[[str, int], str]


def function_sites(function: Any, parameters: list[str]) -> list[WeightSite]:
    """The weight sites of one function under the window module's parameter names (a cached
    module holds the window module as ``window``, so its constants may carry that prefix)."""
    names = list(parameters) + [f"window.{n}" for n in parameters]
    sites = weight_sites(function, names)
    out = []
    for s in sites:
        name = s.name[len("window.") :] if s.name.startswith("window.") else s.name
        out.append(WeightSite(name, s.const, s.shape, s.dtype))
    return out


def payloads(records: list[WeightRecord]) -> dict[str, str]:
    """Each weight's stored-payload sha256."""
    return {r.weight: r.payload_sha256 for r in records}


def differing(
    stored: dict[str, dict[str, str]], chunk_of: dict[str, int] | None = None
) -> list[str]:
    """Weights whose stored payload differs between the programs in ``stored`` (program name
    -> weight -> sha256), or that a program lacks while another function of its package holds
    it (``chunk_of``: a function program's package index; one package when not given), as
    ``weight (programs)`` lines."""
    chunk_of = chunk_of or {}
    names = sorted({w for per in stored.values() for w in per})
    out = []
    for weight in names:
        holders = {program: per[weight] for program, per in stored.items() if weight in per}
        owning = {chunk_of.get(p, 0) for p in holders if p != WINDOW}
        odd = {p for p, h in holders.items() if h != holders.get(WINDOW)}
        odd |= {
            p
            for p in stored
            if p not in holders and (p == WINDOW or chunk_of.get(p, 0) in owning or not owning)
        }
        if odd:
            out.append(f"{weight} ({', '.join(sorted(odd))})")
    return out


def check_methods(compression: Compression) -> None:
    """Refuse, before anything is built, a method this module cannot carry into every
    function (the recipe rule says so at validate time too)."""
    kv = methods.kv_methods()
    for i, variant in enumerate(compression.variants):
        if variant.method not in kv:
            raise InputError(
                f"compression.variants[{i}].method: {variant.method} variants of a cached "
                f"decoder are not implemented; use one of {', '.join(kv)}"
            )


def program_labels(singles: list[dict[str, Path]]) -> dict[str, tuple[int, str, Path]]:
    """Each fp16 single-function package by its label in the reports: the function's name
    (``decode``) for one package, ``chunk<i>.<function>`` for each chunk of several."""
    return {
        (f if len(singles) == 1 else f"chunk{i}.{f}"): (i, f, path)
        for i, chunk in enumerate(singles)
        for f, path in chunk.items()
    }


def emit_kv_variants(
    compression: Compression,
    name: str,
    fp16_dir: Path,
    subject: Any,
    build: KvBuild,
    out_dir: Path,
    force: bool = False,
    steps: Steps | None = None,
) -> list[VariantResult]:
    """Build, gate and publish every variant of a cached decoder (in recipe order) of the
    published fp16 artifact ``fp16_dir``; ``subject`` is the window decoder's
    (`compress.decoder.DecoderSubject`)."""
    import coremltools as ct

    from parity.mil import load_package

    check_methods(compression)
    steps = steps or Steps(quiet=True)
    # Named as the publisher names temp entries, so a killed run's scratch is removed by the
    # next run's `clean_leftovers` (the pid in the name is dead).
    scratch = out_dir / f".anec-tmp-{name}-kvcomp-{os.getpid()}-{secrets.token_hex(4)}"
    scratch.mkdir(parents=True)
    try:
        with steps.step("compression: fp16 programs (window, prefill, decode, extend)"):
            window = build.window(scratch / "window.mlpackage")
            singles = build.singles(scratch / "fp16")
        with steps.step("compression: fp16 baselines", total=subject.baseline_steps) as advance:
            program = load_package(window)
            sites = weight_sites(program.functions["main"], build.parameters)
            subject.baselines(program, advance)
            del program
        programs = program_labels(singles)
        fsites = {
            label: function_sites(load_package(p).functions["main"], build.parameters)
            for label, (_, _, p) in programs.items()
        }
        models = {WINDOW: ct.models.MLModel(str(window), skip_model_load=True)} | {
            label: ct.models.MLModel(str(p), skip_model_load=True)
            for label, (_, _, p) in programs.items()
        }
        results = []
        for variant in compression.variants:
            keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
            ctx = BuildContext(subject, sites, keep, compression.min_weight_elements, window, steps)
            vname = f"{name}-{variant.suffix}"
            start = partial(
                KvVariantRun, ctx, variant, vname, fp16_dir, build=build,
                scratch=scratch / variant.suffix, models=models, programs=programs, fsites=fsites,
            )  # fmt: skip
            own = kv_steps(variant.suffix, len(models) - 1)
            results.append(publish_variant(ctx, variant, vname, start, own, out_dir, force))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


@dataclass
class KvVariantRun(VariantRun):
    """A cached decoder's variant in progress: the plan goes to the window program and to
    every function of every chunk package, which are then combined."""

    build: KvBuild | None = None
    scratch: Path | None = None  # where the compressed single-function packages go
    models: dict[str, Any] = field(default_factory=dict)  # fp16 MLModels by program label
    programs: dict[str, tuple[int, str, Path]] = field(default_factory=dict)  # `program_labels`
    fsites: dict[str, list[WeightSite]] = field(default_factory=dict)
    packages: list[Path] = field(default_factory=list)  # the combined packages, call order
    sizes: list[dict[str, Any]] = field(default_factory=list)
    decode_ops: list[dict[str, int]] = field(default_factory=list)
    odd: list[str] = field(default_factory=list)  # weights stored differently somewhere
    kv: Any = None  # the cache gates (`KvParity`)
    cache_gates: list[Any] = field(default_factory=list)  # gated: per layer, structural

    @property
    def kv_build(self) -> KvBuild:
        """How the cached task builds and gates packages."""
        assert self.build is not None
        return self.build


def _kv_compress(run: KvVariantRun, advance: Advance) -> None:
    """The one plan applied to the window program and to every function, each saved in the
    scratch folder, then the functions combined into the variant's packages (one per chunk)
    beside the fp16 artifact's host files."""
    assert run.scratch is not None
    run.scratch.mkdir(parents=True)
    plan, built = run.selection.plan, {}
    for label, model in run.models.items():
        own = run.ctx.sites if label == WINDOW else run.fsites[label]
        names = {s.name for s in own}  # a chunk's programs hold only its own layers
        part = {n: scheme for n, scheme in plan.items() if n in names}
        path = run.scratch / f"{label}.mlpackage"
        built[label] = save_package(apply_plan(model, part, own), path)
    for i in range(1 + max(i for i, _, _ in run.programs.values())):
        functions = {f: built[label] for label, (j, f, _) in run.programs.items() if j == i}
        run.packages.append(run.directory / run.kv_build.package_file(run.vname, i))
        run.sizes.append(run.kv_build.combine(functions, run.packages[-1]))
    run.package = built[WINDOW]  # the quality vehicle; the published packages are combined
    for host in HOST_FILES:
        if (run.fp16_dir / host).is_file():
            shutil.copyfile(run.fp16_dir / host, run.directory / host)


def _kv_records(run: KvVariantRun, advance: Advance) -> None:
    """Each program's stored payloads by weight (the window program's and every function's
    of every combined package), the size against the fp16 packages, each weight's error
    and what the NE would stream."""
    from parity.mil import load_package

    assert run.package is not None
    plan, kept = run.selection.plan, run.selection.kept
    run.program = load_package(run.package)
    run.records, run.decoded = weight_records(run.program.functions["main"], run.ctx.sites,
                                              plan, kept)  # fmt: skip
    stored = {WINDOW: payloads(run.records)}
    programs = {package.name: load_package(package) for package in run.packages}
    for i, combined in enumerate(programs.values()):
        for label, (j, f, _) in run.programs.items():
            if j == i:
                per, _ = weight_records(combined.functions[f], run.fsites[label], plan, kept)
                stored[label] = payloads(per)
        run.decode_ops.append(decode_ops(combined))
    run.odd = differing(stored, {label: i for label, (i, _, _) in run.programs.items()})
    fp16_packages = [
        run.fp16_dir / run.kv_build.package_file(run.fp16_dir.name, i)
        for i in range(len(run.packages))
    ]
    run.size = size_report(run.records, fp16_packages, run.packages)
    module = run.ctx.subject.module
    fp16 = {n: module.get_parameter(n).detach().half().numpy() for n in run.decoded}
    run.errors = weight_errors(run.decoded, fp16)
    run.stream = ne_stream(programs)


def _kv_gates(run: KvVariantRun, advance: Advance) -> None:
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
    run.cache_gates, run.kv = run.kv_build.gates(run.packages, run.sizes, weights)
    del weights
    identical = gate("kv-cache", "kv_weights_identical").check(
        float(len(run.odd)),
        implementation="package",
        where="; ".join(run.odd[:3]),
        detail=f"{len(run.records)} weights x {len(run.programs) + 1} programs compared",
    )
    run.cache_gates += [g for g in run.kv.gates if g.name in STRUCTURAL] + [identical]


def _kv_reports(run: KvVariantRun, advance: Advance) -> None:
    """parity.json, parity.txt, kv_parity.json and the manifest with its chunk section."""
    assert run.size is not None and run.scratch is not None
    run.parity.gates += run.cache_gates
    doc, text = parity_reports(
        run.ctx.subject, run.parity, run.kv, run.sizes, run.size, run.errors, run.stream,
        run.selection.doc,
    )  # fmt: skip
    write_reports(run.directory, doc | {"variant": run.vname}, text)
    write_json_atomic(run.directory / "kv_parity.json", kv_json(run.kv, run.sizes, run.odd))
    manifest = _manifest(
        run.fp16_dir, run.directory, run.vname, run.variant, run.packages[0], run.decode_ops[0],
        run.records, run.size, run.method.manifest(run.variant) | run.selection.doc,
        run.ctx.subject.not_compressed,
    )  # fmt: skip
    fp16_doc = json.loads((run.fp16_dir / "manifest.json").read_text(encoding="utf-8"))
    function = fp16_doc["package"]["function"]  # the packages' default function
    manifest = with_chunks(manifest, run.packages, run.decode_ops, run.sizes, function)
    write_json_atomic(run.directory / "manifest.json", manifest.model_dump(mode="json"))
    shutil.rmtree(run.scratch)


def kv_steps(suffix: str, functions: int) -> tuple[Step[Any], ...]:
    """A cached decoder's variant's steps."""
    return (
        timed("compress", Step(f"{suffix}: compress window + {functions} functions", _kv_compress)),
        Step(f"{suffix}: records and size", _kv_records),
        timed("kv_parity", Step(f"{suffix}: parity of the functions (MIL evaluator)", _kv_gates)),
        timed("parity", parity(f"{suffix}: parity (torch, MIL window)")),
        Step(f"{suffix}: reports and manifest", _kv_reports),
    )


def with_chunks(
    manifest: Any,
    packages: list[Path],
    ops: list[dict[str, int]],
    sizes: list[dict[str, Any]],
    function: str,
) -> Any:
    """The variant's manifest naming its own packages and sizes where the fp16 artifact's
    named its own: ``kv_cache.sizes`` for one package; for chunks, each chunk's package and
    sizes, the call order, ``extra_packages`` and the pieces' files; every package's default
    ``function`` as the fp16 artifact's (decode)."""
    from converter.pipeline.manifest_fields import package_entry

    kv = dict(manifest.kv_cache or {})
    manifest.package.function = function
    if len(packages) == 1:
        return manifest.model_copy(update={"kv_cache": kv | {"sizes": sizes[0]}})
    files = [p.name for p in packages]
    kv["chunks"] = [
        dict(entry) | {"package": file, "sizes": size}
        for entry, file, size in zip(kv["chunks"], files, sizes, strict=True)
    ]
    kv["chunking"] = dict(kv["chunking"]) | {"call_order": files}
    kv["sizes"] = dict(kv["sizes"]) | {
        "package_bytes": sum(s["multifunction_package_bytes"] for s in sizes),
        "weight_bytes": sum(s["multifunction_weight_bytes"] for s in sizes),
    }
    extra = [package_entry(p, o) for p, o in zip(packages[1:], ops[1:], strict=True)]
    for entry in extra:
        entry.function = function
    pieces = [
        piece.model_copy(update={"files": [file]})
        for piece, file in zip(manifest.pieces or [], files, strict=True)
    ]
    return manifest.model_copy(update={"kv_cache": kv, "extra_packages": extra, "pieces": pieces})


def decode_ops(program: Any) -> dict[str, int]:
    """Live op counts of the default (decode) function, as the fp16 manifest records them."""
    counts: dict[str, int] = {}
    for op in program.functions["decode"].operations:
        if op.op_type != "const":
            counts[op.op_type] = counts.get(op.op_type, 0) + 1
    return dict(sorted(counts.items()))


def _one(sizes: list[dict[str, Any]]) -> Any:
    """Sizes as the fp16 artifact reports them: one package's dict, or a list per chunk."""
    return sizes[0] if len(sizes) == 1 else sizes


def kv_json(kv: Any, sizes: list[dict[str, Any]], odd: list[str]) -> dict[str, Any]:
    """kv_parity.json of a variant: every cache gate as measured (the fidelity gates against
    the original reported, not gated: see the module docstring), flips, sizes."""
    return {
        "gated": list(STRUCTURAL),
        "gates": [g.to_json() for g in kv.gates],
        "flips": kv.flips,
        "fixtures": kv.rows,
        "fp16_logit_error": kv.drift.to_json() if kv.drift is not None else None,
        "sizes": _one(sizes),
        "weights_differing_between_functions": odd,
    }


def parity_reports(
    subject: Any,
    parity: Any,
    kv: Any,
    sizes: list[dict[str, Any]],
    size: Any,
    errors: Any,
    stream: dict[str, Any],
    extra: dict[str, Any],
) -> tuple[dict[str, Any], str]:
    """The variant's parity.json content and parity.txt (``stream``: ``emit.ne_stream``)."""
    doc, text = subject.report(parity)
    reported = [g for g in kv.gates if g.name not in STRUCTURAL]
    lines = [
        "cache (MIL evaluator fp16, through the package's functions): structural gates above; "
        "reported, not gated (the fp16 program's fidelity gates; a variant changes the model):"
    ] + [f"  {g.name}: {g.value:.6g} (fp16 threshold {g.threshold:g})" for g in reported]
    for i, per in enumerate(sizes):
        where = f" (package {i})" if len(sizes) > 1 else ""
        lines.append(
            f"weights stored once{where}: multifunction weight file "
            f"{per['multifunction_weight_bytes']:,} bytes = {per['weight_ratio']:.4f}x the "
            "largest single function's"
        )
    doc = doc | {
        "size": size.to_json(),
        "weight_errors": errors_json(errors),
        "kv_cache": {"reported": [g.to_json() for g in reported], "sizes": _one(sizes)},
        "ne_weight_stream": stream,
        **extra,
    }
    streamed = ne_stream_text(stream)
    sections = [text, "\n".join(lines), size.to_text(), streamed, errors_text(errors)]
    return doc, "\n\n".join(s for s in sections if s)
