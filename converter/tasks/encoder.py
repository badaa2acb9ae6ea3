"""The encoder tasks (feature-extraction, sentence-similarity, text-classification): their
state and step list.

    load -> rewrite to BC1L (+ prescales, host partition) -> reference -> torch parity (fp32,
        fp16, partitioned fp16) -> convert (single program, or island + tail; layer markers)
        -> MIL parity (fp32 per layer, fp16 gated) -> manifest -> plan (static)

With ``encoder.partition: host-embedding`` the artifact is three pieces called in order: the
host embedding step (tables in the I/O dtype), the NE island (every layer), and the tail.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from converter.checkpoints.loading import Checkpoint
from converter.errors import InputError
from converter.pipeline.manifest_fields import write_tokenizer
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.steps import Advance, Step, Stop
from converter.recipe import EncoderOptions, EncoderRecipe, Recipe
from converter.tasks.encoder_contract import (
    encoder_deviations,
    encoder_manifest,
    island_contract,
    single_contract,
    tail_contract,
    write_host_files,
)
from converter.tasks.shared import TaskRun, emit_program, load, need, plan, write_rows_parity
from graph_passes.archs import adapt_encoder
from graph_passes.encoder import BC1LEncoder, EncoderIO, EncoderOutput, SentenceEmbeddingTail
from graph_passes.layer_norm import FP16_EPS_FLOOR, apply_layer_norm_prescales, measure_centred_l2
from graph_passes.partition import (
    HostEmbedding,
    Island,
    Tail,
    host_embedding,
    prenormalized_table_check,
)
from graph_passes.prescale import NormScale, choose_prescale
from graph_passes.spec import EncoderModel
from parity.encoder_gates import (
    MIL_LEVEL,
    check_encoder,
    encoder_runner,
    fixture_rows_to_text,
    fp16_module,
    host_runner,
    run_encoder_reference,
)
from parity.encoder_mil import layer_level, output_runner
from parity.fixtures import Batch, Fixture, build_fixtures, make_batches, pad_id
from parity.gate_registry import GateResult
from parity.mil_fp32 import Fp32Check
from parity.mil_level import Fp32Run, MilSubject, Progress, run_mil_level
from parity.result import OUTPUT, ParityReport, Runner, merge_rows
from parity.thresholds import Thresholds
from parity.torch_settings import with_parity_torch

OUTPUTS: dict[str, EncoderOutput] = {
    "feature-extraction": "last-hidden-state",
    "sentence-similarity": "sentence-embedding",
    "text-classification": "logits",
}
PARTITIONED = "partitioned-fp16"


@dataclass
class EncoderRewrite:
    """The BC1L encoder for a recipe, its fixtures, prescales and (optional) host step."""

    canonical: EncoderModel
    module: BC1LEncoder
    fixtures: list[Fixture]
    batches: list[Batch]
    scales: list[NormScale]
    pooled_prescale: float  # sentence embeddings: the power of two before the L2 norm
    host: HostEmbedding | None


@dataclass
class BC1LRun(TaskRun):
    """An encoder or decision conversion in progress: the references, the per-fixture rows
    of every implementation and the report's extra JSON fields."""

    references: dict[str, Any] = field(default_factory=dict)
    rows: list[Any] = field(default_factory=list)
    extra_json: dict[str, Any] = field(default_factory=dict)

    def write_parity(self) -> None:
        """parity.json, parity.txt and parity.html of the report so far."""
        raise NotImplementedError


@dataclass
class EncoderRun(BC1LRun):
    """An encoder conversion in progress."""

    rewrite: EncoderRewrite | None = None
    held_out: Any = None  # compress EncoderHeldOut when the recipe has a compression section

    def write_parity(self) -> None:
        """The report files, then the per-fixture table in parity.txt."""
        text = "\n\n" + fixture_rows_to_text(self.rows)
        write_rows_parity(self, "encoder_fixtures", self.rows, self.extra_json, text)

    def num_layers(self) -> int:
        """Transformer layers of the converted model."""
        return need(self.rewrite, "the rewrite").module.spec.num_layers

    @property
    def recipe(self) -> EncoderRecipe:
        """The recipe being converted (an encoder recipe: the task registry says so)."""
        recipe = self.job.recipe
        assert isinstance(recipe, EncoderRecipe)
        return recipe

    @property
    def options(self) -> EncoderOptions:
        """The recipe's encoder section."""
        return self.recipe.encoder


