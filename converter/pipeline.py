"""The conversion pipeline for draft decoders: recipe -> proven mlpackage + manifest.

    load checkpoint -> adapt -> BC1L module -> prescales -> torch parity (fp32 + fp16)
        -> trace -> ML Program (fp16) -> emit atomically

Each step is a function with plain inputs and outputs; `convert` runs them in order inside an
artifact stage, so a failure at any point publishes nothing under the final name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from converter.checkpoint import Checkpoint, load_checkpoint
from converter.coreml import TensorIO, live_ops, to_mlprogram, trace
from converter.errors import InputError
from converter.manifest import Deviation, FileEntry, Manifest
from converter.manifest_fields import common_fields, write_npy, write_tokenizer
from converter.markers import mark_layer_outputs
from converter.plan.artifact_gate import plan_artifact
from converter.preflight import preflight
from converter.progress import Steps
from converter.publish import ArtifactStage, clean_leftovers, stage_artifact, write_json_atomic
from converter.recipe import DecoderRecipe, Recipe, ResolvedSource
from converter.runlog import write_log_into
from converter.targets import TARGETS
from graph_passes.adapters import adapt
from graph_passes.decoder import BC1LDecoder, DecoderIO
from graph_passes.masks import MASKED
from graph_passes.prescale import NormScale, apply_prescales, measure_norm_inputs
from graph_passes.spec import CanonicalModel, TransformerSpec
from parity.conversion import check_conversion
from parity.fixtures import Batch, Fixture, build_fixtures, make_batches
from parity.gates import ParityReport, Thresholds, check_decoder, module_inputs
from parity.reference import ReferenceRun, run_reference
from parity.report_files import merge, write_parity_reports


@dataclass
class ConvertResult:
    """What a conversion produced; ``exit_code`` 0 published, 1 a gate failed."""

    name: str
    passed: bool
    artifact_dir: Path | None
    report_dir: Path
    parity: ParityReport
    timings: dict[str, float]
    live_ops: int = 0
    live_ops_per_layer: float = 0.0
    notes: list[str] = field(default_factory=list)
    variants: list[Any] = field(default_factory=list)  # compress.emit.VariantResult, in order
    failed_gate: str | None = None  # the kind of gate that blocked the artifact, if one did

    @property
    def exit_code(self) -> int:
        """0 when every gate passed (each compressed variant's too), else 1."""
        return 0 if self.passed and all(v.passed for v in self.variants) else 1


def gate_failed(
    stage: ArtifactStage,
    gate: str,
    report: ParityReport,
    timings: dict[str, float],
    notes: list[str] | None = None,
) -> ConvertResult:
    """Keep the staged reports as ``<name>.failed`` and log which gate failed (exit code 1)."""
    write_log_into(stage.path, f"a {gate} gate failed; reports kept in {stage.name}.failed")
    failed = stage.keep_as_failed()
    return ConvertResult(
        stage.name, False, None, failed, report, timings, notes=notes or [], failed_gate=gate
    )


def published(
    final: Path,
    report: ParityReport,
    timings: dict[str, float],
    ops: int,
    num_layers: int,
    variants: list[Any] | None = None,
) -> ConvertResult:
    """The result of an artifact published at ``final`` with ``ops`` live ops (exit code 0)."""
    return ConvertResult(
        final.name,
        True,
        final,
        final,
        report,
        timings,
        live_ops=ops,
        live_ops_per_layer=ops / num_layers,
        variants=variants or [],
    )


def decoder_io(recipe: DecoderRecipe, canonical: CanonicalModel) -> DecoderIO:
    """Resolve the recipe's I/O choices against the checkpoint (``auto`` inputs)."""
    inputs = recipe.io.inputs
    if inputs == "auto":
        # Tied embeddings: keep the table on the host so it is not stored twice (SPEC 2).
        inputs = "embeddings" if canonical.spec.tied_embeddings else "token-ids"
    return DecoderIO(
        batch=recipe.shapes.batch,
        length=recipe.shapes.sequence_length,
        inputs=inputs,
        logit_positions=recipe.logits_positions,
        lm_head_chunk=recipe.io.lm_head_chunk,
    )


def tensor_contract(module: BC1LDecoder, dtype: str) -> tuple[list[TensorIO], list[TensorIO]]:
    """The inputs and outputs of the emitted function, with their meaning."""
    io, spec = module.io, module.spec
    b, length, d = io.batch, io.length, spec.hidden_size
    if io.inputs == "token-ids":
        first = TensorIO("input_ids", (b, length), "int32", "token ids, left-padded")
    else:
        first = TensorIO(
            "inputs_embeds",
            (b, length, d),
            dtype,  # type: ignore[arg-type]
            "rows of embeddings.npy gathered on the host for each token id, left-padded",
        )
    key_mask = TensorIO(
        "key_mask",
        (b, length),
        dtype,  # type: ignore[arg-type]
        f"additive key mask: 0 for a real token, {MASKED:g} for padding",
    )
    outputs = []
    start = 0
    for k, size in enumerate(module.chunk_sizes):
        outputs.append(
            TensorIO(
                f"logits_{k}",
                (b, size, 1, io.logit_positions),
                dtype,  # type: ignore[arg-type]
                f"logits of token ids {start}..{start + size - 1} at the last "
                f"{io.logit_positions} window position(s): [batch, token, 0, position]",
            )
        )
        start += size
    return [first, key_mask], outputs


def choose_scales(
    module: BC1LDecoder, batches: list[Batch], embed_table: torch.Tensor
) -> list[NormScale]:
    """Measure every norm's input range on the fixtures (fp32) and set power-of-two prescales."""
    norms = module.norms()

    def run_all() -> None:
        for batch in batches:
            x, mask = module_inputs(module, batch, embed_table, torch.float32)
            module.head(module.run_layers(x, mask)[-1])

    return apply_prescales(norms, measure_norm_inputs(norms, run_all))


def deviations(scales: list[NormScale], precision: str) -> list[Deviation]:
    """Every numeric change the fp16 program forces, grouped by value."""
    out = [
        Deviation(
            where="attention masks",
            what="exclusion by a finite additive mask instead of -inf",
            original="-inf",
            effective=MASKED,
            why="keeps fully masked (padded) rows finite and sums of masks inside fp16; "
            "exp(-1e4) is exactly 0 in fp16 and fp32",
        )
    ]
    groups: dict[tuple[float, float, float], list[str]] = {}
    for s in scales:
        stored = s.fp16_scaled_eps if precision == "float16" else s.scaled_eps
        groups.setdefault((s.prescale, s.scaled_eps, stored), []).append(s.name)
    for (prescale, scaled_eps, stored), names in sorted(groups.items()):
        if prescale != 1.0:
            out.append(
                Deviation(
                    where=", ".join(names),
                    what=f"norm input divided by {prescale:g} (power of two) inside the norm",
                    original=1.0,
                    effective=prescale,
                    why="exact: the factor cancels; keeps the sum of squares inside fp16 "
                    "(measured per-position L2 norm above 64 on the fixtures)",
                )
            )
        if stored != scaled_eps:
            out.append(
                Deviation(
                    where=", ".join(names),
                    what="C * eps / prescale^2, added to the sum of squares, as stored in fp16",
                    original=scaled_eps,
                    effective=stored,
                    why="fp16 cannot hold the value; the fp16 parity gates measure its effect",
                )
            )
    return out


@dataclass
class Rewrite:
    """The BC1L module for a recipe, with the fixtures it is checked on."""

    spec: TransformerSpec  # not the canonical weights: their memory is freed with the reference
    module: BC1LDecoder
    embed_table: torch.Tensor
    fixtures: list[Fixture]
    batches: list[Batch]
    scales: list[NormScale]


def rewrite_decoder(recipe: DecoderRecipe, ckpt: Checkpoint) -> Rewrite:
    """Adapt the checkpoint, build the BC1L module and set its prescales from the fixtures."""
    canonical = adapt(ckpt.config, ckpt.model.state_dict())
    io = decoder_io(recipe, canonical)
    module = BC1LDecoder(canonical, io).eval()
    embed_table = canonical.weights["embed.weight"]
    fixtures = build_fixtures(
        recipe.fixtures.prompts,
        recipe.fixtures.token_ids,
        ckpt.tokenizer,
        io.length,
        canonical.spec.vocab_size,
        recipe.fixtures.padded_variants,
    )
    batches = make_batches(fixtures, io.batch, io.length, _pad_id(ckpt))
    scales = choose_scales(module, batches, embed_table)
    return Rewrite(canonical.spec, module, embed_table, fixtures, batches, scales)


def reference_runs(
    ckpt: Checkpoint, rewrite: Rewrite, advance: Callable[[], None] = lambda: None
) -> dict[str, ReferenceRun]:
    """The original model on every fixture, unpadded."""
    runs = {}
    for fixture in rewrite.fixtures:
        runs[fixture.name] = run_reference(ckpt.model, fixture.token_ids)
        advance()
    return runs


def convert(
    recipe: Recipe,
    out_dir: Path | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    steps: Steps | None = None,
) -> ConvertResult:
    """Run the whole pipeline for one recipe; publishes ``<out>/<name>/`` only if all gates pass."""
    if recipe.task != "text-generation":
        from converter.encoder_pipeline import convert_encoder

        return convert_encoder(recipe, out_dir, force, allow_pickle, steps)
    steps = steps or Steps(quiet=True)
    out_dir = out_dir or recipe.output_dir
    name = recipe.name
    if recipe.attention != "per-head":
        raise InputError(f"attention: {recipe.attention!r} is not implemented yet; use 'per-head'")
    target = TARGETS[recipe.target]
    # Bad input fails here, in about a second, before the output directory is touched.
    with steps.step("check inputs"):
        source = recipe.resolve_source()
        preflight(recipe, source, out_dir, allow_pickle)
    if out_dir.is_dir():
        clean_leftovers(out_dir)

    with stage_artifact(out_dir, name, force=force) as stage:
        with steps.step("load checkpoint"):
            ckpt = load_checkpoint(source, recipe.task, allow_pickle=allow_pickle)

        with steps.step("rewrite to BC1L"):
            rewrite = rewrite_decoder(recipe, ckpt)
        module, embed_table = rewrite.module, rewrite.embed_table
        total = len(rewrite.fixtures) + len(rewrite.batches)
        with steps.step("parity (torch fp32, fp16)", total=total) as advance:
            references = reference_runs(ckpt, rewrite, advance)
            thresholds = Thresholds(**recipe.gates.parity_thresholds())
            report = check_decoder(
                module, rewrite.batches, references, embed_table, thresholds, advance
            )
        scales = rewrite.scales
        held_out = _held_out(recipe, ckpt, rewrite)  # needs the original model: before del
        del ckpt.model  # the reference is no longer needed; free its memory before converting

        write_parity_reports(stage.path, report, None, {"recipe": name})
        if not report.passed:
            return gate_failed(stage, "parity", report, steps.timings)

        inputs, outputs = tensor_contract(module, recipe.io.dtype)
        with steps.step("trace"):
            traced = trace(module, inputs)
            # Stable names for each layer's output, so the MIL level compares layer by layer.
            mark_layer_outputs(traced, module.spec.num_layers)
        with steps.step("convert to ML Program"):
            mlmodel = to_mlprogram(traced, inputs, outputs, target.ct_target(), recipe.precision)
            ops = live_ops(mlmodel)

        with steps.step("save"):
            package = stage.path / f"{name}.mlpackage"
            mlmodel.save(str(package))
        del traced

        # The emitted program itself, in the MIL evaluator (fp32 per layer against the BC1L
        # module, fp16 gated and fp16-acc reported against the original model).
        total = 3 * len(rewrite.batches)
        with steps.step("parity (MIL: fp32, fp16, fp16-acc)", total=total) as advance:
            conversion = check_conversion(
                package,
                module,
                rewrite.batches,
                references,
                embed_table,
                thresholds,
                recipe.precision,
                progress=advance,
            )
        merge(report, conversion)
        write_parity_reports(stage.path, report, conversion, {"recipe": name})
        if not report.passed:
            return gate_failed(stage, "MIL-level", report, steps.timings)

        with steps.step("write manifest"):
            embeddings = None
            if module.io.inputs == "embeddings":
                embeddings = write_npy(
                    stage.path / "embeddings.npy",
                    embed_table.to(torch.float16).numpy(),
                    "embedding table (vocab, hidden); row t is the input for token id t",
                )
            tokenizer = write_tokenizer(
                stage.path,
                ckpt.tokenizer,
                "the checkpoint's tokenizer; a runtime refuses a draft whose "
                "vocabulary differs from its target's",
            )
            manifest = _manifest(
                recipe,
                source,
                ckpt,
                module,
                scales,
                inputs,
                outputs,
                package,
                ops,
                embeddings,
                tokenizer,
                stage.path / "parity.json",
            )
            write_json_atomic(stage.path / "manifest.json", manifest.model_dump(mode="json"))
        with steps.step("plan (static)"):
            plan = plan_artifact(
                mlmodel._mil_program,  # the program just saved, without reloading its weights
                package,
                manifest.package.content_sha256,
                target.platform,
                recipe.gates.plan_min_ne_flop_share,
                recipe.gates.plan_max_ne_segments,
                stage.path,
            )
        if not plan.passed:
            return gate_failed(stage, "plan", report, steps.timings, notes=plan.failures())
        write_log_into(stage.path, f"every gate passed; publishing {out_dir / name}")
        final = stage.commit()

    variants = []
    if recipe.compression is not None and held_out is not None:
        from converter.compress.emit import emit_variants

        variants = emit_variants(
            recipe.compression, name, final, module, embed_table, held_out, out_dir,
            recipe.gates.mil_fp32_layer_rel_error, force, steps,
        )  # fmt: skip
    return published(
        final, report, steps.timings, sum(ops.values()), module.spec.num_layers, variants
    )


def _held_out(recipe: Recipe, ckpt: Checkpoint, rewrite: Rewrite) -> Any:
    """The compression section's held-out slice with the original model's logits, or None."""
    if recipe.compression is None:
        return None
    from parity.compression_gates import prepare_held_out

    c = recipe.compression
    return prepare_held_out(
        c.held_out, ckpt.tokenizer, ckpt.model, rewrite.module.io.length,
        rewrite.spec.vocab_size, c.mil_positions, _pad_id(ckpt), c.calibration,
    )  # fmt: skip


def _pad_id(ckpt: Checkpoint) -> int:
    for holder in (ckpt.tokenizer, ckpt.config):
        value = getattr(holder, "pad_token_id", None)
        if isinstance(value, int):
            return value
    eos = getattr(ckpt.config, "eos_token_id", None)
    return eos if isinstance(eos, int) else 0


def _manifest(
    recipe: Recipe,
    source: ResolvedSource,
    ckpt: Checkpoint,
    module: BC1LDecoder,
    scales: list[NormScale],
    inputs: list[TensorIO],
    outputs: list[TensorIO],
    package: Path,
    ops: Any,
    embeddings: FileEntry | None,
    tokenizer: FileEntry | None,
    parity_path: Path,
) -> Manifest:
    spec = module.spec
    return Manifest(
        **common_fields(
            recipe, source, ckpt, inputs, outputs, package, ops, tokenizer, parity_path
        ),
        architecture=spec.architecture,
        batch=module.io.batch,
        sequence_length=module.io.length,
        conventions={
            "layout": "activations are [batch, channels, 1, sequence] (BC1L) inside the program",
            "padding": "left: the last real token sits in the last slot, sequence_length - 1",
            "positions": "slot l has RoPE position l; left padding shifts all real positions "
            "equally, which leaves attention unchanged (RoPE is relative)",
            "mask": "key_mask masks keys only; the causal mask is built into the program; "
            "outputs at padded positions are finite and meaningless",
            "logits": "one output per LM-head chunk, in vocabulary order; concatenate on the "
            "token axis (or take the argmax per chunk) on the host",
        },
        masked_value=MASKED,
        rope_theta=[layer.attention.rope_theta for layer in spec.layers],
        vocab_size=spec.vocab_size,
        lm_head_chunks=module.chunk_sizes,
        embeddings=embeddings,
        deviations=deviations(scales, recipe.precision),
    )
