"""The text-generation task (draft decoders): its state and its step list.

    load -> rewrite to BC1L (+ power-of-two scales) -> reference -> torch parity (fp32, fp16)
        -> convert (trace with layer markers, ML Program, save) -> MIL parity (fp32 per layer,
        fp16 gated, fp16-acc reported) -> manifest -> plan (static)

The I/O contract, deviations and manifest fields are in `converter.tasks.decoder_contract`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.checkpoints.gguf_config import ConfigReads, assumed_values
from converter.checkpoints.loading import Checkpoint
from converter.errors import InputError
from converter.pipeline.manifest import Deviation
from converter.pipeline.manifest_fields import write_npy, write_tokenizer
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.steps import Advance, Step, Stop
from converter.recipe import DecoderRecipe, Recipe
from converter.tasks.decoder_contract import decoder_io, decoder_manifest, tensor_contract
from converter.tasks.draft_vocabulary import (
    TrimmedVocabulary,
    judged_prompts,
    trim_vocabulary,
    write_head_ids,
)
from converter.tasks.shared import TaskRun, emit_program, load, need, plan, write_parity_reports
from graph_passes.archs import adapt
from graph_passes.decoder import BC1LDecoder, DecoderIO
from graph_passes.mlp import spelled_mul_sigmoid
from graph_passes.prescale import NormScale, apply_prescales, measure_norm_inputs
from graph_passes.spec import CanonicalModel, TransformerSpec
from graph_passes.stream_scale import (
    StreamScaling,
    apply_stream_scaling,
    plan_stream_scaling,
    recording_ranges,
)
from parity.conversion import DEFAULT_PROFILES, ConversionReport, check_conversion
from parity.decoder_gates import check_decoder, module_inputs
from parity.fixtures import Batch, Fixture, build_fixtures, make_batches, pad_id
from parity.memory import release_memory
from parity.mil.profiles import DEVICE_MARGIN
from parity.profile_run import evaluator_passes
from parity.reference import ReferenceRun, run_reference
from parity.thresholds import Thresholds
from parity.torch_settings import with_parity_torch

MIL_PROFILES = DEFAULT_PROFILES  # fp32 per layer, fp16 gated, fp16-acc reported


def mil_profiles(recipe: Recipe, chosen: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The MIL profiles a decoder runs: ``chosen`` (``anec parity --profile``) or the default
    ones, with the opt-in device-margin profile when the recipe sets its gate. Choosing that
    profile for a recipe without the gate is an InputError: it would run ungated."""
    opted = recipe.gates.device_margin_argmax_agreement is not None
    if chosen is None:
        return MIL_PROFILES + ((DEVICE_MARGIN.name,) if opted else ())
    if DEVICE_MARGIN.name in chosen and not opted:
        raise InputError(
            f"--profile {DEVICE_MARGIN.name}: the recipe does not set "
            "gates.device_margin_argmax_agreement, so the profile has no gate to check"
        )
    return chosen


@dataclass
class Rewrite:
    """The BC1L module for a recipe, with the fixtures it is checked on."""

    spec: TransformerSpec  # not the canonical weights: their memory is freed with the reference
    module: BC1LDecoder
    # The embedding table in fp32. The artifact ships it in the I/O dtype (embeddings.npy):
    # an fp16 input rounds every row to fp16 anyway (the fp16 gates feed rounded rows), and an
    # fp32 artifact ships it unrounded, as its fp32 gates feed it.
    embed_table: torch.Tensor
    fixtures: list[Fixture]
    batches: list[Batch]
    scales: list[NormScale]
    scaling: StreamScaling
    # Config values a GGUF file did not carry (transformers' defaults): manifest deviations.
    assumed: list[Deviation] = field(default_factory=list)


@dataclass
class DecoderRun(TaskRun):
    """A decoder conversion in progress."""

    rewrite: Rewrite | None = None
    references: dict[str, ReferenceRun] = field(default_factory=dict)
    conversion: ConversionReport | None = None
    held_out: Any = None  # compress.HeldOut when the recipe has a compression section
    # The trimmed head (recipe vocabulary:): the kept ids, the ranking and the acceptance.
    vocabulary: TrimmedVocabulary | None = None
    # The MIL evaluator profiles to run: `mil_profiles` of the recipe (`anec parity
    # --profile` replaces them).
    profiles: tuple[str, ...] = field(default=MIL_PROFILES, init=False)

    def __post_init__(self) -> None:
        self.profiles = mil_profiles(self.recipe)

    @property
    def recipe(self) -> DecoderRecipe:
        """The recipe being converted (a decoder recipe: the task registry says so)."""
        recipe = self.job.recipe
        assert isinstance(recipe, DecoderRecipe)
        return recipe

    def num_layers(self) -> int:
        """Transformer layers of the converted model."""
        return need(self.rewrite, "the rewrite").spec.num_layers


