"""What a recipe made from a checkpoint reads from it: architecture, task, vocabulary, tied
embeddings and tokenizer; its config and tokenizer only, never its weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.pipeline.runlog import warnings_to_log
from converter.recipe import ResolvedSource


@dataclass(frozen=True)
class CheckpointFacts:
    """The checkpoint's choices a recipe takes over (`converter.recipe.from_checkpoint`)."""

    model_type: str
    tasks: tuple[str, ...]  # the tasks its registered architecture converts
    task: str | None  # the task it was made for, None when its files do not say
    task_note: str  # why that task, or why none
    vocab_size: int
    tied_embeddings: bool
    tokenizer: Any | None
    # Why it scores text pairs (a cross-encoder), or "" when nothing says it does.
    pair_note: str = ""


def read_facts(source: ResolvedSource) -> CheckpointFacts:
    """Read the config (and tokenizer) of ``source``; InputError for an unsupported one."""
    # Here, not above: transformers and torch load only when a checkpoint is read.
    from converter.checkpoints.loading import load_config, load_tokenizer
    from graph_passes.archs import REGISTRY, find

    with warnings_to_log("reading the checkpoint's config"):
        config = load_config(source)
        tokenizer = load_tokenizer(source)
    arch = find(config)
    model_type = str(getattr(config, "model_type", None))
    if arch is None or arch.family == "head":
        supported = sorted(t for t, a in REGISTRY.items() if a.family != "head")
        raise InputError(
            f"{source.gguf_path or source.directory}: architecture {model_type!r} is not "
            f"supported; supported: {', '.join(supported)}"
        )
    classes = [str(c) for c in getattr(config, "architectures", None) or []]
    if arch.family == "decoder":
        task: str | None = "text-generation"
        note = f"{model_type} is a decoder"
    else:
        task, note = _encoder_task(classes, source.directory)
    return CheckpointFacts(
        model_type=model_type,
        tasks=arch.tasks,
        task=task,
        task_note=note,
        vocab_size=int(config.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        tokenizer=tokenizer,
        pair_note=_pair_note(config) if arch.family == "encoder" else "",
    )


def _pair_note(config: Any) -> str:
    """Why an encoder reads text pairs: sentence-transformers' CrossEncoder keys in its
    config, or a classifier head of one label (a reranker's relevance score); "" otherwise."""
    for key in ("sentence_transformers", "sbert_ce_default_activation_function"):
        if getattr(config, key, None) is not None:
            return f"config.json has sentence-transformers' CrossEncoder key {key}"
    classes = [str(c) for c in getattr(config, "architectures", None) or []]
    heads = any(c.endswith("ForSequenceClassification") for c in classes)
    if heads and int(getattr(config, "num_labels", 0)) == 1:
        return "one label: a cross-encoder's relevance score"
    return ""


def _encoder_task(classes: list[str], directory: Path) -> tuple[str | None, str]:
    """An encoder's task: its head class, a sentence-transformers folder, or the bare model."""
    heads = [c for c in classes if c.endswith("ForSequenceClassification")]
    if heads:
        return "text-classification", f"config.architectures names {heads[0]}"
    pooling = _sentence_pooling(directory)
    if pooling == "mean, normalized":
        return "sentence-similarity", "a sentence-transformers model: mean pooling, normalized"
    if pooling is not None:
        return None, (
            f"a sentence-transformers model with {pooling} pooling (anec implements mean "
            "pooling with L2 normalisation); --task feature-extraction converts its token states"
        )
    bare = [c for c in classes if c.endswith("Model")]
    if bare:
        return "feature-extraction", f"config.architectures names {bare[0]} (no task head)"
    return None, "config.json names no architecture class"


def _sentence_pooling(directory: Path) -> str | None:
    """A sentence-transformers folder's pooling in words (modules.json), else None."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        pooling_dir = directory / str(kinds["Pooling"].get("path", "1_Pooling"))
        pooling = json.loads((pooling_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return "an unreadable"
    modes = [
        k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
        for k, v in pooling.items()
        if k.startswith("pooling_mode_") and v is True
    ]
    mode = "+".join(sorted(modes)) or "no"
    return f"{mode}, normalized" if "Normalize" in kinds else mode
