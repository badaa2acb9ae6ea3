"""The vendored Hugging Face ``config.json`` files of real checkpoints (tests/data/configs).

They live inside the repository so the real-shape tests run in any checkout and any CI: a
missing file is a failure, never a silent skip (tests/data/configs/README.md lists them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tiny_models import perturb_

CONFIG_DIR = Path(__file__).resolve().parent / "data" / "configs"


def config_path(name: str) -> Path:
    """``tests/data/configs/<name>.json``; FileNotFoundError naming it when absent."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vendored config missing (see {CONFIG_DIR}/README.md)")
    return path


def config_dict(name: str) -> dict[str, Any]:
    """The vendored config ``name`` as a dict."""
    data: dict[str, Any] = json.loads(config_path(name).read_text())
    return data


def build_causal_lm(
    name: str,
    model_class: str,
    config_class: str,
    path: Path,
    layers: int,
    vocab: int,
    layer_types: tuple[str, ...] = (),
    peak: float = 1.0,
    residual: float = 1.0,
) -> transformers.PretrainedConfig:
    """transformers' ``model_class`` at the vendored config ``name``, cut to ``layers`` layers
    and a ``vocab``-row vocabulary (special ids 0-2 inside it), every parameter perturbed after
    random initialisation (zero biases and unit norm weights would hide a dropped bias or a
    wrong norm), the final norm's gain times ``peak`` (random weights give near-uniform logits;
    a peak spreads them so argmax margins exceed the gates' certificates), each layer's residual
    branches (attention output and MLP down projections) times ``residual`` (below about 0.01
    the stream keeps each token's embedding and a tied head's argmax is the input token, with
    margins no fp16 error reaches), saved as safetensors in ``path``; returns its config."""
    data = config_dict(name)
    data.pop("architectures", None)
    data["num_hidden_layers"] = layers
    data["vocab_size"] = vocab
    # Special ids inside the cut vocabulary (the pad id fills left-padded slots).
    data.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if "layer_types" in data:
        data["layer_types"] = list(layer_types) or data["layer_types"][:layers]
    config = getattr(transformers, config_class)(**data)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        perturb_(model, scale=0.02)
        model.model.norm.weight.mul_(peak)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual)
            layer.mlp.down_proj.weight.mul_(residual)
    model.save_pretrained(path, safe_serialization=True)
    return config