def thresholds(recipe: Recipe) -> Thresholds:
    """The recipe's torch and MIL gate thresholds for a decoder."""
    return Thresholds(**recipe.gates.parity_thresholds())


def _run_fixtures(module: BC1LDecoder, batches: list[Batch]) -> Callable[[], None]:
    def run_all() -> None:
        for batch in batches:
            x, mask = module_inputs(module, batch, module.host_embedding_table(), torch.float32)
            module.head(module.run_layers(x, mask)[-1])

    return run_all


def choose_scales(
    canonical: CanonicalModel, io: DecoderIO, batches: list[Batch]
) -> tuple[BC1LDecoder, StreamScaling, list[NormScale]]:
    """The BC1L module with its power-of-two scales chosen from fp32 ranges on the fixtures:
    the residual stream and branch scales (`graph_passes.stream_scale`), then each norm's
    prescale. One pass measures both; a second runs only when the stream had to be scaled."""
    module = BC1LDecoder(canonical, io).eval()
    norms = module.norms()
    with recording_ranges(module.decoder_layers()) as ranges:
        maxima = measure_norm_inputs(norms, _run_fixtures(module, batches))
    scaling = plan_stream_scaling(canonical.spec.layers, ranges)
    if scaling.identity:
        return module, scaling, apply_prescales(norms, maxima)
    # The unscaled module goes before the scaled one is built: two whole modules at once
    # were the rewrite step's peak on Gemma 3 270M.
    del module, norms
    release_memory()
    canonical, scaling = apply_stream_scaling(canonical, scaling)
    module = BC1LDecoder(canonical, io).eval()
    return module, scaling, set_prescales(module, batches)


def set_prescales(module: BC1LDecoder, batches: list[Batch]) -> list[NormScale]:
    """Measure every norm's input range on the fixtures (fp32) and set its prescale."""
    norms = module.norms()
    return apply_prescales(norms, measure_norm_inputs(norms, _run_fixtures(module, batches)))


def rewrite_decoder(recipe: DecoderRecipe, ckpt: Checkpoint) -> Rewrite:
    """Adapt the checkpoint, build the BC1L module and set its scales from the fixtures."""
    config = ConfigReads(ckpt.config)
    canonical = adapt(config, ckpt.model.state_dict())
    if recipe.silu_form == "mul-sigmoid":
        canonical = spelled_mul_sigmoid(canonical)
    assumed = []
    if ckpt.gguf_carried is not None:
        gguf = ckpt.weight_files[0].name
        assumed = assumed_values(ckpt.config, config.keys, ckpt.gguf_carried, gguf)
    io = decoder_io(recipe, canonical)
    fixtures = build_fixtures(
        recipe.fixtures.prompts,
        recipe.fixtures.token_ids,
        ckpt.tokenizer,
        io.length,
        canonical.spec.vocab_size,
        recipe.fixtures.padded_variants,
    )
    batches = make_batches(fixtures, io.batch, io.length, pad_id(ckpt.tokenizer, ckpt.config))
    module, scaling, scales = choose_scales(canonical, io, batches)
    return Rewrite(
        module.spec,
        module,
        module.host_embedding_table(),
        fixtures,
        batches,
        scales,
        scaling,
        assumed,
    )


def reference_runs(
    ckpt: Checkpoint, rw: Rewrite, advance: Advance = lambda: None
) -> dict[str, ReferenceRun]:
    """The original model on every fixture, unpadded."""
    runs = {}
    for fixture in rw.fixtures:
        runs[fixture.name] = run_reference(ckpt.model, fixture.token_ids)
        advance()
    return runs


# ---- steps -----------------------------------------------------------------------------------


