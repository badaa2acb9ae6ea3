"""The conversion pipeline for encoders (BERT, ModernBERT): recipe -> proven package(s) + manifest.

    load checkpoint -> adapt -> BC1L encoder -> prescales -> torch parity (fp32, fp16,
        partitioned fp16) -> trace -> ML Program(s) (fp16) -> MIL-level parity (when the
        evaluator is available) -> emit atomically

Tasks: ``feature-extraction`` (last hidden state), ``sentence-similarity`` (mean pooling over
real tokens + L2 normalisation), ``text-classification`` (the checkpoint's head). With
``encoder.partition: host-embedding`` the artifact is three pieces called in order: the host
embedding step (fp16 tables), the NE island (every layer), and the tail package.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.checkpoint import Checkpoint, load_checkpoint
from converter.coreml import TensorIO, live_ops, to_mlprogram, trace
from converter.errors import InputError
from converter.manifest import BoundaryEntry, Deviation, FileEntry, Manifest, PieceEntry
from converter.manifest_fields import common_fields, package_entry, write_npy, write_tokenizer
from converter.pipeline import ConvertResult, _pad_id, gate_failed, published
from converter.progress import Steps
from converter.publish import (
    clean_leftovers,
    stage_artifact,
    write_json_atomic,
    write_text_atomic,
)
from converter.recipe import EncoderOptions, EncoderRecipe, Recipe, ResolvedSource
from converter.runlog import write_log_into
from converter.targets import TARGETS
from graph_passes.adapters import adapt_encoder
from graph_passes.encoder import (
    BC1LEncoder,
    EncoderIO,
    EncoderOutput,
    SentenceEmbeddingTail,
)
from graph_passes.layer_norm import FP16_EPS_FLOOR, apply_layer_norm_prescales, measure_centred_l2
from graph_passes.masks import MASKED, key_mask_from_padding
from graph_passes.partition import (
    Boundary,
    HostEmbedding,
    Island,
    Tail,
    boundaries,
    host_embedding,
    prenormalized_table_check,
)
from graph_passes.prescale import NormScale, choose_prescale
from graph_passes.spec import EncoderModel
from parity.encoder_gates import (
    MIL_LEVEL,
    EncoderFixtureRow,
    EncoderReference,
    EncoderThresholds,
    Runner,
    check_encoder,
    fixture_rows_to_json,
    fixture_rows_to_text,
    fp16_module,
    make_encoder_batches,
    module_inputs,
    run_encoder_reference,
)
from parity.fixtures import Batch, Fixture, build_fixtures
from parity.gates import ParityReport
from parity.report import report_to_json, report_to_text

_OUTPUTS: dict[str, EncoderOutput] = {
    "feature-extraction": "last-hidden-state",
    "sentence-similarity": "sentence-embedding",
    "text-classification": "logits",
}
_OUTPUT_NAMES = {
    "last-hidden-state": "last_hidden_state",
    "sentence-embedding": "sentence_embedding",
    "logits": "logits",
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


def output_kind(task: str) -> EncoderOutput:
    """The encoder output a recipe task asks for."""
    if task not in _OUTPUTS:
        raise InputError(f"task: {task!r} is not an encoder task")
    return _OUTPUTS[task]


def set_scales(module: BC1LEncoder, batches: list[Batch]) -> tuple[list[NormScale], float]:
    """Measure every LayerNorm input (centred L2) and the pooled sentence vector on the fixtures
    (fp32) and set power-of-two prescales; returns what was chosen."""
    norms = module.norms()
    pooled_max = 0.0

    def run_all() -> None:
        nonlocal pooled_max
        for batch in batches:
            *x, key_mask = module_inputs(module, batch, torch.float32)
            h = module.finish(
                module.run_layers(module.embed(x[0], x[1] if x[1:] else None), key_mask)[-1]
            )
            if isinstance(module.tail, SentenceEmbeddingTail):
                pooled = module.tail.pooled(h, key_mask)
                pooled_max = max(pooled_max, float(pooled.double().norm(dim=1).max()))
            module.tail(h, key_mask)

    scales = apply_layer_norm_prescales(norms, measure_centred_l2(norms, run_all), FP16_EPS_FLOOR)
    prescale = choose_prescale(pooled_max)
    if isinstance(module.tail, SentenceEmbeddingTail):
        module.tail.normalize.set_prescale(prescale)
    return scales, prescale


def rewrite_encoder(recipe: Recipe, ckpt: Checkpoint, options: EncoderOptions) -> EncoderRewrite:
    """Adapt the checkpoint, build the BC1L encoder, its fixtures and prescales."""
    canonical = adapt_encoder(ckpt.config, ckpt.model.state_dict())
    kind = output_kind(recipe.task)
    if kind == "logits" and canonical.spec.classifier is None:
        raise InputError("task: text-classification needs a checkpoint with a classifier head")
    if kind == "sentence-embedding" and (options.pooling != "mean" or not options.normalize):
        raise InputError("encoder: only mean pooling with L2 normalisation is implemented")
    length = recipe.shapes.sequence_length
    if recipe.shapes.batch * length > 16384:
        raise InputError("shapes: batch * sequence_length exceeds the NE's per-axis limit 16384")
    io = EncoderIO(recipe.shapes.batch, length, "token-ids", kind)
    module = BC1LEncoder(canonical, io).eval()
    fixtures = build_fixtures(
        recipe.fixtures.prompts,
        recipe.fixtures.token_ids,
        ckpt.tokenizer,
        length,
        canonical.spec.embedding.vocab_size,
        recipe.fixtures.padded_variants,
    )
    batches = make_encoder_batches(fixtures, io.batch, length, _pad_id(ckpt))
    scales, pooled = set_scales(module, batches)
    host = None
    if options.partition == "host-embedding":
        try:
            host = host_embedding(canonical, length, options.prenormalize_embeddings)
        except ValueError as e:
            raise InputError(f"encoder.{e}") from None
    elif options.prenormalize_embeddings:
        raise InputError("encoder.prenormalize_embeddings: needs partition: host-embedding")
    return EncoderRewrite(canonical, module, fixtures, batches, scales, pooled, host)


def partitioned_runner(module: BC1LEncoder, host: HostEmbedding) -> Runner:
    """Host embedding (fp16 tables) -> island (fp16) -> tail (fp16), as the runtime calls them."""
    half = fp16_module(module)
    island, tail = Island(half).eval(), Tail(half).eval()

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        key_mask = key_mask_from_padding(batch.attention_mask).half()
        rows = host(batch.input_ids, torch.zeros_like(batch.input_ids))
        with torch.no_grad():
            out = island(rows, key_mask)
            if not island.returns_task_output:
                out = tail(out, key_mask)
        return None, out

    return run


def thresholds_for(recipe: Recipe, options: EncoderOptions) -> EncoderThresholds:
    """The recipe's gates for an encoder (fixed in the recipe before measuring)."""
    g = recipe.gates
    return EncoderThresholds(
        fp32_layer_rel_error=g.fp32_layer_rel_error,
        fp32_output_rel_error=g.fp32_logits_rel_error,
        fp32_min_cosine=options.fp32_min_cosine,
        fp16_min_cosine=options.fp16_min_cosine,
        fp16_argmax_agreement=g.fp16_argmax_agreement,
        fp16_max_abs_dprob=g.fp16_max_abs_dprob,
    )


