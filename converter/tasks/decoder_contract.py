"""A draft decoder's contract with its runtime: I/O tensors, deviations and manifest fields."""

from __future__ import annotations

from typing import Any

from converter.checkpoints.loading import Checkpoint
from converter.coreml.program import DType, TensorIO
from converter.errors import InputError
from converter.pipeline.manifest import Deviation, FileEntry, Manifest
from converter.pipeline.manifest_fields import common_fields
from converter.recipe import DecoderRecipe
from converter.tasks.shared import Job, Program
from graph_passes.decoder import BC1LDecoder, DecoderIO, chunk_sizes
from graph_passes.logits_layout import LAYOUT, output_names
from graph_passes.masks import MASKED
from graph_passes.prescale import NormScale
from graph_passes.spec import CanonicalModel, TransformerSpec
from graph_passes.stream_scale import LIMIT, StreamScaling


def decoder_io(recipe: DecoderRecipe, canonical: CanonicalModel) -> DecoderIO:
    """Resolve the recipe's I/O choices against the checkpoint (``auto`` inputs)."""
    inputs = recipe.io.inputs
    if inputs == "auto":
        # Tied embeddings: keep the table on the host so it is not stored twice (SPEC 2).
        inputs = "embeddings" if canonical.spec.tied_embeddings else "token-ids"
    io = DecoderIO(
        batch=recipe.shapes.batch,
        length=recipe.shapes.sequence_length,
        inputs=inputs,
        logit_positions=recipe.logits_positions,
        lm_head_chunk=recipe.io.lm_head_chunk,
        output=recipe.io.output,
        top_k=recipe.io.top_k or 0,
    )
    check_top_k(io, chunk_sizes(canonical.spec.vocab_size, io.lm_head_chunk))
    return io


