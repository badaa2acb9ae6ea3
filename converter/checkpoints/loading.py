"""Load a checkpoint safely: the transformers model (the parity reference), config and tokenizer.

Safe by default: GGUF and safetensors only; pickle-based weights (``pytorch_model.bin``) are
refused unless asked for, and then read with ``weights_only=True``. Remote code shipped with
a checkpoint is never run (``trust_remote_code=False``).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from converter.checkpoints import gguf_weights
from converter.checkpoints.weightfiles import check_loading_info, read_gguf_metadata
from converter.errors import InputError
from converter.pipeline.hashing import sha256_file
from converter.pipeline.runlog import keep_libraries_off_terminal, warnings_to_log
from converter.recipe import ResolvedSource

if TYPE_CHECKING:
    from gguf import GGUFReader

log = logging.getLogger(__name__)

_CAUSAL_LM_TASKS = {"text-generation"}
# Encoder tasks and the transformers auto class that loads each one's reference model.
_ENCODER_TASKS = {
    "feature-extraction": "AutoModel",
    "sentence-similarity": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "decision": "AutoModel",  # the encoder; its decision head is read beside it
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class Checkpoint:
    """A loaded checkpoint and what the manifest says about it."""

    model: Any  # transformers PreTrainedModel, fp32, eval mode
    config: Any
    tokenizer: Any | None
    weight_files: list[Path]
    sha256: str  # over the weight files and config, in name order
    license: str | None
    note: str | None  # e.g. that a GGUF reference is the de-quantized model
    # GGUF: the config keys its metadata carried (the rest are transformers' defaults,
    # `converter.checkpoints.gguf_config`); None for other sources.
    gguf_carried: frozenset[str] | None = None


def has_tokenizer(source: ResolvedSource) -> bool:
    """Whether the source ships a tokenizer: tokenizer metadata in a GGUF file (llama.cpp
    writes it; a file written without it has none), tokenizer files in a folder."""
    if source.gguf_path is not None:
        return bool(read_gguf_metadata(source.gguf_path, ["tokenizer.ggml.model"]))
    return any((source.directory / f).is_file() for f in _TOKENIZER_FILES)


def weight_files(source: ResolvedSource, allow_pickle: bool) -> list[Path]:
    """The files holding the weights; refuses pickle files unless ``allow_pickle``."""
    if source.gguf_path is not None:
        return [source.gguf_path]
    directory = source.directory
    safetensors = sorted(directory.glob("*.safetensors"))
    if safetensors:
        return safetensors
    pickles = sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt"))
    if pickles and not allow_pickle:
        raise InputError(
            f"{directory}: only pickle-based weights ({pickles[0].name}) found; pickle files can "
            "run code when loaded. Convert them to safetensors, or pass --allow-pickle to load "
            "them with torch.load(weights_only=True)"
        )
    if not pickles:
        raise InputError(f"{directory}: no weights found (expected *.safetensors or a .gguf file)")
    return pickles


def load_checkpoint(source: ResolvedSource, task: str, allow_pickle: bool = False) -> Checkpoint:
    """Load config, model and tokenizer from a resolved source."""
    if source.gguf_path is None:
        return _load_checkpoint(source, task, allow_pickle)
    with _gguf_header_parsed_once():  # for the config, and again for the tokenizer
        return _load_checkpoint(source, task, allow_pickle)


def _load_checkpoint(source: ResolvedSource, task: str, allow_pickle: bool) -> Checkpoint:
    import transformers
    from transformers import AutoModelForCausalLM

    keep_libraries_off_terminal()  # transformers' own stderr handler, added on import
    if task not in _CAUSAL_LM_TASKS and task not in _ENCODER_TASKS:
        supported = sorted(_CAUSAL_LM_TASKS | set(_ENCODER_TASKS))
        raise InputError(f"task: {task!r} is not supported yet; supported: {supported}")
    model_class = AutoModelForCausalLM
    if task in _ENCODER_TASKS:
        model_class = getattr(transformers, _ENCODER_TASKS[task])
        # The reference is the plain softmax path (transformers' eager attention).
        kwargs_model: dict[str, Any] = {"attn_implementation": "eager"}
    else:
        kwargs_model = {}
    files = weight_files(source, allow_pickle)
    kwargs = _source_kwargs(source)
    with warnings_to_log("loading the checkpoint"):  # recorded in convert.log
        config = load_config(source, files[0])
        _check_supported(config, files[0])
        try:
            if source.gguf_path is not None and gguf_weights.supported(source.gguf_path):
                # The same weights as transformers' GGUF path, without its repeated header
                # parsing and name search (see converter.checkpoints.gguf_weights).
                loaded: Any = gguf_weights.load_model(source.gguf_path, config, model_class)
            elif files[0].suffix == ".safetensors":
                loaded = _from_read_tensors(model_class, config, files, kwargs | kwargs_model)
            else:
                if source.gguf_file:
                    # The config just read: transformers would parse the GGUF header again.
                    kwargs_model["config"] = config
                loaded = _from_pretrained(model_class, source, files, kwargs | kwargs_model)
        except InputError:
            raise
        except Exception as e:
            raise InputError(f"{files[0]}: cannot load the checkpoint: {e}") from None
    model, loading_info = loaded
    # Every task: transformers only warns about a missing tensor (an encoder's classifier
    # too) and initialises it at random, and the parity reference would be that same model.
    # A task that reads the base model alone (hidden states, sentence embeddings) may come
    # from a checkpoint with a head it does not use: recorded in convert.log, not refused.
    unused = check_loading_info(
        loading_info, files[0], unused_heads_ok=model_class.__name__ == "AutoModel"
    )
    if unused:
        log.info("%s: tensors task %s does not use: %s", files[0], task, ", ".join(unused))
    model.eval()
    tokenizer = load_tokenizer(source)
    hashed = files + ([source.directory / "config.json"] if not source.gguf_file else [])
    digest = _combined_sha256([f for f in hashed if f.exists()])
    note = None
    if source.gguf_file:
        note = (
            "GGUF checkpoint de-quantized to fp32 (gguf.quants, as transformers does); parity "
            "references the de-quantized model, not the original full-precision weights"
        )
    carried = None
    if source.gguf_path is not None:
        from converter.checkpoints.gguf_config import carried_keys

        architecture = read_gguf_metadata(source.gguf_path, ["general.architecture"])
        carried = carried_keys(source.gguf_path, str(architecture.get("general.architecture")))
    return Checkpoint(model, config, tokenizer, files, digest, _license(source), note, carried)


@contextmanager
def _gguf_header_parsed_once() -> Iterator[None]:
    """Inside the block, transformers' GGUF header parse (``load_gguf_checkpoint`` without
    tensors) runs once per file; a call with tensors runs as it is.

    transformers parses the whole header (every metadata array: SmolLM2's 49,152-entry
    vocabulary and its merges) for the config, and again for the tokenizer, which only
    reads the config from it (``AutoTokenizer.from_pretrained(gguf_file=...)``): a third of
    SmolLM2's load step. Each caller gets its own deep copy of the one parse's result, so
    none sees another's changes; the parse itself reads a plain array (`_plain_array_reader`);
    nothing outlives the block.
    """
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    parse, reader = gguf_utils.load_gguf_checkpoint, gguf.GGUFReader
    parsed: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        if return_tensors or args or kwargs:
            return parse(path, return_tensors, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    gguf_utils.load_gguf_checkpoint = once  # type: ignore[assignment]
    gguf.GGUFReader = _plain_array_reader(reader)  # type: ignore[misc]
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = parse
        gguf.GGUFReader = reader  # type: ignore[misc]


def _plain_array_reader(reader: type[GGUFReader]) -> type[GGUFReader]:
    """``gguf.GGUFReader`` (``reader``) reading its file map as a plain ndarray view.

    The reader slices its ``np.memmap`` once per metadata value, and a memmap slice runs
    numpy's Python-level ``memmap.__getitem__`` and ``__array_finalize__``: SmolLM2's header
    (49,152 tokens and their merges) parsed in 1.84 s, 0.78 s through a plain view of the
    same map (the same values; transformers imports the class when it parses).
    """

    class PlainArrayReader(reader):  # type: ignore[valid-type, misc]
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)  # the view keeps the map open

    return PlainArrayReader


def _source_kwargs(source: ResolvedSource) -> dict[str, Any]:
    """transformers' loading arguments for ``source``: never remote code; the GGUF file."""
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return kwargs