def output_kind(task: str) -> EncoderOutput:
    """The encoder output a recipe task asks for."""
    if task not in OUTPUTS:
        raise InputError(f"task: {task!r} is not an encoder task")
    return OUTPUTS[task]


def set_scales(module: BC1LEncoder, batches: list[Batch]) -> tuple[list[NormScale], float]:
    """Measure every LayerNorm input (centred L2) and the pooled sentence vector on the fixtures
    (fp32) and set power-of-two prescales; returns what was chosen."""
    norms, pooled_max = module.norms(), 0.0
    sentence = module.tail if isinstance(module.tail, SentenceEmbeddingTail) else None

    def tail(h: torch.Tensor, key_mask: torch.Tensor, _: Batch) -> dict[str, torch.Tensor]:
        nonlocal pooled_max
        if sentence is not None:
            pooled = sentence.pooled(h, key_mask)
            pooled_max = max(pooled_max, float(pooled.double().norm(dim=1).max()))
        return {OUTPUT: module.tail(h, key_mask)}

    run = encoder_runner(module, torch.float32, tail)
    maxima = measure_centred_l2(norms, lambda: [run(batch) for batch in batches])
    scales = apply_layer_norm_prescales(norms, maxima, FP16_EPS_FLOOR)
    prescale = choose_prescale(pooled_max)
    if sentence is not None:
        sentence.normalize.set_prescale(prescale)
    return scales, prescale


def rewrite_encoder(
    recipe: EncoderRecipe, ckpt: Checkpoint, options: EncoderOptions
) -> EncoderRewrite:
    """Adapt the checkpoint, build the BC1L encoder, its fixtures and prescales."""
    canonical = adapt_encoder(ckpt.config, ckpt.model.state_dict())
    kind = output_kind(recipe.task)
    if kind == "logits" and canonical.spec.classifier is None:
        raise InputError("task: text-classification needs a checkpoint with a classifier head")
    length = recipe.shapes.sequence_length
    io = EncoderIO(recipe.shapes.batch, length, "token-ids", kind)
    module = BC1LEncoder(canonical, io).eval()
    fixtures = build_fixtures(
        recipe.fixtures.prompts,
        recipe.fixtures.token_ids,
        ckpt.tokenizer,
        length,
        canonical.spec.embedding.vocab_size,
        recipe.fixtures.padded_variants,
        recipe.fixtures.pairs,
        canonical.spec.embedding.type_vocab_size,
    )
    pad = pad_id(ckpt.tokenizer, ckpt.config)
    batches = make_batches(fixtures, io.batch, length, pad, right=True)
    scales, pooled = set_scales(module, batches)
    host = None
    if options.partition == "host-embedding":
        dtype = torch.float16 if recipe.io.dtype == "float16" else torch.float32
        try:
            host = host_embedding(canonical, length, options.prenormalize_embeddings, dtype)
        except ValueError as e:
            raise InputError(f"encoder.{e}") from None
    return EncoderRewrite(canonical, module, fixtures, batches, scales, pooled, host)


def partitioned_runner(module: BC1LEncoder, host: HostEmbedding) -> Runner:
    """Host embedding -> island (fp16) -> tail (fp16), as the runtime calls them."""
    half = fp16_module(module)
    island, tail = Island(half).eval(), Tail(half).eval()

    def head(h: torch.Tensor, key_mask: torch.Tensor, _: Batch) -> dict[str, torch.Tensor]:
        return {OUTPUT: h if island.returns_task_output else tail(h, key_mask)}

    return host_runner(host, island, head)


def thresholds(recipe: Recipe) -> Thresholds:
    """The recipe's gates for an encoder (fixed in the recipe before measuring)."""
    return Thresholds(**recipe.gates.parity_thresholds())


def program_module(module: BC1LEncoder, precision: str) -> BC1LEncoder:
    """The module to trace: fp32 weights, with the fp16 epsilon floors for an fp16 program."""
    out = copy.deepcopy(module).eval()
    out.set_eps_floor(FP16_EPS_FLOOR if precision == "float16" else 0.0)
    return out


# ---- steps -----------------------------------------------------------------------------------


