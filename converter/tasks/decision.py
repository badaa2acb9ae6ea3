"""The decision task: a ModernBERT encoder with a decision head (docs/decision-head.md).

    load -> rewrite (encoder + head stack, tail, prenormalised host table, prescales) ->
    reference (transformers encoder + reference head) -> torch parity (fp32 per layer and per
    output; fp16 and the partitioned pieces) -> convert (NE island, CPU tail; layer markers)
    -> MIL parity (island fp32 per layer; island + tail fp16 gated) -> manifest -> plan

The partition is fixed: host embedding rows (pre-normalised table) | NE island (every encoder
layer, the encoder's final norm, every head layer, the head norm) | CPU tail (gather at the
run-time candidate positions, scorer, raw and calibrated probabilities, action head on the raw
probabilities). Steps shared with the encoder tasks are reused as they are.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from converter.checkpoints.loading import load_checkpoint
from converter.errors import InputError
from converter.pipeline.hashing import sha256_file
from converter.pipeline.manifest_fields import write_tokenizer
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic
from converter.pipeline.steps import Advance, Step, Stop
from converter.recipe import DecisionRecipe
from converter.tasks.decision_contract import decision_manifest, island_contract, tail_contract
from converter.tasks.decision_load import head_files, load_head
from converter.tasks.encoder import BC1LRun, gate_program, program_module, set_scales
from converter.tasks.encoder_contract import encoder_deviations, write_host_files
from converter.tasks.shared import emit_program, need, plan, write_rows_parity
from graph_passes.archs import adapt_encoder
from graph_passes.decision import DecisionEncoder, DecisionIsland, DecisionTail, tail_outputs
from graph_passes.decision_spec import CandidateError, DecisionHead
from graph_passes.encoder import EncoderIO
from graph_passes.partition import HostEmbedding, host_embedding
from graph_passes.prescale import NormScale
from graph_passes.spec import EncoderModel
from parity.decision_gates import (
    batch_positions,
    check_decision,
    fp16_pieces,
    make_decision_batches,
)
from parity.decision_reference import DecisionHeadReference, run_decision_reference
from parity.encoder_gates import MIL_LEVEL, host_runner
from parity.encoder_mil import (
    decision_mil_runner,
    layer_level,
    tail_marker_rows_error,
)
from parity.fixtures import Batch, Fixture, build_fixtures, pad_id
from parity.gate_registry import GateResult, gate
from parity.result import Runner
from parity.thresholds import Thresholds
from parity.torch_settings import with_parity_torch

PARTITIONED = "partitioned-fp16"


@dataclass
class DecisionRewrite:
    """The BC1L decision model for a recipe, its fixtures, prescales and host step."""

    encoder: EncoderModel
    head: DecisionHead
    head_tensors: dict[str, torch.Tensor]
    head_sha256: str
    module: DecisionEncoder
    tail: DecisionTail
    fixtures: list[Fixture]
    batches: list[Batch]
    slices: dict[str, list[str]]
    scales: list[NormScale]
    host: HostEmbedding


@dataclass
class DecisionRun(BC1LRun):
    """A decision conversion in progress."""

    rewrite: DecisionRewrite | None = None

    def num_layers(self) -> int:
        """Encoder and head layers of the island."""
        return len(need(self.rewrite, "the rewrite").module.layers)

    @property
    def recipe(self) -> DecisionRecipe:
        """The recipe being converted (a decision recipe: the task registry says so)."""
        recipe = self.job.recipe
        assert isinstance(recipe, DecisionRecipe)
        return recipe

    def write_parity(self) -> None:
        """The report files, the per-request rows under ``decision_requests``."""
        write_rows_parity(self, "decision_requests", self.rows, self.extra_json)


def thresholds(recipe: DecisionRecipe) -> Thresholds:
    """The recipe's decision gates (fixed in the recipe before measuring)."""
    d = recipe.decision
    return Thresholds(
        **recipe.gates.parity_thresholds(),
        fp32_marker_rows_rel_error=d.fp32_marker_rows_rel_error,
        candidate_argmax_agreement=d.candidate_argmax_agreement,
        action_argmax_agreement=d.action_argmax_agreement,
        max_abs_dprob_calibrated=d.max_abs_dprob_calibrated,
        max_abs_dprob_action=d.max_abs_dprob_action,
        narrow_margin=d.narrow_margin,
    )


