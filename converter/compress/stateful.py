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
allowed here (`converter.recipe.cache.KV_METHODS`): coremltools' k-means (kmeans1d, or
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

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.compress import methods
from converter.compress.config import Compression, Variant
from converter.compress.emit import VariantResult, _manifest, _peak_rss_mib
from converter.compress.methods.base import BuildContext, Scheme
from converter.compress.plan import apply_plan
from converter.compress.records import WeightRecord, weight_records
from converter.compress.sites import WeightSite, weight_sites
from converter.compress.size import size_report
from converter.compress.weight_error import errors_json, errors_text, weight_errors
from converter.coreml import save_package
from converter.errors import InputError
from converter.progress import Steps
from converter.publish import stage_artifact, write_json_atomic
from converter.runlog import write_log_into
from parity.compression_gates import write_reports

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

    ``singles(folder)`` saves one fp16 single-function package per function into ``folder``;
    ``window(path)`` saves the fp16 window program (the same weights, markers on its layer
    outputs) as ``path``; ``gates(package, sizes)`` runs the cache gates (`KvParity`).
    ``parameters`` are the window module's parameter names."""

    singles: Callable[[Path], dict[str, Path]]
    window: Callable[[Path], Path]
    gates: Callable[[Path, dict[str, Any]], Any]
    combine: Callable[[dict[str, Path], Path], dict[str, Any]]
    parameters: list[str]


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


def differing(stored: dict[str, dict[str, str]]) -> list[str]:
    """Weights whose stored payload differs between the programs in ``stored`` (program name
    -> weight -> sha256), or that one program lacks, as ``weight (programs)`` lines."""
    names = sorted({w for per in stored.values() for w in per})
    out = []
    for weight in names:
        seen = {program: per.get(weight) for program, per in stored.items()}
        if len(set(seen.values())) != 1:
            odd = sorted(p for p, h in seen.items() if h != seen.get(WINDOW))
            out.append(f"{weight} ({', '.join(odd)})")
    return out