def load_config(source: ResolvedSource, where: Path | None = None) -> Any:
    """The checkpoint's transformers config; InputError naming ``where`` (or the source)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.directory, **_source_kwargs(source))
    except Exception as e:  # transformers raises many types for a bad file
        at = where or source.gguf_path or source.directory
        raise InputError(f"{at}: cannot read the checkpoint's config: {e}") from None


def load_tokenizer(source: ResolvedSource) -> Any | None:
    """The checkpoint's own tokenizer, or None when it ships none (`has_tokenizer`).

    transformers 5 builds an empty placeholder tokenizer for a folder without tokenizer
    files; only a GGUF or real tokenizer files count. No tokenizer is allowed (token-id
    fixtures), a placeholder shipped as tokenizer.json would not be.
    """
    from transformers import AutoTokenizer

    if not has_tokenizer(source):
        return None
    try:
        return AutoTokenizer.from_pretrained(source.directory, **_source_kwargs(source))
    except Exception as e:
        raise InputError(f"{source.directory}: cannot load the tokenizer: {e}") from None


def _from_pretrained(
    model_class: Any, source: ResolvedSource, files: list[Path], kwargs: dict[str, Any]
) -> Any:
    """transformers' own loading, with its report of missing, extra and mis-shaped tensors."""
    return model_class.from_pretrained(
        source.directory,
        dtype=torch.float32,
        use_safetensors=None if source.gguf_file else files[0].suffix == ".safetensors",
        output_loading_info=True,
        # Wrong shapes are reported with the rest by check_loading_info.
        ignore_mismatched_sizes=True,
        **kwargs,
    )


