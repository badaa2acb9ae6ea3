"""What transformers makes of a GGUF file's architecture and metadata, for anec's checks.

transformers loads a GGUF decoder under a model type of its own (``load_gguf_checkpoint`` in
``transformers.modeling_gguf_pytorch_utils``): llama.cpp's ``gemma3`` becomes ``gemma3_text``
(a Gemma GGUF holds the text backbone only), a few GGUF spellings are rewritten first, and an
architecture missing from its ``GGUF_SUPPORTED_ARCHITECTURES`` is not loaded at all. The config
keys come from its ``GGUF_CONFIG_MAPPING`` table; every other config value is the config
class's default (Gemma 3's ``query_pre_attn_scalar``, local RoPE base and layer pattern,
Qwen 3's ``head_dim``). `assumed_values` lists the values anec's adapter read that the file
did not carry, for the manifest's deviations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from converter.checkpoints.weightfiles import read_gguf_metadata
from converter.pipeline.manifest import Deviation

# load_gguf_checkpoint's renames, done in its code rather than its tables (transformers 5).
_SPELLINGS = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
_TEXT_BACKBONES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
_NOT_MODELS = {"general", "tokenizer"}  # sections of its table, not architectures
# transformers derives these from the file itself, not from a metadata key.
_DERIVED = {"model_type", "architectures", "tie_word_embeddings"}


def _spelled(architecture: str, name: str | None) -> str:
    # transformers: ``"mistral" in model_name`` on the one-element list of general.name.
    if "llama" in architecture and name == "mistral":
        return "mistral"
    return _SPELLINGS.get(architecture, architecture)


def model_type(architecture: str, name: str | None = None) -> str | None:
    """The config ``model_type`` transformers loads a GGUF ``general.architecture`` as (and
    ``general.name``), or None when transformers does not load that architecture from GGUF."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    spelled = _spelled(architecture, name)
    if spelled in _NOT_MODELS or spelled not in GGUF_SUPPORTED_ARCHITECTURES:
        return None
    return _TEXT_BACKBONES.get(spelled, spelled)


def carried_keys(path: Path, architecture: str) -> frozenset[str]:
    """The config keys transformers sets from the GGUF file's metadata (its
    ``GGUF_CONFIG_MAPPING`` rows the file has), and those it derives from the file itself."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    table = cast(Mapping[str, Any], GGUF_CONFIG_MAPPING.get(_spelled(architecture, None), {}))
    wanted = {f"{architecture}.{key}": target for key, target in table.items()}
    found = read_gguf_metadata(path, [*wanted, "tokenizer.ggml.tokens"])
    keys = {str(wanted[k]) for k in found if isinstance(wanted.get(k), str)}
    if "tokenizer.ggml.tokens" in found:
        keys.add("vocab_size")  # transformers counts the vocabulary when no key gives it
    return frozenset(keys | _DERIVED)


class ConfigReads:
    """A config that records every key read from it (the architecture adapters read a config
    through ``getattr`` only): the values anec's model depends on."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "keys", set[str]())

    def __getattr__(self, key: str) -> Any:
        value = getattr(self._config, key)  # AttributeError: the adapter's default applies
        if not callable(value):
            self.keys.add(key)
        return value


def _value(value: Any) -> float | str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return repr(dict(value) if isinstance(value, Mapping) else value)


def assumed_values(
    config: Any, read: Iterable[str], carried: frozenset[str], gguf_file: str
) -> list[Deviation]:
    """A deviation for each config value the adapter ``read`` that the GGUF file did not
    carry: transformers' config default, used by the program and its reference alike."""
    out = []
    for key in sorted(set(read) - carried):
        value = getattr(config, key)
        what = "not in the GGUF metadata: transformers' config default"
        if key == "rope_parameters" and "rope_theta" in carried:
            if isinstance(value, Mapping) and not any(
                isinstance(v, Mapping) for v in value.values()
            ):
                continue  # one RoPE entry, its base from rope.freq_base
            what = (
                "one RoPE base per layer type; the GGUF metadata carries one (rope.freq_base), "
                "transformers' config defaults give the others"
            )
        out.append(
            Deviation(
                where=f"config.{key}",
                what=what,
                original=f"absent from {gguf_file}",
                effective=_value(value),
                why=f"{type(config).__name__} default; the program and its parity reference "
                "both use it, so the gates cannot tell whether the checkpoint was trained with it",
            )
        )
    return out
