"""A decision model's contract with its runtime: the island's and the tail's I/O, and the
manifest (pieces in call order, every tensor that crosses between them with its bytes, the
head described completely)."""

from __future__ import annotations

from converter.checkpoints.loading import Checkpoint
from converter.coreml.program import TensorIO
from converter.pipeline.manifest import Deviation, FileEntry, Manifest, PieceEntry
from converter.recipe import EncoderOptions
from converter.tasks.encoder_contract import Contract, _key_mask_io, encoder_manifest
from converter.tasks.shared import Job, Program
from graph_passes.decision import DecisionEncoder, DecisionTail
from graph_passes.decision_spec import DecisionHead
from graph_passes.partition import ISLAND_OUTPUT, HostEmbedding

_FOLDED = "BC1L layout [1, channel, 1, slot]: request b's position l in slot b*L + l"


def _hidden(module: DecisionEncoder, dtype: str, meaning: str) -> TensorIO:
    io = module.io
    return TensorIO(ISLAND_OUTPUT, (1, module.spec.hidden_size, 1, io.slots), dtype, meaning)  # type: ignore[arg-type]


def island_contract(module: DecisionEncoder, dtype: str) -> Contract:
    """The NE island: embedding rows and key mask in, the head norm's output out."""
    io = module.io
    rows = TensorIO(
        "inputs_embeds", (io.batch, io.length, module.spec.hidden_size), dtype,  # type: ignore[arg-type]
        "normalised embedding rows from the host (pre-normalised table), right-padded: "
        "[batch, position, channel]",
    )  # fmt: skip
    out = _hidden(module, dtype, "head norm output after every encoder and head layer, " + _FOLDED)
    return [rows, _key_mask_io(module, dtype)], [out]


def tail_contract(module: DecisionEncoder, tail: DecisionTail, dtype: str) -> Contract:
    """The CPU tail: the island's output and the candidate positions in, every output out."""
    io, spec = module.io, tail.spec
    k, d, a = spec.num_candidates, module.spec.hidden_size, spec.num_actions
    inputs = [_hidden(module, dtype, "the island's output, unchanged: " + _FOLDED)]
    if spec.candidates.kind == "markers":
        inputs.append(TensorIO(
            "candidate_positions", (io.batch, k), "int32",
            "positions (0..L-1) of each request's K marker tokens, in order; a request with "
            "another number of markers is refused before the call",
        ))  # fmt: skip
    rows_k = k if spec.candidates.kind == "markers" else 1
    f = dtype  # the tail's outputs come in the I/O dtype
    outputs = [
        TensorIO("marker_rows", (io.batch, rows_k, d), f, "the gathered candidate rows"),  # type: ignore[arg-type]
        TensorIO("scorer_logits", (io.batch, k), f, "scorer logits z, one per candidate"),  # type: ignore[arg-type]
        TensorIO("raw_probs", (io.batch, k), f, "softmax(z): what the action head reads"),  # type: ignore[arg-type]
        TensorIO(
            "calibrated_probs",
            (io.batch, k),
            f,  # type: ignore[arg-type]
            f"softmax(z / T), T = {spec.temperature:g}",
        ),  # fmt: skip
        TensorIO(
            "action_probs",
            (io.batch, a),
            f,  # type: ignore[arg-type]
            "action probabilities, in order: " + ", ".join(spec.actions),
        ),  # fmt: skip
    ]
    return inputs, outputs


def head_description(head: DecisionHead, sha256: str) -> dict[str, object]:
    """The head, completely, for the manifest (docs/decision-head.md)."""
    spec = head.spec
    return {
        "head_sha256": sha256,
        "head_layers": spec.num_layers,
        "head_attention": [
            "global (every real token; padding masked), RoPE with the encoder's global theta"
            if layer.attention.window is None
            else f"local: keys within {layer.attention.window} positions either side "
            "(the encoder's window), padding masked, RoPE with the encoder's local theta"
            for layer in spec.layers
        ],
        "final_norm": "the encoder's final norm before the head layers; "
        + ("the head norm after them" if spec.norm is not None else "no head norm"),
        "candidates": {
            "kind": spec.candidates.kind,
            "marker_token_ids": list(spec.candidates.marker_token_ids),
        },  # fmt: skip
        "num_candidates": spec.num_candidates,
        "scorer": {
            "reads": "the gathered marker rows"
            if spec.candidates.kind == "markers"
            else "the CLS row (position 0)",
            "widths": list(spec.scorer.widths),
            "activation": spec.scorer.activation,
        },  # fmt: skip
        "temperature": spec.temperature,
        "action": {
            "reads": list(spec.action_inputs),
            "widths": list(spec.action.widths),
            "activation": spec.action.activation,
            "actions": list(spec.actions),
        },  # fmt: skip
        "marker_count_mismatch": "an error naming the request (never a pad or truncation)",
    }


def decision_manifest(
    job: Job, ckpt: Checkpoint, module: DecisionEncoder, head: DecisionHead, head_sha256: str,
    programs: list[Program], host_files: list[FileEntry], tokenizer: FileEntry | None,
    deviations: list[Deviation], host: HostEmbedding,
) -> Manifest:  # fmt: skip
    """The manifest: the encoder's fields, the pieces named for this task, the head."""
    options = EncoderOptions(partition="host-embedding",
                             prenormalize_embeddings=host.prenormalized)  # fmt: skip
    base = encoder_manifest(job, ckpt, module, options, programs, host_files, tokenizer,
                            deviations, host)  # fmt: skip
    pieces = []
    for piece in base.pieces or []:
        if piece.name == "island":
            piece = piece.model_copy(update={
                "meaning": f"encoder layers 0..{module.num_encoder_layers - 1}, the encoder's "
                f"final norm, head layers {module.num_encoder_layers}..{len(module.layers) - 1}, "
                "the head norm"})  # fmt: skip
        elif piece.name == "tail":
            piece = piece.model_copy(update={
                "runs_on": "cpu (load with compute units CPU only)",
                "meaning": "gather at candidate_positions -> scorer -> raw softmax(z) -> "
                "calibrated softmax(z / T) -> action head on the raw probabilities"})  # fmt: skip
        pieces.append(PieceEntry.model_validate(piece.model_dump()))
    encoder = {**(base.encoder or {}), "output": "decision", "pooling": None,
               "decision": head_description(head, head_sha256)}  # fmt: skip
    return base.model_copy(update={"pieces": pieces, "encoder": encoder})
