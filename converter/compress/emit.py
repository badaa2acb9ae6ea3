"""Emit every compressed variant of a decoder as its own artifact ``OUT/<name>-<suffix>/``.

Uniform variants (``lut``, ``int8``) give every selected weight one scheme; ``w8a8`` adds int8
activations (``activations``); ``mixed`` takes its per-weight plan from ``search``.

Runs after the fp16 artifact is published. Each variant is built from the fp16 package, saved
into its own staging directory with the host files it needs (embeddings, tokenizer), measured
(size, torch and MIL-level parity) and published only when its own gates pass; otherwise its
reports stay in ``OUT/<name>-<suffix>.failed/``. A failing variant blocks only itself.
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.compress.activations import (
    activation_report,
    activation_sites,
    calibrate,
    fake_quantized_inputs,
    insert_activation_quantization,
    program_scales,
    quantizer_mismatches,
    ranges_text,
)
from converter.compress.config import Compression, Variant
from converter.compress.plan import Scheme, apply_plan, split_sites, variant_scheme
from converter.compress.records import WeightRecord, weight_records
from converter.compress.sites import WeightSite, keep_reason, weight_sites
from converter.compress.size import SizeReport, size_report
from converter.compress.weight_error import errors_json, errors_text, weight_errors
from converter.hashing import mlpackage_content_files, mlpackage_content_hash, sha256_file
from converter.manifest import FileEntry, Manifest, PackageEntry
from converter.progress import Steps
from converter.publish import stage_artifact, write_json_atomic
from converter.runlog import write_log_into
from graph_passes.decoder import BC1LDecoder
from parity.compression_gates import (
    HeldOut,
    Logits,
    VariantParity,
    Wrap,
    compare_torch,
    compare_windows,
    decoder_gates,
    level_result,
    mil_fp32_check,
    mil_logits,
    parity_json,
    parity_text,
    program_feed,
    torch_logits,
    with_weights,
    write_reports,
)
from parity.fixtures import make_batches

# Windows the fp32 consistency check runs (the program against torch with the same weights).
FP32_WINDOWS = 2
_HOST_FILES = ("embeddings.npy", "tokenizer.json")


@dataclass
class VariantResult:
    """What one variant produced; ``passed`` False keeps its reports in ``.failed``."""

    name: str
    suffix: str
    passed: bool
    directory: Path
    size: SizeReport | None = None
    parity: VariantParity | None = None
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
class Baselines:
    """The fp16 artifact's own logits on the held-out slice, computed once for all variants."""

    torch_fp16: Logits
    mil_fp16: Logits


def uniform_plan(
    compression: Compression, variant: Variant, sites: list[WeightSite]
) -> tuple[dict[str, Scheme], dict[str, str]]:
    """One scheme for every weight not kept fp16; returns the plan and the kept reasons."""
    keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
    chosen, kept = split_sites(sites, keep, compression.min_weight_elements)
    scheme = variant_scheme(variant)
    return {s.name: scheme for s in chosen}, kept


def _search(
    compression: Compression,
    variant: Variant,
    sites: list[WeightSite],
    module: BC1LDecoder,
    embed_table: torch.Tensor,
    held_out: HeldOut,
    steps: Steps,
) -> tuple[dict[str, Scheme], dict[str, str], dict[str, Any]]:
    """The mixed-bit plan of ``converter.compress.search``, the kept weights and its report."""
    from converter.compress.search import search_plan

    assert variant.search is not None  # recipe rule
    keep = compression.keep_fp16 if variant.keep_fp16 is None else variant.keep_fp16
    chosen, kept = split_sites(sites, keep, compression.min_weight_elements)
    widths = [b for b in variant.search.bits if b != 16]
    label = f"{variant.suffix}: search ({len(chosen)} weights x {len(widths)} widths)"
    with steps.step(label, total=len(chosen) * len(widths)) as advance:
        plan, found = search_plan(
            module, chosen, variant.search, held_out.calibration, held_out.texts, embed_table,
            held_out.pad_id, log=logging.getLogger("anec.compress").info, advance=advance,
        )  # fmt: skip
    for site in chosen:
        if site.name not in plan:
            kept[site.name] = "the mixed-bit search kept it fp16"
    return plan, kept, {"search": found}