def check_methods(compression: Compression) -> None:
    """Refuse, before anything is built, a method this module cannot carry into every
    function (the recipe rule says so at validate time too)."""
    from converter.recipe.cache import KV_METHODS

    for i, variant in enumerate(compression.variants):
        if variant.method not in KV_METHODS:
            raise InputError(
                f"compression.variants[{i}].method: {variant.method} variants of a cached "
                f"decoder are not implemented; use one of {', '.join(KV_METHODS)}"
            )


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
        fsites = {
            f: function_sites(load_package(p).functions["main"], build.parameters)
            for f, p in singles.items()
        }
        models = {WINDOW: ct.models.MLModel(str(window), skip_model_load=True)} | {
            f: ct.models.MLModel(str(p), skip_model_load=True) for f, p in singles.items()
        }
        results = []
        for variant in compression.variants:
            keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
            ctx = BuildContext(subject, sites, keep, compression.min_weight_elements, window, steps)
            one = _KvVariant(ctx, variant, name, fp16_dir, scratch / variant.suffix, build)
            results.append(one.emit(models, sites, fsites, out_dir, force))
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
            compressed = apply_plan(model, plan, sites if program == WINDOW else fsites[program])
            out[program] = save_package(compressed, self.scratch / f"{program}.mlpackage")
        return out

    def emit(
        self,
        models: dict[str, Any],
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
                functions = {f: p for f, p in built.items() if f != WINDOW}
                package = stage.path / f"{vname}.mlpackage"
                sizes = self.build.combine(functions, package)
                for host in HOST_FILES:
                    if (self.fp16_dir / host).is_file():
                        shutil.copyfile(self.fp16_dir / host, stage.path / host)
                seconds["compress"] = time.perf_counter() - start
            with steps.step(f"{variant.suffix}: records and size"):
                program = load_package(built[WINDOW])
                records, decoded = weight_records(program.functions["main"], sites, plan, kept)
                stored = {WINDOW: payloads(records)}
                combined = load_package(package)
                for f in functions:
                    per, _ = weight_records(combined.functions[f], fsites[f], plan, kept)
                    stored[f] = payloads(per)
                ops = decode_ops(combined)
                del combined
                odd = differing(stored)
                size = size_report(records, self.fp16_dir / f"{self.name}.mlpackage", package)
                fp16 = {n: subject.module.get_parameter(n).detach().half().numpy() for n in decoded}
                errors = weight_errors(decoded, fp16)
            with steps.step(
                f"{variant.suffix}: parity (torch, MIL window)", total=subject.parity_steps
            ) as advance:
                start = time.perf_counter()
                parity = subject.parity(variant, program, decoded, advance, None)
                seconds["parity"] = time.perf_counter() - start
            del program, decoded
            with steps.step(f"{variant.suffix}: parity through the cache (MIL evaluator)"):
                start = time.perf_counter()
                kv = self.build.gates(package, sizes)
                seconds["kv_parity"] = time.perf_counter() - start
            identical = gate("kv-cache", "kv_weights_identical").check(
                float(len(odd)),
                implementation="package",
                where="; ".join(odd[:3]),
                detail=f"{len(stored[WINDOW])} weights x {len(stored)} programs compared",
            )
            parity.gates += [g for g in kv.gates if g.name in STRUCTURAL] + [identical]
            doc, text = parity_reports(subject, parity, kv, sizes, size, errors, selection.doc)
            write_reports(stage.path, doc | {"variant": vname}, text)
            write_json_atomic(stage.path / "kv_parity.json", kv_json(kv, sizes, odd))
            manifest = _manifest(
                self.fp16_dir, stage.path, vname, variant, package, ops, records, size,
                method.manifest(variant) | selection.doc, subject.not_compressed,
            )  # fmt: skip
            kv_section = dict(manifest.kv_cache or {}) | {"sizes": sizes}
            manifest = manifest.model_copy(update={"kv_cache": kv_section})
            write_json_atomic(stage.path / "manifest.json", manifest.model_dump(mode="json"))
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


def decode_ops(program: Any) -> dict[str, int]:
    """Live op counts of the default (decode) function, as the fp16 manifest records them."""
    counts: dict[str, int] = {}
    for op in program.functions["decode"].operations:
        if op.op_type != "const":
            counts[op.op_type] = counts.get(op.op_type, 0) + 1
    return dict(sorted(counts.items()))


def kv_json(kv: Any, sizes: dict[str, Any], odd: list[str]) -> dict[str, Any]:
    """kv_parity.json of a variant: every cache gate as measured (the fidelity gates against
    the original reported, not gated: see the module docstring), flips, sizes."""
    return {
        "gated": list(STRUCTURAL),
        "gates": [g.to_json() for g in kv.gates],
        "flips": kv.flips,
        "fixtures": kv.rows,
        "sizes": sizes,
        "weights_differing_between_functions": odd,
    }


def parity_reports(
    subject: Any,
    parity: Any,
    kv: Any,
    sizes: dict[str, Any],
    size: Any,
    errors: Any,
    extra: dict[str, Any],
) -> tuple[dict[str, Any], str]:
    """The variant's parity.json content and parity.txt."""
    doc, text = subject.report(parity)
    reported = [g for g in kv.gates if g.name not in STRUCTURAL]
    lines = [
        "cache (MIL evaluator fp16, through the package's functions): structural gates above; "
        "reported, not gated (the fp16 program's fidelity gates; a variant changes the model):"
    ] + [f"  {g.name}: {g.value:.6g} (fp16 threshold {g.threshold:g})" for g in reported]
    lines.append(
        f"weights stored once: multifunction weight file {sizes['multifunction_weight_bytes']:,}"
        f" bytes = {sizes['weight_ratio']:.4f}x the largest single function's"
    )
    doc = doc | {
        "size": size.to_json(),
        "weight_errors": errors_json(errors),
        "kv_cache": {"reported": [g.to_json() for g in reported], "sizes": sizes},
        **extra,
    }
    sections = [text, "\n".join(lines), size.to_text(), errors_text(errors)]
    return doc, "\n\n".join(s for s in sections if s)