def check_top_k(io: DecoderIO, chunk_sizes: list[int]) -> None:
    """Refuse a top_k above the smallest LM-head chunk (the remainder of the vocabulary)."""
    if io.output == "topk" and io.top_k > min(chunk_sizes):
        raise InputError(
            f"io.top_k: {io.top_k} exceeds the smallest LM-head chunk ({min(chunk_sizes)} "
            f"tokens: chunks {chunk_sizes}); choose io.top_k <= {min(chunk_sizes)} or another "
            "io.lm_head_chunk"
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
    where = f"at the last {io.logit_positions} window position(s)"
    outputs = head_contract(module, b, io.logit_positions, dtype, where)  # type: ignore[arg-type]
    return [first, key_mask], outputs


def head_contract(module: BC1LDecoder, b: int, n: int, dtype: DType, where: str) -> list[TensorIO]:
    """The head's outputs per LM-head chunk for the module's output choice (io.output), in
    the program's order, the vocabulary (or the candidates) on the last axis."""
    io = module.io
    outputs = []
    start = 0
    for k, size in enumerate(module.chunk_sizes):
        ids = f"token ids {start}..{start + size - 1}"
        names = output_names(io.output, k)
        if io.output == "logits":
            outputs.append(TensorIO(names[0], (b, n, 1, size), dtype,
                                    f"logits of {ids} {where}: {LAYOUT}"))  # fmt: skip
        else:
            c = 1 if io.output == "argmax" else io.top_k
            what = "the argmax" if io.output == "argmax" else f"the top {c} (largest first)"
            outputs += [
                TensorIO(names[0], (b, n, 1, c), "int32",
                         f"{what} of chunk {k} ({ids}) {where}, as an index inside the chunk "
                         f"(add {start} for the token id): [batch, position, 0, candidate]"),
                TensorIO(names[1], (b, n, 1, c), dtype,
                         f"the logits of {names[0]}: [batch, position, 0, candidate]"),
            ]  # fmt: skip
        start += size
    return outputs


def head_convention(output: str) -> str:
    """The manifest's one-line convention for the head outputs of an output choice."""
    if output == "logits":
        return (
            f"one output per LM-head chunk, in vocabulary order, laid out {LAYOUT} (the "
            "vocabulary last); concatenate on the last axis (or take the argmax per chunk) "
            "on the host"
        )
    return (
        f"io.output {output}: per LM-head chunk an int32 index inside the chunk and its "
        "logit, [batch, position, 0, candidate]; the host combines the chunks as head_output "
        "says (no logits are returned)"
    )


def head_output_section(module: BC1LDecoder, positions: dict[str, int]) -> dict[str, Any]:
    """The manifest's ``head_output``: the output choice, how the host combines the chunks,
    and the bytes each call returns (dense, and in 64-byte NE rows) per function."""
    io = module.io
    c = {"logits": 0, "argmax": 1, "topk": io.top_k}[io.output]
    combine = {
        "logits": "concatenate the chunks on the last axis; token id = chunk offset + index",
        "argmax": "token id = offset of the chunk whose argmax_value is largest (the first "
        "such chunk on a tie) + its argmax_index",
        "topk": "token ids = chunk offset + topk_index for every chunk; the k largest "
        "topk_value over all chunks (ties: the lower token id) are the top k",
    }[io.output]
    return {
        "choice": io.output,
        "top_k": io.top_k if io.output == "topk" else None,
        "chunk_offsets": [sum(module.chunk_sizes[:k]) for k in range(len(module.chunk_sizes))],
        "combine": combine,
        "bytes_per_call": {
            name: head_bytes(module.chunk_sizes, n, io.output, c) for name, n in positions.items()
        },
    }


def head_bytes(chunk_sizes: list[int], n: int, output: str, c: int) -> dict[str, int]:
    """Bytes of the head outputs of one call at n positions: ``dense`` (fp16 values, int32
    indices) and ``ne_rows`` (each last-axis row padded to 64 bytes, as the NE writes them)."""

    def row(width: int, size: int) -> int:
        return -(-width * size // 64) * 64

    if output == "logits":
        return {"dense": sum(2 * v * n for v in chunk_sizes),
                "ne_rows": sum(row(v, 2) * n for v in chunk_sizes)}  # fmt: skip
    k = len(chunk_sizes)
    return {"dense": k * n * c * (4 + 2), "ne_rows": k * n * (row(c, 4) + row(c, 2))}


def deviations(scales: list[NormScale], scaling: StreamScaling, precision: str) -> list[Deviation]:
    """Every numeric change the program forces, grouped by value."""
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
    return out + stream_deviations(scaling)


def spelling_deviations(spec: TransformerSpec) -> list[Deviation]:
    """An op the program spells otherwise than coremltools would (recipe silu_form)."""
    spelled = [i for i, layer in enumerate(spec.layers) if layer.mlp.act == "silu_mul_sigmoid"]
    if not spelled:
        return []
    return [
        Deviation(
            where=f"the MLP activation ({len(spelled)} of {len(spec.layers)} layers)",
            what="SiLU spelled x * sigmoid(x): a sigmoid and a mul, no silu op",
            original="silu",
            effective="mul(x, sigmoid(x))",
            why="recipe silu_form: mul-sigmoid: the NE's silu is reported inexact near 0 "
            "(parity.mil.deviations); the same function in real arithmetic, rounded twice in "
            "fp16 (bench/silu_forms.py measures both forms); the fp16 gates measure its effect",
        )
    ]


def stream_deviations(scaling: StreamScaling) -> list[Deviation]:
    """The residual stream and branch scales with the ranges they were chosen from (recorded
    when nothing was scaled too: the measured margin is part of the contract)."""
    peaks = ", ".join(f"{row.stream:.0f}" for row in scaling.layers)
    measured = (
        f"per-layer max |h| on the fixtures (fp32, padding included): [{peaks}]; peak "
        f"{scaling.peak:.1f}, limit {LIMIT:g}"
    )
    s = scaling.scale
    if s == 1.0:
        return [
            Deviation(
                where="residual stream",
                what="no scale needed: every measured value within the limit",
                original=1.0,
                effective=1.0,
                why=measured,
            )
        ]
    out = [
        Deviation(
            where="residual stream: embeddings (embeddings.npy and the program's table), "
            "the output and down projections (pre-norm layers) or the post-norm gains, "
            "stored as the effective gain s * (offset + w) (layers with post-norms)",
            what=f"the residual stream is carried as {s:g} (power of two) times the checkpoint's",
            original=1.0,
            effective=s,
            why=f"exact: keeps every stream value within fp16; {measured}; "
            f"{scaling.to_subnormal} weights moved into fp16 subnormals and {scaling.to_zero} "
            "to zero by the scale (hardware that flushes subnormals zeroes them)",
        ),
        Deviation(
            where="every norm reading the residual stream (attention, MLP and final norms)",
            what="epsilon multiplied by s^2",
            original=1.0,
            effective=s * s,
            why="exact: (s x) / sqrt(mean((s x)^2) + s^2 eps) = x / sqrt(mean(x^2) + eps)",
        ),
    ]
    for b in scaling.branches:
        out.append(
            Deviation(
                where=b.where,
                what=f"layer {b.layer} {b.branch} branch scaled by {b.scale:g} (power of two); "
                "its post-norm epsilon times the square, or its output projection times 1/scale",
                original=1.0,
                effective=b.scale,
                why=f"exact: {b.measured:.1f} inside the branch would exceed the limit {LIMIT:g}",
            )
        )
    return out


def decoder_manifest(
    job: Job,
    ckpt: Checkpoint,
    module: BC1LDecoder,
    scales: list[NormScale],
    scaling: StreamScaling,
    program: Program,
    embeddings: FileEntry | None,
    tokenizer: FileEntry | None,
    assumed: list[Deviation] | None = None,
) -> Manifest:
    """The manifest of a decoder artifact (parity.json must already be written); ``assumed``:
    config values the checkpoint did not carry
    (`converter.checkpoints.gguf_config.assumed_values`)."""
    spec, recipe = module.spec, job.recipe
    return Manifest(
        **common_fields(
            recipe,
            job.source,
            ckpt,
            program.inputs,
            program.outputs,
            program.path,
            program.ops,
            tokenizer,
            job.directory / "parity.json",
        ),
        architecture=spec.architecture,
        batch=module.io.batch,
        sequence_length=module.io.length,
        conventions={
            "layout": "activations are [batch, channels, 1, sequence] (BC1L) inside the program",
            "padding": "left: the last real token sits in the last slot, sequence_length - 1; "
            "a padded slot may hold any token id (or any embedding row): key_mask excludes it "
            "from every real position's attention",
            "positions": "slot l has RoPE position l; left padding shifts all real positions "
            "equally, which leaves attention unchanged (RoPE is relative)",
            "mask": "key_mask masks keys only; the causal mask is built into the program; "
            "outputs at padded positions are finite and meaningless",
            "logits": head_convention(module.io.output),
        },
        masked_value=MASKED,
        rope_theta=[layer.attention.rope_theta for layer in spec.layers],
        vocab_size=spec.vocab_size,
        lm_head_chunks=module.chunk_sizes,
        head_output=head_output_section(module, {"main": module.io.logit_positions}),
        embeddings=embeddings,
        deviations=[
            *(assumed or []),
            *deviations(scales, scaling, recipe.precision),
            *spelling_deviations(spec),
        ],
    )