# ---- tensor contracts ------------------------------------------------------------------------


def output_io(module: BC1LEncoder, dtype: str) -> TensorIO:
    """The task output of the emitted function."""
    io, d = module.io, module.spec.hidden_size
    if io.output == "last-hidden-state":
        return TensorIO(
            "last_hidden_state",
            (io.batch, io.length, d),
            dtype,  # type: ignore[arg-type]
            "hidden state after the last layer (and final norm): [batch, position, channel]; "
            "padded positions are finite and meaningless",
        )
    if io.output == "sentence-embedding":
        return TensorIO(
            "sentence_embedding",
            (io.batch, d),
            dtype,  # type: ignore[arg-type]
            "mean of the last hidden state over real tokens, L2-normalised",
        )
    classifier = module.spec.classifier
    assert classifier is not None
    return TensorIO(
        "logits",
        (io.batch, classifier.num_labels),
        dtype,  # type: ignore[arg-type]
        f"classifier logits, labels in order: {', '.join(classifier.labels)}",
    )


def _key_mask_io(module: BC1LEncoder, dtype: str) -> TensorIO:
    io = module.io
    return TensorIO(
        "key_mask",
        (io.batch, io.length),
        dtype,  # type: ignore[arg-type]
        f"additive key mask: 0 for a real token, {MASKED:g} for padding (right padding)",
    )


