"""The artifact manifest (``manifest.json``): the contract a runtime engine reads.

Versioned with ``schema_version``; a runtime refuses a major version it does not know, and
anec refuses a manifest older than `SCHEMA_VERSION` (`check_schema_version`): its packages
were built for another I/O contract, which anec no longer reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from converter.errors import InputError

SCHEMA_VERSION = 7
# The first schema whose cached decoders were judged by the cache rule of 2026-12-05.
CACHE_RULE_SINCE = 7

# Every change of the I/O contract a runtime sees, newest last; recorded in each manifest.
IO_CONTRACT_CHANGES: list[dict[str, Any]] = [
    {
        "schema_version": 3,
        "tasks": ["text-generation"],
        "what": "LM-head outputs logits_<k> laid out with the vocabulary last: (B, n, 1, V_k), "
        "[batch, position, 0, token], for the window program and every cached function",
        "before": "schema 2: (B, V_k, 1, n), [batch, token, 0, position]",
        "why": "one logit per 64-byte NE row made the output copies 32x the logits' bytes "
        "(3 MiB per call for SmolLM2's 96 KiB); vocabulary-last rows are dense",
    },
    {
        "schema_version": 4,
        "tasks": ["text-generation"],
        "what": "a cached decoder may be chunked: kv_cache.chunks lists its packages in call "
        "order (layers, cache, functions' tensors, the hidden_out -> hidden_in tensor each "
        "passes to the next); package is then chunk 0 only; kv_cache.chunking states the "
        "budget and the chunk count (1: one package, as before)",
        "before": "schema 3: one package held every layer",
        "why": "cache.package_budget_mb: about 1 GB per package on iOS, 2 GB on macOS",
        # A schema 3 manifest means what it meant (one package): still read.
        "older_readable": True,
    },
    {
        "schema_version": 5,
        "tasks": ["text-generation"],
        "what": "every function of a state-style cached decoder writes its tokens' keys and "
        "values into their slots before attending: its mask and mask_window_<w> inputs are "
        "(1, S, 1, T), the S slots alone, the call's own tokens visible in theirs; io-style "
        "functions keep (1, S + T, 1, T)",
        "before": "schema 4: every function's masks were (1, S + T, 1, T)",
        "why": "the decode step attends as the window program does (one score, softmax and "
        "weighted sum per head): SmolLM2's decode function 5,512 -> 3,230 ops",
        # The masks' shapes in kv_cache.functions say which layout a function has.
        "older_readable": True,
    },
    {
        "schema_version": 6,
        "tasks": ["text-generation"],
        "what": "a draft may have a trimmed LM head (recipe vocabulary:): draft_vocabulary "
        "names head_ids.npy, and logits index j (every argmax / top-k index too) is token "
        "head_ids[j]; without the section, index j is token j as before",
        "before": "schema 5: the head scored every token id",
        "why": "a draft streams fewer weight bytes per decoded token (issue 25)",
        # Older manifests have no trimmed head: index j is token j, as they meant.
        "older_readable": True,
    },
    {
        "schema_version": 7,
        "tasks": ["text-generation"],
        "what": "a cached decoder's gates follow SPEC 4's rule of 2026-12-05: the fp32 cache "
        "level (fp32_layer_rel_error, fp32_logits_rel_error, kv_fp32_* at level kv-cache: "
        "every call over each whole continuation against the window module in fp64 with no "
        "cache) judges the conversion; in fp16 kv_max_abs_dprob <= 0.03, no argmax flip past "
        "the margin (decode and extend), finite, stale bits; kv_max_abs_logit_error and "
        "kv_extend_max_abs_diff are retired (reported in kv_parity.json, not gated)",
        "before": "schema 6: kv_max_abs_logit_error and kv_extend_max_abs_diff <= 0.25 and "
        "kv_max_abs_dprob <= 0.02, fp16 only; one call per function checked in fp32",
        "why": "one absolute fp16 logit bound was too loose for cache faults and too tight "
        "for fp16's own drift on Gemma 3 (issue 40); the I/O contract is unchanged",
        "older_readable": True,
    },
]


def check_schema_version(doc: dict[str, Any], path: Path) -> None:
    """Refuse a manifest this anec cannot read: InputError naming the file, the version found
    and what changed since. A newer schema is refused; an older one is refused when a change
    since then applies to its task (schema 2 decoders return vocabulary-on-axis-1 logits,
    which would be read wrongly), and accepted otherwise (an encoder's contract did not
    change)."""
    found = doc.get("schema_version") if isinstance(doc, dict) else None
    if found == SCHEMA_VERSION:
        return
    task = doc.get("task") if isinstance(doc, dict) else None
    older = isinstance(found, int) and found < SCHEMA_VERSION
    if not older:  # newer, or not a version at all
        raise InputError(
            f"{path}: manifest schema_version {found!r}, this anec reads {SCHEMA_VERSION} "
            "and older; use the anec that wrote it"
        )
    since = [
        c["what"]
        for c in IO_CONTRACT_CHANGES
        if c["schema_version"] > found and task in c["tasks"] and not c.get("older_readable")
    ]
    if not since:
        return
    raise InputError(
        f"{path}: manifest schema_version {found!r} (task {task}), this anec reads "
        f"{SCHEMA_VERSION} (changed since: {'; '.join(since)}); convert the recipe again "
        "with this anec"
    )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorEntry(_Strict):
    """One input or output of the package."""

    name: str
    shape: list[int]
    dtype: str
    meaning: str


class FileEntry(_Strict):
    """A file shipped beside the package, with its hash."""

    file: str
    sha256: str
    dtype: str | None = None
    shape: list[int] | None = None
    meaning: str = ""


class Deviation(_Strict):
    """A numeric change forced by the target format, and why it is harmless or how it shows."""

    where: str
    what: str
    original: float | str
    effective: float | str
    why: str


class PackageEntry(_Strict):
    """The .mlpackage and the hashes of its content files (its Manifest.json excluded)."""

    file: str
    content_sha256: str
    files: dict[str, str]
    function: str
    live_ops: dict[str, int]


class PieceEntry(_Strict):
    """One piece of a partitioned model; ``Manifest.pieces`` lists them in call order."""

    name: str
    runs_on: str  # "host", "neural-engine" (intended, not observed), ...
    files: list[str]
    inputs: list[str]
    outputs: list[str]
    meaning: str


class BoundaryEntry(_Strict):
    """One copy between two pieces per call: what crosses and how many bytes."""

    source: str
    target: str
    tensors: list[TensorEntry]  # name, shape, dtype and layout (meaning) of each
    bytes: int


class Manifest(_Strict):
    """Everything a runtime needs to call the package correctly, and how it was made."""

    schema_version: int = SCHEMA_VERSION
    io_contract_changes: list[dict[str, Any]] = IO_CONTRACT_CHANGES
    name: str
    task: str
    architecture: str
    target: str
    precision: str
    batch: int
    sequence_length: int
    inputs: list[TensorEntry]
    outputs: list[TensorEntry]
    conventions: dict[str, str]
    masked_value: float
    rope_theta: list[float]
    vocab_size: int
    lm_head_chunks: list[int]
    # Decoders: the head output choice (io.output), how the host combines the chunks and the
    # bytes per call (converter.tasks.decoder_contract.head_output_section).
    head_output: dict[str, Any] | None = None
    package: PackageEntry
    embeddings: FileEntry | None
    tokenizer: FileEntry | None
    parity: FileEntry
    deviations: list[Deviation]
    checkpoint: dict[str, Any]
    recipe: dict[str, Any]
    tools: dict[str, str]
    # Encoders (optional, absent for draft decoders): task details, and for a partitioned
    # encoder its pieces in call order, the boundary copies, host-side files and the tail.
    encoder: dict[str, Any] | None = None
    pieces: list[PieceEntry] | None = None
    boundaries: list[BoundaryEntry] | None = None
    host_files: list[FileEntry] | None = None
    extra_packages: list[PackageEntry] | None = None
    # Compressed variants (optional, absent for an fp16 artifact): the variant, how every
    # weight was compressed, the size report and what stays fp16 (converter.compression).
    compression: dict[str, Any] | None = None
    # A cached decoder (recipe cache.style state or io; absent otherwise): its functions with
    # their tensors, the cache, the RoPE tables and the host conventions
    # (converter.tasks.kv_contract).
    kv_cache: dict[str, Any] | None = None
    # A trimmed LM head (recipe vocabulary:; absent otherwise): head_ids.npy, the index rule,
    # the ranking and the measured acceptance (converter.tasks.draft_vocabulary).
    draft_vocabulary: dict[str, Any] | None = None