def rewrite(run: DecoderRun, advance: Advance) -> None:
    """Adapt the checkpoint into the BC1L module and its fixtures."""
    run.rewrite = rewrite_decoder(run.recipe, need(run.ckpt, "the checkpoint"))


def references(run: DecoderRun, advance: Advance) -> None:
    """The original model on every fixture, unpadded; then the compression held-out slice,
    which needs it too; then the original model's memory is freed."""
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    run.references = reference_runs(ckpt, rw, advance)
    run.held_out = held_out(run.recipe, ckpt, rw)
    del ckpt.model
    # Its pages go back to the system: glibc keeps freed heap resident otherwise, and on
    # SmolLM2 0.74 GiB of freed heap still counted in the RSS of every later step.
    release_memory()


def torch_parity(run: DecoderRun, advance: Advance) -> Stop | None:
    """The BC1L module in fp32 (per layer, logits) against the reference, and in fp16 where
    the recipe asks for it every time (``gates.torch_fp16``; else `diagnose_fp16`)."""
    rw = need(run.rewrite, "the rewrite")
    run.report = check_decoder(
        rw.module, rw.batches, run.references, rw.embed_table, thresholds(run.recipe), advance,
        fp16=run.recipe.gates.torch_fp16 == "always",
    )  # fmt: skip
    if run.vocabulary is not None:
        run.report.gates.insert(0, run.vocabulary.gate)
    run.report.stream = rw.scaling
    write_parity_reports(run.job.directory, run.report, None, {"recipe": run.recipe.name})
    return None if run.report.passed else Stop("parity")


def convert(run: DecoderRun, advance: Advance) -> None:
    """Trace (layer outputs marked), convert to an ML Program and save the package."""
    module = need(run.rewrite, "the rewrite").module
    contract = tensor_contract(module, run.recipe.io.dtype)
    program = emit_program(
        run, "main", module, contract, f"{run.recipe.name}.mlpackage", module.spec.num_layers
    )
    # Saved, and its plan table made: the MIL parity step evaluates the saved package, and
    # the in-memory copy of its weights beside it set that step's peak.
    program.mlmodel = None
    release_memory()


def mil_parity(run: DecoderRun, advance: Advance) -> Stop | None:
    """The emitted program in the MIL evaluator: fp32 per layer against the BC1L module, fp16
    gated and fp16-acc reported against the original model (and, opted in, the device-margin
    profile gated)."""
    rw, report = need(run.rewrite, "the rewrite"), need(run.report, "the torch report")
    run.conversion = check_conversion(
        run.main.path,
        rw.module,
        rw.batches,
        run.references,
        rw.embed_table,
        thresholds(run.recipe),
        run.recipe.precision,
        run.profiles,
        advance,
    )
    report.gates += run.conversion.gates  # the conversion level joins the torch report
    report.implementations.update(run.conversion.implementations)
    diagnose_fp16(run)
    write_parity_reports(run.job.directory, report, run.conversion, {"recipe": run.recipe.name})
    return None if report.passed else Stop("MIL-level")


def diagnose_fp16(run: DecoderRun) -> None:
    """An fp16 gate of the emitted program failed and the torch-fp16 level has not run: run
    it now, to say where the failure comes from. Its gates join the report (the run has
    failed already); its verdict names the rewrite (the module's own fp16 arithmetic fails
    too) or the conversion (only the program fails)."""
    report = need(run.report, "the torch report")
    failed = [g for g in report.gates if g.implementation == "mil-fp16" and not g.passed]
    if report.torch_fp16 == "run" or not failed:
        return
    rw = need(run.rewrite, "the rewrite")
    full = check_decoder(rw.module, rw.batches, run.references, rw.embed_table,
                         thresholds(run.recipe))  # fmt: skip
    fp16 = [g for g in full.gates if g.level == "torch-fp16"]
    at = max(i for i, g in enumerate(report.gates) if g.level == "torch-fp32") + 1
    report.gates[at:at] = fp16
    report.layers, report.fixtures = full.layers, full.fixtures
    report.first_diverging_layer = full.first_diverging_layer
    where = "the rewrite's own fp16 arithmetic fails too" if not all(g.passed for g in fp16) \
        else "the rewrite passes in fp16: the failure is the conversion's"  # fmt: skip
    report.torch_fp16 = f"run because {failed[0].name} ({failed[0].level}) failed: {where}"