def _calibrate(
    variant: Variant,
    package: Path,
    module: BC1LDecoder,
    plan: dict[str, Scheme],
    sites: list[WeightSite],
    held_out: HeldOut,
    embed_table: torch.Tensor,
) -> list[Any]:
    """Input ranges of every planned projection: the fp16 program in the MIL evaluator
    (profile fp16) on the calibration text."""
    from parity.compression_gates import program_feed
    from parity.fixtures import make_batches
    from parity.mil import Evaluator, load_package

    program = load_package(package)
    function = program.functions["main"]
    keep = variant.activations_keep_fp16
    quantized = [s for s in sites if s.name in plan and keep_reason(s, keep, 0) is None]
    chosen = activation_sites(function, quantized)
    evaluator = Evaluator(program, "fp16")
    io = module.io
    batches = make_batches(held_out.calibration, io.batch, io.length, held_out.pad_id)
    feeds = [program_feed(evaluator, module, b, embed_table) for b in batches]
    return calibrate(evaluator, feeds, chosen)


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
    """Build, measure and publish every variant of ``compression`` (in recipe order)."""
    import coremltools as ct

    from parity.mil import Evaluator, load_package

    steps = steps or Steps(quiet=True)
    package = fp16_dir / f"{name}.mlpackage"
    mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
    with steps.step("compression: fp16 baselines", total=len(held_out.windows)) as advance:
        program = load_package(package)
        sites = weight_sites(program.functions["main"], dict(module.named_parameters()))
        base = Baselines(
            torch_fp16=torch_logits(module, held_out, embed_table, torch.float16),
            mil_fp16=mil_logits(
                Evaluator(program, "fp16"), module, held_out, embed_table, progress=advance
            ),
        )
        del program
    results = []
    for variant in compression.variants:
        results.append(
            _emit_one(
                compression,
                variant,
                name,
                fp16_dir,
                mlmodel,
                sites,
                module,
                embed_table,
                held_out,
                base,
                out_dir,
                mil_fp32_threshold,
                force,
                steps,
            )  # fmt: skip
        )
    return results


def _emit_one(
    compression: Compression,
    variant: Variant,
    name: str,
    fp16_dir: Path,
    mlmodel: Any,
    sites: list[WeightSite],
    module: BC1LDecoder,
    embed_table: torch.Tensor,
    held_out: HeldOut,
    base: Baselines,
    out_dir: Path,
    mil_fp32_threshold: float,
    force: bool,
    steps: Steps,
) -> VariantResult:
    from parity.mil import load_package

    vname = f"{name}-{variant.suffix}"
    seconds: dict[str, float] = {}
    with stage_artifact(out_dir, vname, force=force) as stage:
        search_doc: dict[str, Any] = {}
        if variant.method == "mixed":
            start = time.perf_counter()
            plan, kept, search_doc = _search(compression, variant, sites, module, embed_table,
                                             held_out, steps)  # fmt: skip
            seconds["search"] = time.perf_counter() - start
        with steps.step(f"{variant.suffix}: compress"):
            start = time.perf_counter()
            if variant.method != "mixed":
                plan, kept = uniform_plan(compression, variant, sites)
            source, act_sites = mlmodel, []
            if variant.method == "w8a8":
                act_sites = _calibrate(variant, fp16_dir / f"{name}.mlpackage", module, plan, sites,
                                       held_out, embed_table)  # fmt: skip
                source = insert_activation_quantization(mlmodel, act_sites)
            compressed = apply_plan(source, plan, sites)
            del source
            path = stage.path / f"{vname}.mlpackage"
            compressed.save(str(path))
            del compressed
            for host in _HOST_FILES:
                if (fp16_dir / host).is_file():
                    shutil.copyfile(fp16_dir / host, stage.path / host)
            seconds["compress"] = time.perf_counter() - start
        with steps.step(f"{variant.suffix}: records and size"):
            program = load_package(path)
            records, decoded = weight_records(program.functions["main"], sites, plan, kept)
            size = size_report(records, fp16_dir / f"{name}.mlpackage", path)
            errors = weight_errors(
                decoded, {n: module.get_parameter(n).detach().half().numpy() for n in decoded}
            )
            ops = _live_ops(program)
            wrap, act, act_text = None, None, ""
            if act_sites:
                scales = program_scales(program.functions["main"], act_sites)
                kept_inputs = sorted(set(plan) - {a.weight for a in act_sites})
                search_doc = {"activations": activation_report(act_sites, scales, kept_inputs)}
                act_text = ranges_text(act_sites, scales, kept_inputs)
                act = (act_sites, scales)

                def wrap(m: torch.nn.Module, sc: dict[str, float] = scales) -> Any:
                    return fake_quantized_inputs(m, sc)

        total = len(held_out.windows) + FP32_WINDOWS
        with steps.step(f"{variant.suffix}: parity (torch, MIL)", total=total) as advance:
            start = time.perf_counter()
            parity = _variant_parity(
                variant, program, module, decoded, embed_table, held_out, base,
                mil_fp32_threshold, advance, wrap, act,
            )  # fmt: skip
            seconds["parity"] = time.perf_counter() - start
        del program, decoded
        doc = parity_json(parity) | {
            "variant": vname,
            "size": size.to_json(),
            "weight_errors": errors_json(errors),
            **search_doc,
        }
        sections = [parity_text(parity), size.to_text(), errors_text(errors), act_text]
        text = "\n\n".join(s for s in sections if s)
        write_reports(stage.path, doc, text)
        manifest = _manifest(
            fp16_dir, stage.path, vname, variant, path, ops, records, size, search_doc
        )
        write_json_atomic(stage.path / "manifest.json", manifest.model_dump(mode="json"))
        peak = _peak_rss_mib()
        if not parity.passed:
            write_log_into(stage.path, f"a variant gate failed; reports kept in {vname}.failed")
            where = stage.keep_as_failed()
            return VariantResult(vname, variant.suffix, False, where, size, parity, seconds, peak)
        write_log_into(stage.path, f"every variant gate passed; publishing {out_dir / vname}")
        final = stage.commit()
    return VariantResult(vname, variant.suffix, True, final, size, parity, seconds, peak)


