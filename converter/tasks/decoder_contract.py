"""A draft decoder's contract with its runtime: I/O tensors, deviations and manifest fields."""

from __future__ import annotations

from converter.checkpoint import Checkpoint
from converter.coreml import TensorIO
from converter.manifest import Deviation, FileEntry, Manifest
from converter.manifest_fields import common_fields
from converter.recipe import DecoderRecipe
from converter.tasks.base import Job, Program
from graph_passes.decoder import BC1LDecoder, DecoderIO
from graph_passes.logits_layout import LAYOUT
from graph_passes.masks import MASKED
from graph_passes.prescale import NormScale
from graph_passes.spec import CanonicalModel
from graph_passes.stream_scale import LIMIT, StreamScaling


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
                (b, io.logit_positions, 1, size),
                dtype,  # type: ignore[arg-type]
                f"logits of token ids {start}..{start + size - 1} at the last "
                f"{io.logit_positions} window position(s): {LAYOUT}",
            )
        )
        start += size
    return [first, key_mask], outputs


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
) -> Manifest:
    """The manifest of a decoder artifact (parity.json must already be written)."""
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
            "logits": f"one output per LM-head chunk, in vocabulary order, laid out {LAYOUT} "
            "(the vocabulary last); concatenate on the last axis (or take the argmax per "
            "chunk) on the host",
        },
        masked_value=MASKED,
        rope_theta=[layer.attention.rope_theta for layer in spec.layers],
        vocab_size=spec.vocab_size,
        lm_head_chunks=module.chunk_sizes,
        embeddings=embeddings,
        deviations=deviations(scales, scaling, recipe.precision),
    )
