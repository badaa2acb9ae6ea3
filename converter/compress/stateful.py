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
its structural gates on the combined package (finite outputs, extend vs decode, stale slots,
weights stored once), which hold exactly as for the fp16 package. The fp16 package's
logit-error gates against the original (``kv_max_abs_logit_error``, ``kv_max_abs_dprob``,
``kv_argmax_flips``) measure the fp16 program's fidelity; a compressed variant changes the
model, so they are reported in ``kv_parity.json`` and not gated (SPEC section 3).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.compress import methods
from converter.compress.emit import (
    VariantResult,
    _manifest,
    _peak_rss_mib,
    ne_stream,
    ne_stream_text,
    write_reports,
)
from converter.compress.methods.base import BuildContext, Scheme
from converter.compress.records import WeightRecord, weight_records
from converter.compress.schemes import apply_plan
from converter.compress.sites import WeightSite, weight_sites
from converter.compress.size import size_report
from converter.compress.weight_error import errors_json, errors_text, weight_errors
from converter.coreml import save_package
from converter.errors import InputError
from converter.progress import Steps
from converter.publish import stage_artifact, write_json_atomic
from converter.recipe.compression import Compression, Variant
from converter.runlog import write_log_into

# The cache gates that hold for a compressed variant exactly as for the fp16 package.
STRUCTURAL = (
    "kv_finite_outputs",
    "kv_extend_max_abs_diff",
    "kv_extend_argmax_flips",
    "kv_stale_max_abs_diff",
    "kv_weights_stored_once",
)
HOST_FILES = ("embeddings.npy", "tokenizer.json", "rope.npy")
WINDOW = "window"  # the window program's entry in the identical-weights comparison


@dataclass
class KvBuild:
    """What the cached task hands in: how to make the fp16 programs again (the published
    artifact holds only the combined package) and how to gate a combined package.

    ``singles(folder)`` saves one fp16 single-function package per function of each chunk
    package (one chunk without a weight budget) under ``folder``; ``window(path)`` saves the
    fp16 window program (the same weights, markers on its layer outputs) as ``path``;
    ``gates(packages, sizes)`` runs the cache gates on the chunk packages in call order
    (`KvParity`); ``package_file(name, i)`` names chunk ``i``'s package of artifact ``name``.
    ``parameters`` are the window module's parameter names."""

    singles: Callable[[Path], list[dict[str, Path]]]
    window: Callable[[Path], Path]
    gates: Callable[[list[Path], list[dict[str, Any]]], Any]
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
            one = _KvVariant(ctx, variant, name, fp16_dir, scratch / variant.suffix, build)
            results.append(one.emit(models, programs, sites, fsites, out_dir, force))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


