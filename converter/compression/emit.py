"""Emit every compressed variant of a converted model as its own artifact ``OUT/<name>-<suffix>/``.

What differs between methods (``lut``, ``int8``, ``w8a8``, ``mixed``) lives in their modules
(``compress/methods/``); what differs between a decoder and an encoder - what a variant is
compared on, its baselines and gates - in the `Subject` handed in (``compress.decoder``,
``compress.encoder``). This module builds a single-program artifact's variants; their steps
(`converter.compression.variant_steps`) are every artifact kind's.

Runs after the fp16 artifact is published. Each variant is built from the fp16 package, saved
into its own staging directory with the host files it needs (embeddings, tokenizer), measured
(size, torch and MIL-level parity) and published only when its own gates pass; otherwise its
reports stay in ``OUT/<name>-<suffix>.failed/``. A failing variant blocks only itself.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from converter.compression import methods
from converter.compression.methods.base import BuildContext, Subject
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
from graph_passes.decoder import BC1LDecoder
from parity.compression_gates import HeldOut
from parity.memory import release_memory


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
        own = variant_steps(variant.suffix, None)
        results.append(publish_variant(ctx, variant, vname, start, own, out_dir, force))
    return results
