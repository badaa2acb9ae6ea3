"""Reading a decision head from its checkpoint directory (layout: ``docs/decision-head.md``).

    <checkpoint>/decision_head/config.json        the head's JSON config
    <checkpoint>/decision_head/model.safetensors  the head's tensors (names as in the doc)

A missing file, bad JSON, an unmapped or missing tensor is an `InputError` naming the file and
the key or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from converter.errors import InputError
from converter.pipeline.hashing import sha256_file
from graph_passes.archs.decision_head import HeadSource, adapt_head
from graph_passes.decision_spec import DecisionHead
from graph_passes.spec import EncoderSpec

HEAD_DIR = "decision_head"
HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = "model.safetensors"


def head_files(directory: Path, head_dir: str = HEAD_DIR) -> tuple[Path, Path]:
    """The head's config and weights files under a checkpoint directory."""
    return directory / head_dir / HEAD_CONFIG, directory / head_dir / HEAD_WEIGHTS


def load_head(
    directory: Path, encoder: EncoderSpec, head_dir: str = HEAD_DIR
) -> tuple[DecisionHead, dict[str, torch.Tensor], str]:
    """The mapped head, the file's tensors as stored (the reference loads those) and the
    sha256 of the two files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path, weights_path = head_files(directory, head_dir)
    for path, what in ((config_path, "the head's JSON config"), (weights_path, "its tensors")):
        if not path.is_file():
            raise InputError(f"{path}: missing; a decision checkpoint holds {what} there "
                             "(see docs/decision-head.md)")  # fmt: skip
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{config_path}: not valid JSON: {e}") from None
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise InputError(f"{weights_path}: cannot read the safetensors file: {e}") from None
    source = HeadSource(data, encoder, str(config_path))
    try:
        head = adapt_head(source, tensors, first_layer=encoder.num_layers)
    except InputError as e:
        if "checkpoint tensor" not in str(e):
            raise  # a config error: it names the config file and key already
        raise InputError(f"{weights_path}: {e}") from None  # a tensor error: name the file
    digest = sha256_file(config_path) + sha256_file(weights_path)
    return head, tensors, digest
