"""Checks that run before a conversion touches the output directory or loads any weights.

Everything that can be known from the recipe and the files' headers is checked here, so bad
input fails in about a second with a message naming the file, field or tensor, instead of
after minutes of loading and converting: pickle-only weights, truncated or corrupt weight
files, an architecture without an adapter, prompts without a tokenizer, too little memory or
disk space.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.checkpoints.loading import _TOKENIZER_FILES, has_tokenizer, weight_files
from converter.checkpoints.weightfiles import WeightTable, read_gguf_metadata, read_weight_tables
from converter.coreml.targets import TARGETS, package_budget_bytes
from converter.errors import InputError
from converter.pipeline.resources import (
    MemoryEstimate,
    check_disk,
    check_memory,
    estimate_peak_memory,
)
from converter.recipe import Recipe, ResolvedSource

# Tensor names of the embedding table and a separate LM head (Hugging Face, GGUF).
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "token_embd.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "output.weight")
# Bytes per parameter of a pickle checkpoint, whose header cannot be read without unpickling:
# Hugging Face checkpoints are mostly fp16/bf16, so this errs towards more parameters.
_PICKLE_BYTES_PER_PARAMETER = 2
# The program, manifest, reports, log and tokenizer beside the weights (SmolLM2: ~4 MB).
ARTIFACT_OVERHEAD_BYTES = 16 << 20
_CACHE_FUNCTIONS = 3  # prefill, decode, extend: one single-function package each


@dataclass(frozen=True)
class PreflightReport:
    """What the checks found; the pipeline records nothing of it, tests read it."""

    files: list[Path]
    tables: list[WeightTable]
    n_parameters: int
    memory: MemoryEstimate
    artifact_bytes: int


def preflight(
    recipe: Recipe, source: ResolvedSource, out_dir: Path, allow_pickle: bool
) -> PreflightReport:
    """Run every check that needs no weights loaded; raise InputError on the first problem."""
    files = weight_files(source, allow_pickle)
    tables = read_weight_tables(files)
    _check_architecture(source, tables, recipe.task)
    _check_tokenizer(recipe, source)
    _check_sources(recipe, tables)
    if tables:
        n_parameters = sum(t.n_parameters for t in tables)
    else:
        size = sum(f.stat().st_size for f in files)
        n_parameters = size // _PICKLE_BYTES_PER_PARAMETER
    variants = recipe.compression is not None and bool(recipe.compression.variants)
    memory = estimate_peak_memory(n_parameters, variants, table_elements(tables),
                                  cache_logits(recipe, tables))  # fmt: skip
    check_memory(memory, recipe.name)
    artifact = artifact_bytes(tables, n_parameters)
    needs, purpose = disk_needs(recipe, out_dir, artifact)
    check_disk(needs, recipe.name, purpose)
    return PreflightReport(files, tables, n_parameters, memory, artifact)


def table_elements(tables: list[WeightTable]) -> int:
    """Elements of the token embedding table: the largest tensor named as an embedding
    (``embed_tokens``, ``token_embd``, ``word_embeddings``, ``tok_embeddings``); 0 if none."""
    sizes = [t.n_elements for table in tables for name, t in table.tensors.items()
             if "emb" in name and "position" not in name]  # fmt: skip
    return max(sizes, default=0)


def cache_logits(recipe: Recipe, tables: list[WeightTable]) -> int:
    """A cached decoder's logits of one continuation, (decode steps + 1) x vocabulary (the
    embedding table's longer side); 0 without a cache or a table."""
    cache = getattr(recipe, "cache", None)
    if cache is None or cache.style == "none":
        return 0
    shapes = [t.shape for table in tables for name, t in table.tensors.items()
              if "emb" in name and "position" not in name]  # fmt: skip
    vocab = max((max(shape) for shape in shapes if shape), default=0)
    return (cache.decode_steps + 1) * vocab


def disk_needs(recipe: Recipe, out_dir: Path, artifact: int) -> tuple[dict[Path, int], str]:
    """Free space the conversion needs, by folder, and what needs it.

    Each compressed variant is an artifact of its own beside the fp16 one, counted here at
    the fp16 artifact's size (compression only makes it smaller). A cached decoder converts
    each function of a package into its own single-function package beside the staged
    artifact, combines them (coremltools writes the combined package into the temporary
    folder first, then copies it) and removes them: per package its weights three more
    times, and once in the temporary folder, a package holding at most the recipe's package
    budget. The 1B shape's state cache failed twice inside coremltools' writers with 14 GB
    free while other runs wrote to the disk, and converted with 45 GB free.
    """
    variants = len(recipe.compression.variants) if recipe.compression is not None else 0
    needs = {out_dir: artifact * (1 + variants)}
    purpose = "the artifact" + (f" and its {variants} compressed variants" if variants else "")
    cache = getattr(recipe, "cache", None)
    if cache is None or cache.style == "none":
        return needs, purpose
    budget = package_budget_bytes(cache.package_budget_mb, TARGETS[recipe.target].platform)
    package = min(artifact, budget)
    needs[out_dir] += _CACHE_FUNCTIONS * package
    needs[Path(tempfile.gettempdir())] = package
    return needs, purpose + " with the single-function packages, while they are combined,"