def single_contract(module: BC1LEncoder, dtype: str) -> tuple[list[TensorIO], list[TensorIO]]:
    """Inputs and outputs of the single program."""
    io = module.io
    inputs = [TensorIO("input_ids", (io.batch, io.length), "int32", "token ids, right-padded")]
    if module.embedding.types is not None:
        inputs.append(
            TensorIO("token_type_ids", (io.batch, io.length), "int32", "segment ids (0 or 1)")
        )
    return [*inputs, _key_mask_io(module, dtype)], [output_io(module, dtype)]


def island_contract(module: BC1LEncoder, dtype: str) -> tuple[list[TensorIO], list[TensorIO]]:
    """Inputs and outputs of the NE island."""
    io, d = module.io, module.spec.hidden_size
    rows = TensorIO(
        "inputs_embeds",
        (io.batch, io.length, d),
        dtype,  # type: ignore[arg-type]
        "normalised embedding rows from the host embedding step, right-padded",
    )
    if io.output == "last-hidden-state":
        out = output_io(module, dtype)
    else:
        out = TensorIO(
            "hidden",
            (1, d, 1, io.slots),
            dtype,  # type: ignore[arg-type]
            "folded last hidden state: sample b's position l in slot b*L + l; input of the tail",
        )
    return [rows, _key_mask_io(module, dtype)], [out]


def tail_contract(module: BC1LEncoder, dtype: str) -> tuple[list[TensorIO], list[TensorIO]]:
    """Inputs and outputs of the tail package."""
    io, d = module.io, module.spec.hidden_size
    hidden = TensorIO(
        "hidden",
        (1, d, 1, io.slots),
        dtype,  # type: ignore[arg-type]
        "the island's output, unchanged",
    )
    return [hidden, _key_mask_io(module, dtype)], [output_io(module, dtype)]


def program_module(module: BC1LEncoder, precision: str) -> BC1LEncoder:
    """The module to trace: fp32 weights, with the fp16 epsilon floors for an fp16 program."""
    out = copy.deepcopy(module).eval()
    out.set_eps_floor(FP16_EPS_FLOOR if precision == "float16" else 0.0)
    return out


# ---- the MIL level ---------------------------------------------------------------------------


