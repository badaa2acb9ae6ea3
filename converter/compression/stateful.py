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

import os
import secrets
import shutil
from functools import partial
from pathlib import Path
from typing import Any

from converter.compression import methods
from converter.compression.cached_programs import (
    CachedPrograms,
    KvBuild,
    function_sites,
    program_labels,
)
from converter.compression.methods.base import BuildContext
from converter.compression.sites import weight_sites
from converter.compression.variant_steps import (
    VariantResult,
    VariantRun,
    publish_variant,
    variant_steps,
)
from converter.errors import InputError
from converter.pipeline.progress import Steps
from converter.recipe.compression_section import Compression


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
        models = {
            label: ct.models.MLModel(str(p), skip_model_load=True)
            for label, (_, _, p) in programs.items()
        }
        source = ct.models.MLModel(str(window), skip_model_load=True)
        results = []
        for variant in compression.variants:
            keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
            ctx = BuildContext(subject, sites, keep, compression.min_weight_elements, window, steps)
            vname = f"{name}-{variant.suffix}"
            cached = CachedPrograms(build, scratch / variant.suffix, models, programs, fsites)
            start = partial(VariantRun, ctx, variant, vname, fp16_dir, source=source,
                            cached=cached)  # fmt: skip
            own = variant_steps(variant.suffix, cached)
            results.append(publish_variant(ctx, variant, vname, start, own, out_dir, force))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results