def artifact_bytes(tables: list[WeightTable], n_parameters: int) -> int:
    """The published artifact's size, about: every weight in fp16, the tied table twice.

    With tied embeddings the table is both the LM head (in the package) and either the
    in-model gather or the host-side ``embeddings.npy``. Plus a fixed allowance for the
    files beside the weights.
    """
    tensors = {name: t for table in tables for name, t in table.tensors.items()}
    embedding = next((tensors[n] for n in _EMBEDDING_NAMES if n in tensors), None)
    tied = embedding is not None and not any(n in tensors for n in _LM_HEAD_NAMES)
    weights = 2 * n_parameters + (2 * embedding.n_elements if tied and embedding else 0)
    return weights + ARTIFACT_OVERHEAD_BYTES


def _read_config(source: ResolvedSource) -> dict[str, Any] | None:
    path = source.directory / "config.json"
    if source.gguf_file or not path.is_file():
        return None  # a GGUF carries its config; a folder without config.json fails at loading
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read the checkpoint's config: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_architecture(source: ResolvedSource, tables: list[WeightTable], task: str) -> None:
    """Refuse an architecture anec has no adapter for (for ``task``), before transformers
    sees it.

    transformers would otherwise fail on an unknown ``model_type`` with advice to upgrade it,
    or load a known but unsupported one in full before anec refuses it.
    """
    from graph_passes.archs import ADAPTERS, ENCODER_ADAPTERS

    adapters = ADAPTERS if task == "text-generation" else ENCODER_ADAPTERS
    supported = f"supported for task {task}: " + ", ".join(sorted(adapters))
    config = _read_config(source)
    if config is not None:
        model_type = config.get("model_type")
        if model_type not in adapters:
            remote = (
                "; its auto_map points at code shipped with the checkpoint, which anec never runs"
                if "auto_map" in config
                else ""
            )
            raise InputError(
                f"{source.directory / 'config.json'}: model_type: architecture {model_type!r} is "
                f"not supported; {supported}{remote}"
            )
    for table in tables:
        if table.format == "gguf":
            _check_gguf_architecture(table, adapters, supported)


def _check_gguf_architecture(table: WeightTable, adapters: Collection[str], supported: str) -> None:
    """A GGUF architecture is what transformers loads it as (llama.cpp's ``gemma3`` is
    ``gemma3_text``); one it does not load from GGUF is refused by name."""
    from converter.checkpoints.gguf_config import model_type

    arch = str(table.architecture)
    name = read_gguf_metadata(table.file, ["general.name"]).get("general.name")
    loaded_as = model_type(arch, name if isinstance(name, str) else None)
    where = f"{table.file}: general.architecture: {arch!r}"
    if loaded_as is None:
        raise InputError(
            f"{where}: transformers does not load this architecture from GGUF; {supported}"
        )
    if loaded_as not in adapters:
        raise InputError(
            f"{where} (transformers model type {loaded_as!r}) is not supported; {supported}"
        )


def _check_sources(recipe: Recipe, tables: list[WeightTable]) -> None:
    """Each compression variant's method may refuse the source's weight tables by name (e.g.
    method grid: a GGUF holding K-quant tensors)."""
    from converter.compression import methods

    variants = recipe.compression.variants if recipe.compression is not None else []
    for variant in variants:
        methods.get(variant.method).check_source(variant, tables)


def _check_tokenizer(recipe: Recipe, source: ResolvedSource) -> None:
    """Prompts and text pairs need the checkpoint's tokenizer; a folder without tokenizer
    files has none."""
    texts = recipe.fixtures.prompts or recipe.fixtures.pairs
    if not texts or has_tokenizer(source):
        return
    key = "prompts" if recipe.fixtures.prompts else "pairs"
    if source.gguf_path is not None:
        raise InputError(
            f"fixtures.{key}: {source.gguf_path} has no tokenizer (no tokenizer.ggml.model "
            "metadata); give fixtures.token_ids instead"
        )
    raise InputError(
        f"fixtures.{key}: {source.directory} has no tokenizer (none of "
        f"{', '.join(_TOKENIZER_FILES)}); add the checkpoint's tokenizer files or give "
        "fixtures.token_ids instead"
    )