def mil_level_runner(
    packages: dict[str, Path], module: BC1LEncoder, host: HostEmbedding | None
) -> tuple[Runner | None, str]:
    """The emitted program(s) run by the MIL evaluator (``parity/mil``, profile ``fp16``) as a
    `Runner`, or None with the reason when the evaluator is not available or cannot run them.

    ``packages``: ``{"single": path}`` or ``{"island": path, "tail": path}``.
    """
    try:
        from parity.mil.errors import MILError
        from parity.mil.evaluator import Evaluator
        from parity.mil.program import load_package
    except ImportError:
        return None, "MIL evaluator not available (parity/mil)"
    try:
        evaluators = {k: Evaluator(load_package(p), "fp16") for k, p in packages.items()}
    except MILError as e:
        return None, f"MIL evaluator cannot run the program: {e}"
    io = module.io
    out_name = _OUTPUT_NAMES[io.output]

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        key_mask = key_mask_from_padding(batch.attention_mask).numpy().astype(np.float16)
        if "single" in evaluators:
            feeds: dict[str, np.ndarray] = {"input_ids": batch.input_ids.numpy().astype(np.int32)}
            if module.embedding.types is not None:
                feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
            feeds["key_mask"] = key_mask
            out = evaluators["single"].run(feeds).outputs[out_name]
        else:
            assert host is not None
            rows = host(batch.input_ids, None).numpy()
            island = evaluators["island"].run({"inputs_embeds": rows, "key_mask": key_mask})
            if io.output == "last-hidden-state":
                out = island.outputs[out_name]
            else:
                hidden = island.outputs["hidden"]
                out = (
                    evaluators["tail"]
                    .run({"hidden": hidden, "key_mask": key_mask})
                    .outputs[out_name]
                )
        return None, torch.from_numpy(np.asarray(out, dtype=np.float32))

    return run, "MIL evaluator, profile fp16, on the emitted program(s)"


# ---- the conversion --------------------------------------------------------------------------


def convert_encoder(
    recipe: EncoderRecipe,
    out_dir: Path | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    steps: Steps | None = None,
) -> ConvertResult:
    """Run the encoder pipeline for one recipe; publishes ``<out>/<name>/`` only if every gate
    passes."""
    steps = steps or Steps(quiet=True)
    out_dir = out_dir or recipe.output_dir
    name = recipe.name
    options = recipe.encoder or EncoderOptions()
    if recipe.attention != "per-head":
        raise InputError(f"attention: {recipe.attention!r} is not implemented yet; use 'per-head'")
    if out_dir.is_dir():
        clean_leftovers(out_dir)
    target = TARGETS[recipe.target]
    dtype = recipe.io.dtype

    with stage_artifact(out_dir, name, force=force) as stage:
        with steps.step("load checkpoint"):
            source = recipe.resolve_source()
            ckpt = load_checkpoint(source, recipe.task, allow_pickle=allow_pickle)
        with steps.step("rewrite to BC1L"):
            rw = rewrite_encoder(recipe, ckpt, options)
        module = rw.module
        thresholds = thresholds_for(recipe, options)
        extra: dict[str, Runner] = {}
        described: dict[str, str] = {}
        if rw.host is not None:
            extra[PARTITIONED] = partitioned_runner(module, rw.host)
            described[PARTITIONED] = (
                "host embedding from the fp16 tables"
                + (" (pre-normalised offline)" if rw.host.prenormalized else " with an fp32 norm")
                + " -> island -> tail, each the fp16 torch module"
            )
        with steps.step("parity (torch fp32, fp16)", total=len(rw.fixtures)) as advance:
            references = _references(ckpt, rw, advance)
            report, rows = check_encoder(
                module, rw.batches, references, thresholds, extra, described
            )
        table_check: dict[str, Any] = {}
        if rw.host is not None and rw.host.prenormalized:
            table_check["prenormalized_table"] = prenormalized_table_check(rw.canonical, rw.host)
        del ckpt.model
        if not report.passed:
            _write_parity(stage.path, report, rows, name, table_check)
            return gate_failed(stage, "parity", report, steps.timings)

        packages, contracts, ops = _emit_programs(
            recipe, module, rw, target, dtype, stage.path, steps
        )
        with steps.step("parity (MIL evaluator, fp16)"):
            runner, mil_note = mil_level_runner(packages, module, rw.host)
            if runner is not None:
                mil_report, mil_rows = check_encoder(
                    module,
                    rw.batches,
                    references,
                    thresholds,
                    {MIL_LEVEL: runner},
                    torch_levels=False,
                )
                report.gates.extend(mil_report.gates)
                report.implementations[MIL_LEVEL] = mil_note
                for row, mil_row in zip(rows, mil_rows, strict=True):
                    for field in (
                        "cosine",
                        "max_abs_error",
                        "rel_error",
                        "argmax_kept",
                        "max_abs_dprob",
                        "certified",
                    ):
                        getattr(row, field).update(getattr(mil_row, field))
            else:
                report.implementations[MIL_LEVEL] = f"not run: {mil_note}"
        parity_path = _write_parity(stage.path, report, rows, name, table_check)
        if not report.passed:
            return gate_failed(stage, "parity", report, steps.timings)

        with steps.step("save"):
            host_files = _write_host_files(stage.path, rw.host) if rw.host is not None else None
            tokenizer = write_tokenizer(stage.path, ckpt.tokenizer, "the checkpoint's tokenizer")
            manifest = _manifest(
                recipe,
                source,
                ckpt,
                rw,
                options,
                packages,
                contracts,
                ops,
                host_files,
                tokenizer,
                parity_path,
                dtype,
            )
            write_json_atomic(stage.path / "manifest.json", manifest.model_dump(mode="json"))
        write_log_into(stage.path, f"every gate passed; publishing {out_dir / name}")
        final = stage.commit()

    n_ops = sum(sum(o.values()) for o in ops.values())
    return published(final, report, steps.timings, n_ops, module.spec.num_layers)