def _from_read_tensors(
    model_class: Any, config: Any, files: list[Path], kwargs: dict[str, Any]
) -> Any:
    """transformers' own loading of safetensors ``files``, each tensor read into the process's
    memory (safetensors' pread backend) instead of mapped from the file.

    A tensor of a mapped file keeps every page of the mapping it touched resident until the
    file's last tensor is freed. The rewrite fuses q / k / v and gate / up into new tensors and
    the original model is deleted after the reference step, but the mapped originals stayed
    resident to the end: at the Llama-3.2-1B shape RSS stayed 2.8 GiB above the live tensors
    (bench/README.md, ``llama_1b.py``).
    """
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", backend="pread") as f:
            tensors.update((key, f.get_tensor(key)) for key in f.keys())  # noqa: SIM118 (no __iter__)
    # The concrete class (LlamaForCausalLM, ...): an auto class takes no state dict.
    concrete = model_class._model_mapping[type(config)]
    kwargs = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}
    return concrete.from_pretrained(
        None,
        config=config,
        state_dict=tensors,
        dtype=torch.float32,
        output_loading_info=True,
        ignore_mismatched_sizes=True,
        **kwargs,
    )


def _check_supported(config: Any, where: Path) -> None:
    from graph_passes.archs import ADAPTERS, ENCODER_ADAPTERS

    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS and model_type not in ENCODER_ADAPTERS:
        raise InputError(
            f"{where}: architecture {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(set(ADAPTERS) | set(ENCODER_ADAPTERS)))}"
        )


def _combined_sha256(files: list[Path]) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def _license(source: ResolvedSource) -> str | None:
    """The checkpoint's licence where it is recorded: GGUF metadata, a model card, a package."""
    if source.gguf_path is not None:
        try:
            value = read_gguf_metadata(source.gguf_path, ["general.license"]).get("general.license")
            if isinstance(value, str):
                return value
        except Exception:  # the licence is informative; a reader problem must not fail the run
            pass
    card = source.directory / "README.md"
    if card.is_file():
        match = re.search(r"^license:\s*(\S+)", card.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match.group(1)
    if source.kind == "python-package":
        for dist in importlib.metadata.distributions():
            top = (dist.read_text("top_level.txt") or "").split()
            if (
                source.directory.name in top
                or dist.metadata["Name"].replace("-", "_") == source.directory.name
            ):
                return dist.metadata["License"]
    return None


def tokenizer_json(tokenizer: Any) -> str | None:
    """The tokenizer in Hugging Face ``tokenizer.json`` form, when it has a fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return json.dumps(json.loads(backend.to_str()), ensure_ascii=False, indent=None)