def rewrite(run: EncoderRun, advance: Advance) -> None:
    """Adapt the checkpoint into the BC1L encoder, its fixtures and host step."""
    if run.recipe.compression is not None and run.options.partition != "single":
        raise InputError(
            "compression: variants of a partitioned encoder (encoder.partition: "
            "host-embedding) are not implemented; use partition: single"
        )
    run.rewrite = rewrite_encoder(run.recipe, need(run.ckpt, "the checkpoint"), run.options)


def references(run: EncoderRun, advance: Advance) -> None:
    """The original model on every fixture, unpadded; then its memory is freed."""
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    for fixture in rw.fixtures:
        run.references[fixture.name] = run_encoder_reference(
            ckpt.model, fixture, rw.module.io.output
        )
        advance()
    if run.recipe.compression is not None:  # the held-out sentences, while the model is here
        from converter.compression.encoder_variants import prepare_encoder_held_out

        compression = run.recipe.compression
        run.held_out = prepare_encoder_held_out(
            compression.held_out, ckpt.tokenizer, ckpt.model, rw.module,
            pad_id(ckpt.tokenizer, ckpt.config), compression.calibration,
        )  # fmt: skip
    del ckpt.model


def torch_parity(run: EncoderRun, advance: Advance) -> Stop | None:
    """The BC1L encoder in fp32 and fp16 (and the partitioned pieces) against the reference."""
    rw = need(run.rewrite, "the rewrite")
    extra: dict[str, Runner] = {}
    described: dict[str, str] = {}
    if rw.host is not None:
        extra[PARTITIONED] = partitioned_runner(rw.module, rw.host)
        described[PARTITIONED] = (
            "host embedding from the shipped tables"
            + (" (pre-normalised offline)" if rw.host.prenormalized else " with an fp32 norm")
            + " -> island -> tail, each the fp16 torch module"
        )
        if rw.host.prenormalized:
            run.extra_json["prenormalized_table"] = prenormalized_table_check(rw.canonical, rw.host)
    run.report, run.rows = check_encoder(
        rw.module, rw.batches, run.references, thresholds(run.recipe), extra
    )
    run.report.implementations.update(described)
    run.write_parity()
    return None if run.report.passed else Stop("parity")


def convert(run: EncoderRun, advance: Advance) -> None:
    """Trace (layer outputs marked), convert and save the single program, or island and tail."""
    rw, recipe = need(run.rewrite, "the rewrite"), run.recipe
    program = program_module(rw.module, recipe.precision)
    dtype, n = recipe.io.dtype, program.spec.num_layers
    # Layer markers live in the program's `layers` container; Island wraps the encoder, so
    # its layers are `encoder.layers` - mark_layer_outputs finds them by that path.
    if rw.host is None:
        emit_program(
            run, "main", program, single_contract(program, dtype), f"{recipe.name}.mlpackage", n
        )
        return
    island = Island(program).eval()
    emit_program(
        run, "island", island, island_contract(program, dtype), f"{recipe.name}.island.mlpackage", n
    )
    if program.io.output != "last-hidden-state":
        tail = Tail(program).eval()
        emit_program(
            run, "tail", tail, tail_contract(program, dtype), f"{recipe.name}.tail.mlpackage"
        )


def gate_program(run: BC1LRun, prepare: Callable[[], tuple[Fp32Check, Runner]],
                 check: Callable[[Runner], tuple[ParityReport, list[Any]]],
                 described: dict[str, str], over: str, against: str,
                 more: Callable[[], list[GateResult]] = list) -> Stop | None:  # fmt: skip
    """Record the MIL level (`parity.mil_level.run_mil_level`) of the fp32 layer check and
    fp16 runner ``prepare`` makes: its fp32 gates (max over ``over``, against ``against``),
    ``more`` gates, and the fp16 run as `MIL_LEVEL` through ``check`` (its rows merged into the
    run's), the implementations ``described``; when the program cannot run, `MIL_LEVEL` as
    failed and why. Then the report files."""
    report = need(run.report, "report")
    programs = len(run.programs)
    prepared: list[Runner] = []
    detail = (f"max over {over} of ||h'-h||/||h|| at real slots, against the {against} with "
              "the program's constants in fp64")  # fmt: skip

    def fp32(progress: Progress) -> Fp32Run:
        layers, runner = prepare()
        prepared.append(runner)
        found = f"{programs} program(s) prepared; layer markers found"
        return Fp32Run(layers, detail, found=found)

    def fp16() -> list[GateResult]:
        mil_report, mil_rows = check(prepared[0])
        merge_rows(run.rows, mil_rows)
        return mil_report.gates

    threshold = run.recipe.gates.mil_fp32_layer_rel_error
    level = run_mil_level(MilSubject(fp32, fp16, threshold, lambda progress: more()))
    report.gates += level.gates
    if level.error:
        report.implementations[MIL_LEVEL] = f"failed: {level.error}"
        run.write_parity()
        return Stop("MIL-level")
    run.extra_json["mil_fp32_layer_rel_error"] = level.layer_rel_error
    report.implementations.update(described)
    run.write_parity()
    return None if report.passed else Stop("MIL-level")