def build_rewrite(recipe: DecisionRecipe, run: DecisionRun) -> DecisionRewrite:
    """Adapt the encoder, read the head, build the stack, tail, fixtures and host step."""
    ckpt = need(run.ckpt, "the checkpoint")
    encoder = adapt_encoder(ckpt.config, ckpt.model.state_dict())
    if encoder.spec.architecture != "modernbert":
        raise InputError(
            f"task decision: the encoder must be ModernBERT-family (ModernBERT, mmBERT), got "
            f"{encoder.spec.architecture}"
        )
    head, tensors, digest = load_head(
        run.job.source.directory, encoder.spec, recipe.decision.head_dir
    )
    length, batch = recipe.shapes.sequence_length, recipe.shapes.batch
    io = EncoderIO(batch, length, "token-ids", "last-hidden-state")
    module = DecisionEncoder(encoder, head, io).eval()
    tail = DecisionTail(head, io).eval()
    fixtures = build_fixtures(
        recipe.fixtures.prompts, recipe.fixtures.token_ids, ckpt.tokenizer, length,
        encoder.spec.embedding.vocab_size, recipe.fixtures.padded_variants,
    )  # fmt: skip
    try:
        batches, slices = make_decision_batches(
            fixtures, batch, length, pad_id(ckpt.tokenizer, ckpt.config), head.spec
        )
    except CandidateError as e:
        raise InputError(f"fixtures: {e}") from None
    scales = set_scales(module, batches)[0]
    dtype = torch.float16 if recipe.io.dtype == "float16" else torch.float32
    host = host_embedding(encoder, length, recipe.decision.prenormalize_embeddings, dtype)
    return DecisionRewrite(encoder, head, tensors, digest, module, tail, fixtures, batches,
                           slices, scales, host)  # fmt: skip