def manifest(run: DecoderRun, advance: Advance) -> None:
    """Write the host files (embedding table, tokenizer) and manifest.json."""
    rw, ckpt, directory = (
        need(run.rewrite, "the rewrite"),
        need(run.ckpt, "ckpt"),
        run.job.directory,
    )
    embeddings = None
    if rw.module.io.inputs == "embeddings":
        embeddings = write_npy(
            directory / "embeddings.npy",
            rw.embed_table.numpy(),
            "embedding table (vocab, hidden); row t is the input for token id t",
            np.float16 if run.recipe.io.dtype == "float16" else np.float32,
        )
    tokenizer = write_tokenizer(
        directory,
        ckpt.tokenizer,
        "the checkpoint's tokenizer; a runtime refuses a draft whose vocabulary differs from "
        "its target's",
    )
    run.manifest = decoder_manifest(
        run.job, ckpt, rw.module, rw.scales, rw.scaling, run.main, embeddings, tokenizer,
        rw.assumed,
    )  # fmt: skip
    if run.vocabulary is not None:
        head_ids = write_head_ids(directory, run.vocabulary)
        run.manifest.draft_vocabulary = run.vocabulary.section(head_ids)
    write_json_atomic(directory / "manifest.json", run.manifest.model_dump(mode="json"))


def held_out(recipe: Recipe, ckpt: Checkpoint, rw: Rewrite) -> Any:
    """The compression section's held-out slice with the original model's logits, or None."""
    if recipe.compression is None:
        return None
    from converter.compression.decoder_variants import prepare_held_out

    c = recipe.compression
    return prepare_held_out(
        c.held_out, ckpt.tokenizer, ckpt.model, rw.module.io.length, rw.spec.vocab_size,
        c.mil_positions, pad_id(ckpt.tokenizer, ckpt.config), c.calibration,
    )  # fmt: skip


def _fixture_count(run: DecoderRun) -> int:
    return len(need(run.rewrite, "the rewrite").fixtures)


def _batches(run: DecoderRun) -> int:
    return len(need(run.rewrite, "the rewrite").batches)


def _trims(run: DecoderRun) -> bool:
    return run.recipe.vocabulary is not None


def _judged(run: DecoderRun) -> int:
    return judged_prompts(
        need(run.recipe.vocabulary, "vocabulary"), run.recipe.shapes.sequence_length
    )


# The draft-vocabulary step (recipe vocabulary:), for the window and the cached task alike.
VOCABULARY_STEP: Step[Any] = Step(
    "draft vocabulary (rank, judge by acceptance, trim)",
    with_parity_torch(trim_vocabulary),
    _judged,
    _trims,
)


def _torch_batches(run: DecoderRun) -> int:
    """The torch parity step's progress: each batch per level it runs."""
    return (1 + (run.recipe.gates.torch_fp16 == "always")) * _batches(run)


CONVERT_STEPS: tuple[Step[DecoderRun], ...] = (
    Step("load checkpoint", load),
    Step("rewrite to BC1L", with_parity_torch(rewrite)),
    VOCABULARY_STEP,
    Step("reference (original model)", with_parity_torch(references), _fixture_count),
    Step("parity (torch fp32)", with_parity_torch(torch_parity), _torch_batches),
    Step("convert to ML Program", convert),
    Step(
        "parity (MIL evaluator)",
        with_parity_torch(mil_parity),
        lambda run: evaluator_passes(run.profiles) * _batches(run),
    ),
    Step("write manifest", manifest),
    Step("plan (static)", plan),
)
# `anec parity`: the same gates on a published package, nothing converted or written into it.
RECHECK_STEPS = tuple(s for s in CONVERT_STEPS if s.run not in (convert, manifest, plan))


def compress(
    run: DecoderRun, published: Path, out_dir: Path, force: bool, progress: Steps
) -> list[Any]:
    """Build, gate and publish every compressed variant the recipe asks for (after the fp16
    artifact is published; each variant is its own artifact)."""
    if run.recipe.compression is None or run.held_out is None:
        return []
    from converter.compression.emit import emit_variants

    rw = need(run.rewrite, "the rewrite")
    return emit_variants(
        run.recipe.compression, run.recipe.name, published, rw.module, rw.embed_table,
        run.held_out, out_dir, run.recipe.gates.mil_fp32_layer_rel_error, force, progress,
    )  # fmt: skip
