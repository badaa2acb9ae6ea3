"""An encoder's contract with its runtime: I/O tensors of each piece, host files, deviations,
and the manifest fields (pieces and the tensors that cross between them)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from converter.checkpoints.loading import Checkpoint
from converter.coreml.program import TensorIO
from converter.pipeline.manifest import (
    BoundaryEntry,
    Deviation,
    FileEntry,
    Manifest,
    PieceEntry,
    TensorEntry,
)
from converter.pipeline.manifest_fields import common_fields, package_entry, write_npy
from converter.recipe import EncoderOptions
from converter.tasks.shared import Job, Program
from graph_passes.encoder import BC1LEncoder, SentenceEmbeddingTail
from graph_passes.layer_norm import FP16_EPS_FLOOR
from graph_passes.masks import MASKED
from graph_passes.partition import ISLAND_OUTPUT, HostEmbedding
from graph_passes.prescale import NormScale

Contract = tuple[list[TensorIO], list[TensorIO]]
_BYTES = {"float16": 2, "float32": 4, "int32": 4}


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
    meaning = f"classifier logits, labels in order: {', '.join(classifier.labels)}"
    if classifier.num_labels == 1:  # a cross-encoder's relevance score, a regression head
        meaning = f"one score ({classifier.labels[0]}), a logit: its probability is its sigmoid"
    return TensorIO("logits", (io.batch, classifier.num_labels), dtype, meaning)  # type: ignore[arg-type]


def _key_mask_io(module: BC1LEncoder, dtype: str) -> TensorIO:
    io = module.io
    return TensorIO(
        "key_mask",
        (io.batch, io.length),
        dtype,  # type: ignore[arg-type]
        f"additive key mask: 0 for a real token, {MASKED:g} for padding (right padding)",
    )


def _folded_hidden(module: BC1LEncoder, dtype: str, meaning: str) -> TensorIO:
    io = module.io
    return TensorIO(ISLAND_OUTPUT, (1, module.spec.hidden_size, 1, io.slots), dtype, meaning)  # type: ignore[arg-type]


def single_contract(module: BC1LEncoder, dtype: str) -> Contract:
    """Inputs and outputs of the single program."""
    io = module.io
    inputs = [
        TensorIO(
            "input_ids",
            (io.batch, io.length),
            "int32",
            "token ids, right-padded; a padded slot may hold any token id (key_mask excludes it)",
        )
    ]
    if module.embedding.types is not None:
        last = module.spec.embedding.type_vocab_size - 1
        meaning = (
            f"segment ids (0..{last}), the tokenizer's token_type_ids: 0 for one text, 0 then 1 "
            "for a text pair (a cross-encoder's query and passage)"
        )
        inputs.append(TensorIO("token_type_ids", (io.batch, io.length), "int32", meaning))
    return [*inputs, _key_mask_io(module, dtype)], [output_io(module, dtype)]


def island_contract(module: BC1LEncoder, dtype: str) -> Contract:
    """Inputs and outputs of the NE island."""
    io, d = module.io, module.spec.hidden_size
    rows = TensorIO(
        "inputs_embeds",
        (io.batch, io.length, d),
        dtype,  # type: ignore[arg-type]
        "normalised embedding rows from the host embedding step, right-padded: "
        "[batch, position, channel]",
    )
    if io.output == "last-hidden-state":
        out = output_io(module, dtype)
    else:
        out = _folded_hidden(
            module,
            dtype,
            "folded last hidden state, BC1L layout [1, channel, 1, slot]: sample b's position l "
            "in slot b*L + l; the tail's input, passed on unchanged",
        )
    return [rows, _key_mask_io(module, dtype)], [out]


def tail_contract(module: BC1LEncoder, dtype: str) -> Contract:
    """Inputs and outputs of the tail package."""
    hidden = _folded_hidden(
        module,
        dtype,
        "the island's output, unchanged: [1, channel, 1, slot], slot b*L + l",
    )
    return [hidden, _key_mask_io(module, dtype)], [output_io(module, dtype)]


def write_host_files(directory: Path, host: HostEmbedding) -> list[FileEntry]:
    """The embedding tables the host gathers from, in the dtype they are gathered in."""
    tables: dict[str, tuple[torch.Tensor | None, str]] = {
        "embeddings.npy": (
            host.word,
            "token embedding table (vocab, hidden)"
            + ("; rows already normalised (pre-normalised offline)" if host.prenormalized else ""),
        ),
        "position_embeddings.npy": (host.position, "rows of positions 0..L-1 (L, hidden)"),
        "token_type_embeddings.npy": (host.types, "token-type rows (types, hidden)"),
        "embedding_norm_weight.npy": (host.norm_weight, "embedding LayerNorm gamma, fp32"),
        "embedding_norm_bias.npy": (host.norm_bias, "embedding LayerNorm beta, fp32"),
    }
    return [
        write_npy(directory / file, tensor.numpy(), meaning)
        for file, (tensor, meaning) in tables.items()
        if tensor is not None
    ]


def _eps_deviation(s: NormScale, channels: int) -> Deviation:
    effective = s.fp16_scaled_eps * s.prescale**2 / channels
    if s.scaled_eps < FP16_EPS_FLOOR:
        why = (
            f"C*eps/a^2 = {s.scaled_eps:.3g} is below fp16's smallest normal "
            f"{FP16_EPS_FLOOR:.3g}; stored as {s.fp16_scaled_eps:.3g} so that a constant row "
            "stays finite; the fp16 parity gates measure the effect"
        )
    else:
        why = (
            f"C*eps/a^2 = {s.scaled_eps:.6g} is not an fp16 number; rounded to the nearest, "
            f"{s.fp16_scaled_eps:.6g}; the fp16 parity gates measure the effect"
        )
    return Deviation(
        where=s.name,
        what="LayerNorm epsilon as the fp16 program stores it "
        "(C * eps / prescale^2, added to the centred sum of squares)",
        original=s.eps,
        effective=effective,
        why=why,
    )


def encoder_deviations(
    module: BC1LEncoder,
    scales: list[NormScale],
    pooled_prescale: float,
    host: HostEmbedding | None,
    precision: str,
) -> list[Deviation]:
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
    for s in scales:
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
            out.append(_eps_deviation(s, module.spec.hidden_size))
    if isinstance(module.tail, SentenceEmbeddingTail) and fp16:
        norm = module.tail.normalize
        out.append(
            Deviation(
                where="sentence embedding L2 normalisation",
                what="floor of the squared norm, max(sum x^2, floor), as stored in fp16",
                original=norm.eps * norm.eps,
                effective=FP16_EPS_FLOOR * pooled_prescale**2,
                why="1e-24 is not an fp16 number; changes outputs only for vectors with norm "
                f"below {(FP16_EPS_FLOOR**0.5) * pooled_prescale:.3g}",
            )
        )
    if host is not None and host.prenormalized:
        out.append(
            Deviation(
                where="embedding table",
                what="embedding LayerNorm applied to the table offline (fp64, rounded to the "
                "I/O dtype)",
                original="norm(gathered row)",
                effective="gathered normalised row",
                why="the norm reads the token row alone: same real arithmetic, one rounding "
                "instead of two; the partitioned parity run checks it",
            )
        )
    return out


def _tensor_entry(t: TensorIO) -> TensorEntry:
    return TensorEntry(name=t.name, shape=list(t.shape), dtype=t.dtype, meaning=t.meaning)


def _crossing(source: str, target: str, tensors: list[TensorIO]) -> BoundaryEntry:
    return BoundaryEntry(
        source=source,
        target=target,
        tensors=[_tensor_entry(t) for t in tensors],
        bytes=sum(math.prod(t.shape) * _BYTES[t.dtype] for t in tensors),
    )


def pieces_and_boundaries(
    host: HostEmbedding, programs: list[Program], host_files: list[FileEntry]
) -> tuple[list[PieceEntry], list[BoundaryEntry]]:
    """The pieces of a partitioned call in order, and every copy between them (shape, dtype,
    layout and bytes of each tensor)."""
    island = programs[0]
    embedding_meaning = (
        "gather rows of embeddings.npy for each token id (already normalised)"
        if host.prenormalized
        else "gather token rows (+ token-type rows + position rows 0..L-1), sum in fp32, "
        f"LayerNorm in fp32 with eps {host.eps:g} and the shipped gamma/beta, round to the "
        "island's input dtype"
    )
    pieces = [
        PieceEntry(
            name="embedding",
            runs_on="host",
            files=[f.file for f in host_files],
            inputs=["input_ids", "token_type_ids"] if host.types is not None else ["input_ids"],
            outputs=["inputs_embeds"],
            meaning=embedding_meaning,
        )
    ]
    for program in programs:
        pieces.append(
            PieceEntry(
                name=program.piece,
                runs_on="neural-engine (intended; placement is not observed here)"
                if program.piece == "island"
                else "second small package (CPU or NE)",
                files=[program.path.name],
                inputs=[t.name for t in program.inputs],
                outputs=[t.name for t in program.outputs],
                meaning="every transformer layer and the final norm"
                if program.piece == "island"
                else "pooling / selection and the heads",
            )
        )
    crossings = [_crossing("embedding (host)", "island", island.inputs)]
    for before, after in zip(programs, programs[1:], strict=False):
        crossings.append(_crossing(before.piece, after.piece, after.inputs))
    crossings.append(_crossing(programs[-1].piece, "host", programs[-1].outputs))
    return pieces, crossings


def encoder_manifest(
    job: Job,
    ckpt: Checkpoint,
    module: BC1LEncoder,
    options: EncoderOptions,
    programs: list[Program],
    host_files: list[FileEntry] | None,
    tokenizer: FileEntry | None,
    deviations: list[Deviation],
    host: HostEmbedding | None,
) -> Manifest:
    """The manifest of an encoder artifact (parity.json must already be written)."""
    spec, recipe = module.spec, job.recipe
    main = programs[0]
    pieces = boundary_entries = None
    if host is not None:
        pieces, boundary_entries = pieces_and_boundaries(host, programs, host_files or [])
    layers = spec.layers
    classifier = spec.classifier
    return Manifest(
        **common_fields(
            recipe,
            job.source,
            ckpt,
            main.inputs,
            programs[-1].outputs,
            main.path,
            main.ops,
            tokenizer,
            job.directory / "parity.json",
        ),
        architecture=spec.architecture,
        batch=module.io.batch,
        sequence_length=module.io.length,
        conventions={
            "layout": "activations are [1, channels, 1, batch * sequence] inside the program: "
            "the batch is folded into the sequence and a block-diagonal mask keeps samples apart",
            "padding": "right: real tokens in slots 0..n-1, so position l is slot l; a padded "
            "slot may hold any token id: key_mask excludes it",
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
        deviations=deviations,
        encoder={
            "output": module.io.output,
            "partition": options.partition,
            "batch_axis": "folded into the sequence (block-diagonal mask); attention matmuls "
            "run at batch 1",
            "layer_windows": [ls.attention.window for ls in layers],
            "pooling": (
                classifier.pooling
                if module.io.output == "logits" and classifier is not None
                else (options.pooling if module.io.output == "sentence-embedding" else None)
            ),
            "labels": list(classifier.labels) if classifier is not None else None,
            "pad_token_id": spec.embedding.pad_token_id,
        },
        pieces=pieces,
        boundaries=boundary_entries,
        host_files=host_files,
        extra_packages=[package_entry(p.path, p.ops) for p in programs[1:]] or None,
    )