def _variant_parity(
    variant: Variant,
    program: Any,
    module: BC1LDecoder,
    decoded: dict[str, np.ndarray],
    embed_table: torch.Tensor,
    held_out: HeldOut,
    base: Baselines,
    mil_fp32_threshold: float,
    advance: Callable[[], None],
    wrap: Wrap | None = None,
    act: tuple[list[Any], dict[str, float]] | None = None,
) -> VariantParity:
    from parity.mil import Evaluator

    with_variant = with_weights(module, decoded)
    torch16 = torch_logits(with_variant, held_out, embed_table, torch.float16, wrap)
    torch_level = level_result(
        "torch-fp16",
        "the BC1L module with the variant's decoded weights, cast to fp16, torch on the CPU; "
        "every real position of each held-out text",
        compare_torch(torch16, held_out.references),
        compare_torch(torch16, base.torch_fp16),
    )
    mil16 = mil_logits(Evaluator(program, "fp16"), module, held_out, embed_table, progress=advance)
    mil_level = level_result(
        "mil-fp16",
        "the emitted variant program in anec's MIL evaluator, fp16 storage profile; the last "
        "position of each held-out prefix window",
        compare_windows(mil16, held_out, None),
        compare_windows(mil16, held_out, base.mil_fp16),
    )
    fp32_error, mismatches = mil_fp32_check(
        program, module, decoded, held_out, embed_table, FP32_WINDOWS, wrap
    )
    for _ in range(FP32_WINDOWS):
        advance()
    g = variant.gates
    assert g.min_top1_agreement is not None and g.max_mean_kl is not None  # recipe rule
    levels = [torch_level, mil_level]
    quantizers = None
    notes = []
    if act is not None:
        sites, scales = act
        function = program.functions["main"]
        evaluator = Evaluator(program, "fp32")
        (batch,) = make_batches(held_out.windows[:1], 1, module.io.length, held_out.pad_id)
        feed = program_feed(evaluator, module, batch, embed_table)
        quantizers = quantizer_mismatches(evaluator, feed, function, sites, scales)
        notes.append(
            "mil-fp32 logits relative error is reported, not gated, for int8 activations: a "
            "last-bit difference before a quantizer flips a code (one scale step)"
        )
        notes.append("int8 x int8 arithmetic pays only on A17 Pro / M4 and later (SPEC 3)")
    gates = decoder_gates(
        levels, g.min_top1_agreement, g.max_mean_kl, g.max_abs_dprob, fp32_error,
        mil_fp32_threshold, mismatches, quantizers,
    )  # fmt: skip
    return VariantParity(levels, gates, fp32_error, notes)


def _manifest(
    fp16_dir: Path,
    stage: Path,
    vname: str,
    variant: Variant,
    package: Path,
    ops: dict[str, int],
    records: list[WeightRecord],
    size: SizeReport,
    search_doc: dict[str, Any],
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
        "not_compressed": "activations, norms' parameters, RoPE tables, masks and the host-side "
        "embedding table stay as in the fp16 artifact",
    }
    if variant.method == "w8a8":
        compression["int8_activations"] = (
            "int8 x int8 arithmetic pays only on A17 Pro / M4 and later; older NEs "
            "dequantize to fp16"
        )
    compression.update(search_doc)  # "search" (mixed) or "activations" (w8a8)
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