@dataclass
class _KvVariant:
    ctx: BuildContext
    variant: Variant
    name: str
    fp16_dir: Path
    scratch: Path
    build: KvBuild

    def compress_all(
        self,
        models: dict[str, Any],
        plan: dict[str, Scheme],
        sites: list[WeightSite],
        fsites: dict[str, list[WeightSite]],
    ) -> dict[str, Path]:
        """The one plan applied to the window program and to every function, each saved as
        its own package in the scratch folder (window first)."""
        self.scratch.mkdir(parents=True)
        out = {}
        for program, model in models.items():
            own = sites if program == WINDOW else fsites[program]
            names = {s.name for s in own}  # a chunk's programs hold only its own layers
            part = {n: scheme for n, scheme in plan.items() if n in names}
            out[program] = save_package(
                apply_plan(model, part, own), self.scratch / f"{program}.mlpackage"
            )
        return out

    @staticmethod
    def stored(
        records: list[WeightRecord],
        packages: list[Path],
        programs: dict[str, tuple[int, str, Path]],
        fsites: dict[str, list[WeightSite]],
        plan: dict[str, Scheme],
        kept: dict[str, str],
    ) -> tuple[dict[str, dict[str, str]], list[dict[str, int]]]:
        """Each program's stored payloads by weight (the window program's ``records`` and
        every function of every combined package), and each package's decode live ops."""
        from parity.mil import load_package

        stored = {WINDOW: payloads(records)}
        ops = []
        for i, package in enumerate(packages):
            combined = load_package(package)
            for label, (j, f, _) in programs.items():
                if j == i:
                    per, _ = weight_records(combined.functions[f], fsites[label], plan, kept)
                    stored[label] = payloads(per)
            ops.append(decode_ops(combined))
        return stored, ops

    def combine(
        self,
        built: dict[str, Path],
        programs: dict[str, tuple[int, str, Path]],
        directory: Path,
        vname: str,
    ) -> tuple[list[Path], list[dict[str, Any]]]:
        """The compressed functions combined into the variant's packages (one per chunk) in
        ``directory``, with the fp16 artifact's host files beside them; packages and sizes."""
        packages, sizes = [], []
        for i in range(1 + max(i for i, _, _ in programs.values())):
            functions = {f: built[label] for label, (j, f, _) in programs.items() if j == i}
            packages.append(directory / self.build.package_file(vname, i))
            sizes.append(self.build.combine(functions, packages[-1]))
        for host in HOST_FILES:
            if (self.fp16_dir / host).is_file():
                shutil.copyfile(self.fp16_dir / host, directory / host)
        return packages, sizes

    def write_manifest(
        self,
        directory: Path,
        vname: str,
        packages: list[Path],
        ops: list[dict[str, int]],
        sizes: list[dict[str, Any]],
        records: list[WeightRecord],
        size: Any,
        extra: dict[str, Any],
    ) -> None:
        """The variant's manifest: the fp16 artifact's, with this variant's packages, weights
        and compression, and its chunk section."""
        manifest = _manifest(
            self.fp16_dir, directory, vname, self.variant, packages[0], ops[0], records, size,
            extra, self.ctx.subject.not_compressed,
        )  # fmt: skip
        fp16_doc = json.loads((self.fp16_dir / "manifest.json").read_text(encoding="utf-8"))
        function = fp16_doc["package"]["function"]  # the packages' default function
        manifest = with_chunks(manifest, packages, ops, sizes, function)
        write_json_atomic(directory / "manifest.json", manifest.model_dump(mode="json"))

    def emit(
        self,
        models: dict[str, Any],
        programs: dict[str, tuple[int, str, Path]],
        sites: list[WeightSite],
        fsites: dict[str, list[WeightSite]],
        out_dir: Path,
        force: bool,
    ) -> VariantResult:
        """Build, gate and publish (or keep as ``.failed``) this variant."""
        from parity.gate import gate
        from parity.mil import load_package

        ctx, variant, steps = self.ctx, self.variant, self.ctx.progress
        subject = ctx.subject
        method = methods.get(variant.method)
        vname = f"{self.name}-{variant.suffix}"
        seconds: dict[str, float] = {}
        with stage_artifact(out_dir, vname, force=force) as stage:
            selection = method.select(ctx, variant)  # once: a searched plan is searched once
            seconds.update(selection.seconds)
            plan, kept = selection.plan, selection.kept
            with steps.step(f"{variant.suffix}: compress window + {len(models) - 1} functions"):
                start = time.perf_counter()
                built = self.compress_all(models, plan, sites, fsites)
                packages, sizes = self.combine(built, programs, stage.path, vname)
                seconds["compress"] = time.perf_counter() - start
            with steps.step(f"{variant.suffix}: records and size"):
                program = load_package(built[WINDOW])
                records, decoded = weight_records(program.functions["main"], sites, plan, kept)
                stored, ops = self.stored(records, packages, programs, fsites, plan, kept)
                odd = differing(stored, {label: i for label, (i, _, _) in programs.items()})
                fp16_packages = [
                    self.fp16_dir / self.build.package_file(self.name, i)
                    for i in range(len(packages))
                ]
                size = size_report(records, fp16_packages, packages)
                fp16 = {n: subject.module.get_parameter(n).detach().half().numpy() for n in decoded}
                errors = weight_errors(decoded, fp16)
                stream = ne_stream({p.name: load_package(p) for p in packages})
            with steps.step(
                f"{variant.suffix}: parity (torch, MIL window)", total=subject.parity_steps
            ) as advance:
                start = time.perf_counter()
                parity = subject.parity(variant, program, decoded, advance, None)
                seconds["parity"] = time.perf_counter() - start
            del program, decoded
            with steps.step(f"{variant.suffix}: parity through the cache (MIL evaluator)"):
                start = time.perf_counter()
                kv = self.build.gates(packages, sizes)
                seconds["kv_parity"] = time.perf_counter() - start
            identical = gate("kv-cache", "kv_weights_identical").check(
                float(len(odd)),
                implementation="package",
                where="; ".join(odd[:3]),
                detail=f"{len(stored[WINDOW])} weights x {len(stored)} programs compared",
            )
            parity.gates += [g for g in kv.gates if g.name in STRUCTURAL] + [identical]
            doc, text = parity_reports(
                subject, parity, kv, sizes, size, errors, stream, selection.doc
            )
            write_reports(stage.path, doc | {"variant": vname}, text)
            write_json_atomic(stage.path / "kv_parity.json", kv_json(kv, sizes, odd))
            extra = method.manifest(variant) | selection.doc
            self.write_manifest(stage.path, vname, packages, ops, sizes, records, size, extra)
            shutil.rmtree(self.scratch)
            peak = _peak_rss_mib()
            if not parity.passed:
                write_log_into(stage.path, f"a variant gate failed; reports kept in {vname}.failed")
                where = stage.keep_as_failed()
                return VariantResult(
                    vname, variant.suffix, False, where, size, parity, seconds, peak
                )
            write_log_into(stage.path, f"every variant gate passed; publishing {out_dir / vname}")
            final = stage.commit()
        return VariantResult(vname, variant.suffix, True, final, size, parity, seconds, peak)


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
    from converter.manifest_fields import package_entry

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