def _references(
    ckpt: Checkpoint, rw: EncoderRewrite, advance: Callable[[], None]
) -> dict[str, EncoderReference]:
    refs = {}
    for fixture in rw.fixtures:
        refs[fixture.name] = run_encoder_reference(
            ckpt.model, fixture.token_ids, rw.module.io.output
        )
        advance()
    return refs


def _write_parity(
    directory: Path,
    report: ParityReport,
    rows: list[EncoderFixtureRow],
    name: str,
    extra: dict[str, Any],
) -> Path:
    doc = report_to_json(
        report, {"recipe": name, "encoder_fixtures": fixture_rows_to_json(rows), **extra}
    )
    path = write_json_atomic(directory / "parity.json", doc)
    # report_to_text ends with the decoder's per-fixture table, empty here: ours replaces it.
    gates_and_layers = report_to_text(report).split("\n\nfixture ")[0]
    text = gates_and_layers + "\n\n" + fixture_rows_to_text(rows) + "\n"
    write_text_atomic(directory / "parity.txt", text)
    return path


def _emit_programs(
    recipe: Recipe,
    module: BC1LEncoder,
    rw: EncoderRewrite,
    target: Any,
    dtype: str,
    directory: Path,
    steps: Steps,
) -> tuple[dict[str, Path], dict[str, tuple[list[TensorIO], list[TensorIO]]], dict[str, Any]]:
    """Trace, convert and save the single program, or the island and the tail."""
    program = program_module(module, recipe.precision)
    pieces: dict[str, tuple[torch.nn.Module, tuple[list[TensorIO], list[TensorIO]]]] = {}
    if rw.host is None:
        pieces["single"] = (program, single_contract(program, dtype))
    else:
        pieces["island"] = (Island(program).eval(), island_contract(program, dtype))
        if module.io.output != "last-hidden-state":
            pieces["tail"] = (Tail(program).eval(), tail_contract(program, dtype))
    packages: dict[str, Path] = {}
    contracts = {}
    ops = {}
    for piece, (mod, (inputs, outputs)) in pieces.items():
        with steps.step(f"convert {piece} to ML Program"):
            traced = trace(mod, inputs)
            mlmodel = to_mlprogram(traced, inputs, outputs, target.ct_target(), recipe.precision)
            ops[piece] = live_ops(mlmodel)
            suffix = "" if piece == "single" else f".{piece}"
            path = directory / f"{recipe.name}{suffix}.mlpackage"
            mlmodel.save(str(path))
        packages[piece] = path
        contracts[piece] = (inputs, outputs)
    return packages, contracts, ops