def mil_parity(run: EncoderRun, advance: Advance) -> Stop | None:
    """The emitted program(s) in the MIL evaluator: fp32 per layer against the BC1L module,
    fp16 task output gated against the original model. A program the evaluator cannot run is
    a failed gate."""
    rw, recipe = need(run.rewrite, "rewrite"), run.recipe
    packages = {p.piece: p.path for p in run.programs}
    return gate_program(
        run,
        lambda: (
            layer_level(run.main.path, rw.module, rw.host, rw.batches, recipe.io.dtype,
                        recipe.precision),
            output_runner(packages, rw.module, rw.host, recipe.io.dtype),
        ),
        lambda runner: check_encoder(rw.module, rw.batches, run.references, thresholds(recipe),
                                     {MIL_LEVEL: runner}, torch_levels=False),
        {"mil-fp32": "anec MIL evaluator, profile fp32, on the emitted program",
         MIL_LEVEL: "anec MIL evaluator, profile fp16, on the emitted program(s)"},
        "layers and fixtures", "BC1L module",
    )  # fmt: skip


def manifest(run: EncoderRun, advance: Advance) -> None:
    """Write the host tables, the tokenizer and manifest.json."""
    rw, ckpt, directory = need(run.rewrite, "rewrite"), need(run.ckpt, "ckpt"), run.job.directory
    host_files = write_host_files(directory, rw.host) if rw.host is not None else None
    tokenizer = write_tokenizer(directory, ckpt.tokenizer, "the checkpoint's tokenizer")
    deviations = encoder_deviations(
        rw.module, rw.scales, rw.pooled_prescale, rw.host, run.recipe.precision
    )
    run.manifest = encoder_manifest(
        run.job, ckpt, rw.module, run.options, run.programs, host_files, tokenizer, deviations,
        rw.host,
    )  # fmt: skip
    write_json_atomic(directory / "manifest.json", run.manifest.model_dump(mode="json"))


def _fixture_count(run: EncoderRun) -> int:
    return len(need(run.rewrite, "the rewrite").fixtures)


CONVERT_STEPS: tuple[Step[EncoderRun], ...] = (
    Step("load checkpoint", load),
    Step("rewrite to BC1L", with_parity_torch(rewrite)),
    Step("reference (original model)", with_parity_torch(references), _fixture_count),
    Step("parity (torch fp32, fp16)", with_parity_torch(torch_parity)),
    Step("convert to ML Program", convert),
    Step("parity (MIL: fp32, fp16)", with_parity_torch(mil_parity)),
    Step("write manifest", manifest),
    Step("plan (static)", plan),
)
# `anec parity`: the same gates on a published package, nothing converted or written into it.
RECHECK_STEPS = tuple(s for s in CONVERT_STEPS if s.run not in (convert, manifest, plan))


def compress(
    run: EncoderRun, published: Path, out_dir: Path, force: bool, progress: Steps
) -> list[Any]:
    """Build, gate and publish every compressed variant the recipe asks for (after the fp16
    artifact is published; each variant is its own artifact, gated on cosine / argmax)."""
    if run.recipe.compression is None or run.held_out is None:
        return []
    from converter.compression.encoder_variants import emit_encoder_variants

    rw = need(run.rewrite, "the rewrite")
    return emit_encoder_variants(
        run.recipe.compression, run.recipe.name, published, rw.module, run.held_out, out_dir,
        run.recipe.gates.mil_fp32_layer_rel_error, run.recipe.task, force, progress,
    )  # fmt: skip