def partitioned_runner(rw: DecisionRewrite) -> Runner:
    """Host embedding -> island (fp16) -> tail (fp16), as the runtime calls them."""
    half, tail = fp16_pieces(rw.module, rw.tail)

    def head(h: torch.Tensor, _: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return tail_outputs(tail(h, batch_positions(batch, tail.spec)))

    return host_runner(rw.host, DecisionIsland(half).eval(), head)


# ---- steps -----------------------------------------------------------------------------------


def load_with_head(run: DecisionRun, advance: Advance) -> None:
    """Load the encoder checkpoint; its recorded sha256 covers the head's two files too, so
    `anec parity` refuses an artifact whose head changed since it was converted."""
    job = run.job
    ckpt = load_checkpoint(job.source, run.recipe.task, allow_pickle=job.allow_pickle)
    digest = hashlib.sha256(ckpt.sha256.encode())
    for path in head_files(job.source.directory, run.recipe.decision.head_dir):
        if not path.is_file():
            raise InputError(f"{path}: missing; a decision checkpoint holds its head there "
                             "(see docs/decision-head.md)")  # fmt: skip
        digest.update(sha256_file(path).encode())
    ckpt.sha256 = digest.hexdigest()
    expected = job.expected_checkpoint_sha256
    if expected is not None and ckpt.sha256 != expected:
        raise InputError(
            f"{job.source.directory}: the checkpoint (encoder and decision head) differs from "
            f"the one the artifact was converted from (sha256 {ckpt.sha256[:12]}..., manifest "
            f"{expected[:12]}...)"
        )
    run.ckpt = ckpt


def rewrite(run: DecisionRun, advance: Advance) -> None:
    """Adapt the checkpoint and the head into the BC1L stack, its tail and host step."""
    run.rewrite = build_rewrite(run.recipe, run)


def references(run: DecisionRun, advance: Advance) -> None:
    """The original function on every fixture, unpadded; then the encoder's memory is freed."""
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    head = DecisionHeadReference(ckpt.config, rw.head.spec).eval()
    head.load_head(rw.head_tensors)
    for fixture in rw.fixtures:
        run.references[fixture.name] = run_decision_reference(
            ckpt.model, head, fixture.token_ids, fixture.name
        )
        advance()
    del ckpt.model


def torch_parity(run: DecisionRun, advance: Advance) -> Stop | None:
    """The stack in fp32 and fp16 and the partitioned pieces against the reference."""
    rw = need(run.rewrite, "the rewrite")
    run.report, run.rows = check_decision(
        rw.module, rw.tail, rw.batches, rw.slices, run.references, thresholds(run.recipe),
        extra={PARTITIONED: partitioned_runner(rw)},
    )  # fmt: skip
    run.report.implementations[PARTITIONED] = (
        "host embedding from the shipped pre-normalised table -> island -> tail, each the fp16 "
        "torch module"
    )
    run.write_parity()
    return None if run.report.passed else Stop("parity")


def convert(run: DecisionRun, advance: Advance) -> None:
    """Trace (layer outputs marked), convert and save the island and the tail."""
    rw, recipe = need(run.rewrite, "the rewrite"), run.recipe
    program = program_module(rw.module, recipe.precision)
    assert isinstance(program, DecisionEncoder)
    dtype, n = recipe.io.dtype, len(program.layers)
    island = DecisionIsland(program).eval()
    emit_program(run, "island", island, island_contract(program, dtype),
                 f"{recipe.name}.island.mlpackage", n)  # fmt: skip
    emit_program(run, "tail", copy.deepcopy(rw.tail).eval(), tail_contract(program, rw.tail, dtype),
                 f"{recipe.name}.tail.mlpackage")  # fmt: skip


def mil_parity(run: DecisionRun, advance: Advance) -> Stop | None:
    """The island in the MIL evaluator's fp32 profile, layer by layer, against the stack, and
    the emitted tail's gather; the island + tail in the fp16 profile, gated against the
    reference."""
    rw, recipe = need(run.rewrite, "rewrite"), run.recipe
    packages = {p.piece: p.path for p in run.programs}

    def marker_rows() -> list[GateResult]:
        rows_error, rows_where = tail_marker_rows_error(
            packages["tail"], packages["island"], rw.host, rw.tail.spec, rw.batches,
            recipe.io.dtype,
        )  # fmt: skip
        return [gate("mil-fp32", "fp32_marker_rows_rel_error").check(
            rows_error, recipe.decision.fp32_marker_rows_rel_error, where=rows_where,
            detail="the emitted tail's gather at candidate_positions, fp32 profile",
        )]  # fmt: skip

    return gate_program(
        run,
        lambda: (
            layer_level(packages["island"], rw.module, rw.host, rw.batches, recipe.io.dtype,
                        recipe.precision, rw.module.layer_name),
            decision_mil_runner(packages, rw.host, rw.tail.spec, recipe.io.dtype),
        ),
        lambda runner: check_decision(rw.module, rw.tail, rw.batches, rw.slices, run.references,
                                      thresholds(recipe), {MIL_LEVEL: runner}, False),
        {MIL_LEVEL: "anec MIL evaluator, profile fp16, island then tail"},
        "encoder and head layers and requests", "stack", marker_rows,
    )  # fmt: skip


def manifest(run: DecisionRun, advance: Advance) -> None:
    """Write the host table, the tokenizer and manifest.json."""
    rw, ckpt, directory = need(run.rewrite, "rewrite"), need(run.ckpt, "ckpt"), run.job.directory
    host_files = write_host_files(directory, rw.host)
    tokenizer = write_tokenizer(directory, ckpt.tokenizer, "the checkpoint's tokenizer")
    deviations = encoder_deviations(rw.module, rw.scales, 1.0, rw.host, run.recipe.precision)
    run.manifest = decision_manifest(
        run.job, ckpt, rw.module, rw.head, rw.head_sha256, run.programs, host_files, tokenizer,
        deviations, rw.host,
    )  # fmt: skip
    write_json_atomic(directory / "manifest.json", run.manifest.model_dump(mode="json"))


def _fixture_count(run: DecisionRun) -> int:
    return len(need(run.rewrite, "the rewrite").fixtures)


CONVERT_STEPS: tuple[Step[DecisionRun], ...] = (
    Step("load checkpoint and head", load_with_head),
    Step("rewrite to BC1L (encoder + decision head)", with_parity_torch(rewrite)),
    Step("reference (original model and head)", with_parity_torch(references), _fixture_count),
    Step("parity (torch fp32, fp16, partitioned)", with_parity_torch(torch_parity)),
    Step("convert island and tail", convert),
    Step("parity (MIL: fp32, fp16)", with_parity_torch(mil_parity)),
    Step("write manifest", manifest),
    Step("plan (static)", plan),
)
RECHECK_STEPS = tuple(s for s in CONVERT_STEPS if s.run not in (convert, manifest, plan))


def compress(
    run: DecisionRun, published: Path, out_dir: Path, force: bool, progress: Steps
) -> list[Any]:
    """No compressed variants for decision models (the recipe refuses a compression section)."""
    return []