def _write_host_files(directory: Path, host: HostEmbedding) -> list[FileEntry]:
    tables: dict[str, tuple[torch.Tensor | None, str]] = {
        "embeddings.npy": (
            host.word,
            "token embedding table (vocab, hidden), fp16"
            + ("; rows already normalised (pre-normalised offline)" if host.prenormalized else ""),
        ),
        "position_embeddings.npy": (host.position, "rows of positions 0..L-1 (L, hidden), fp16"),
        "token_type_embeddings.npy": (host.types, "token-type rows (types, hidden), fp16"),
        "embedding_norm_weight.npy": (host.norm_weight, "embedding LayerNorm gamma, fp32"),
        "embedding_norm_bias.npy": (host.norm_bias, "embedding LayerNorm beta, fp32"),
    }
    return [
        write_npy(directory / file, tensor.numpy(), meaning)
        for file, (tensor, meaning) in tables.items()
        if tensor is not None
    ]


def encoder_deviations(rw: EncoderRewrite, precision: str) -> list[Deviation]:
    """Every numeric change the program forces: finite masks, prescales, epsilon floors."""
    out = [
        Deviation(
            where="attention masks",
            what="exclusion by a finite additive mask instead of -inf (padding, other samples "
            "of the folded batch, the local band)",
            original="-inf",
            effective=MASKED,
            why="keeps padded rows finite and sums of masks inside fp16; exp(-1e4) is exactly 0 "
            "in fp16 and fp32",
        )
    ]
    fp16 = precision == "float16"
    for s in rw.scales:
        if s.prescale != 1.0:
            out.append(
                Deviation(
                    where=s.name,
                    what=f"LayerNorm input divided by {s.prescale:g} (power of two) in the norm",
                    original=1.0,
                    effective=s.prescale,
                    why="exact: the factor cancels; keeps the sum of squares inside fp16",
                )
            )
        if fp16 and s.fp16_scaled_eps != s.scaled_eps:
            channels = rw.module.spec.hidden_size
            effective_eps = s.fp16_scaled_eps * s.prescale**2 / channels
            out.append(
                Deviation(
                    where=s.name,
                    what="LayerNorm epsilon as the fp16 program stores it "
                    "(C * eps / prescale^2, added to the centred sum of squares)",
                    original=s.eps,
                    effective=effective_eps,
                    why=f"C*eps/a^2 = {s.scaled_eps:.3g} is below fp16's smallest normal "
                    f"{FP16_EPS_FLOOR:.3g}; stored as {s.fp16_scaled_eps:.3g} so that a constant "
                    "row stays finite; the fp16 parity gates measure the effect",
                )
            )
    if isinstance(rw.module.tail, SentenceEmbeddingTail) and fp16:
        norm = rw.module.tail.normalize
        out.append(
            Deviation(
                where="sentence embedding L2 normalisation",
                what="floor of the squared norm, max(sum x^2, floor), as stored in fp16",
                original=norm.eps * norm.eps,
                effective=FP16_EPS_FLOOR * rw.pooled_prescale**2,
                why="1e-24 is not an fp16 number; changes outputs only for vectors with norm "
                f"below {(FP16_EPS_FLOOR**0.5) * rw.pooled_prescale:.3g}",
            )
        )
    if rw.host is not None and rw.host.prenormalized:
        out.append(
            Deviation(
                where="embedding table",
                what="embedding LayerNorm applied to the table offline (fp64, rounded to fp16)",
                original="norm(gathered row)",
                effective="gathered normalised row",
                why="the norm reads the token row alone: same real arithmetic, one rounding "
                "instead of two; the partitioned parity run checks it",
            )
        )
    return out


def _pieces(
    rw: EncoderRewrite,
    packages: dict[str, Path],
    contracts: dict[str, tuple[list[TensorIO], list[TensorIO]]],
    host_files: list[FileEntry] | None,
) -> tuple[list[PieceEntry], list[BoundaryEntry]]:
    host = rw.host
    assert host is not None
    embedding_meaning = (
        "gather rows of embeddings.npy for each token id (already normalised)"
        if host.prenormalized
        else "gather token rows (+ token-type rows + position rows 0..L-1), sum in fp32, "
        f"LayerNorm in fp32 with eps {host.eps:g} and the shipped gamma/beta, round to fp16"
    )
    pieces = [
        PieceEntry(
            name="embedding",
            runs_on="host",
            files=[f.file for f in host_files or []],
            inputs=["input_ids", "token_type_ids"] if host.types is not None else ["input_ids"],
            outputs=["inputs_embeds"],
            meaning=embedding_meaning,
        )
    ]
    for piece in ("island", "tail"):
        if piece not in packages:
            continue
        inputs, outputs = contracts[piece]
        pieces.append(
            PieceEntry(
                name=piece,
                runs_on="neural-engine (intended; placement is not observed here)"
                if piece == "island"
                else "second small package (CPU or NE)",
                files=[packages[piece].name],
                inputs=[t.name for t in inputs],
                outputs=[t.name for t in outputs],
                meaning="every transformer layer and the final norm"
                if piece == "island"
                else "pooling / selection and the heads",
            )
        )
    out_shape = contracts["tail" if "tail" in contracts else "island"][1][0].shape
    crossings: list[Boundary] = boundaries(rw.module, out_shape)
    return pieces, [
        BoundaryEntry(
            source=b.source, target=b.target, tensors=[t for t, _ in b.tensors], bytes=b.bytes
        )
        for b in crossings
    ]


def _manifest(
    recipe: Recipe,
    source: ResolvedSource,
    ckpt: Checkpoint,
    rw: EncoderRewrite,
    options: EncoderOptions,
    packages: dict[str, Path],
    contracts: dict[str, tuple[list[TensorIO], list[TensorIO]]],
    ops: dict[str, Any],
    host_files: list[FileEntry] | None,
    tokenizer: FileEntry | None,
    parity_path: Path,
    dtype: str,
) -> Manifest:
    module, spec = rw.module, rw.module.spec
    main = "single" if "single" in packages else "island"
    inputs, outputs = contracts[main]
    if "tail" in contracts:
        outputs = contracts["tail"][1]
    pieces = boundary_entries = None
    if rw.host is not None:
        pieces, boundary_entries = _pieces(rw, packages, contracts, host_files)
    layers = spec.layers
    return Manifest(
        **common_fields(
            recipe, source, ckpt, inputs, outputs, packages[main], ops[main], tokenizer, parity_path
        ),
        architecture=spec.architecture,
        batch=module.io.batch,
        sequence_length=module.io.length,
        conventions={
            "layout": "activations are [1, channels, 1, batch * sequence] inside the program: "
            "the batch is folded into the sequence and a block-diagonal mask keeps samples apart",
            "padding": "right: real tokens in slots 0..n-1, so position l is slot l",
            "mask": "key_mask masks keys only; padded query slots are computed (finite, "
            "meaningless) and never pooled",
            "local attention": "layers with a window attend to keys with |q - k| <= window "
            "(inclusive)",
        },
        masked_value=MASKED,
        rope_theta=[ls.attention.rope_theta for ls in layers if ls.attention.rope],
        vocab_size=spec.embedding.vocab_size,
        lm_head_chunks=[],
        embeddings=None,
        deviations=encoder_deviations(rw, recipe.precision),
        encoder={
            "output": module.io.output,
            "partition": options.partition,
            "batch_axis": "folded into the sequence (block-diagonal mask); attention matmuls "
            "run at batch 1",
            "layer_windows": [ls.attention.window for ls in layers],
            "pooling": (
                spec.classifier.pooling
                if module.io.output == "logits" and spec.classifier is not None
                else (options.pooling if module.io.output == "sentence-embedding" else None)
            ),
            "labels": list(spec.classifier.labels) if spec.classifier is not None else None,
            "pad_token_id": spec.embedding.pad_token_id,
        },
        pieces=pieces,
        boundaries=boundary_entries,
        host_files=host_files,
        extra_packages=[package_entry(packages["tail"], ops["tail"])]
        if "tail" in packages
        else None,
    )
