"""An encoder checkpoint whose weights disagree with its config is refused, for every task.

transformers only warns about a tensor the config needs and the file lacks, and fills it with
random values; the parity gates would then compare the converted model with that same random
model and pass. These rows save a tiny BERT with one tensor removed (the classifier, or an
encoder weight that feature extraction needs) and expect exit 2 naming the tensor, before
any output is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from encoder_models import hf_model, random_sequences, tiny_config
from safetensors.torch import load_file, save_file
from tiny_models import one_torch_thread, run_anec


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


def save_without(path: Path, classify: bool, drop: str) -> Path:
    """A tiny BERT (classifier or plain encoder) saved with tensor ``drop`` removed."""
    hf_model(tiny_config("bert"), classify=classify).save_pretrained(path)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    assert drop in tensors, sorted(tensors)
    del tensors[drop]
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def write_recipe(tmp: Path, checkpoint: Path, task: str) -> Path:
    doc = {
        "name": "bert-incomplete",
        "task": task,
        "source": {"kind": "hf-dir", "path": str(checkpoint)},
        "shapes": {"batch": 1, "sequence_length": 16},
        "fixtures": {"token_ids": random_sequences(3, (5, 9), first=1), "padded_variants": False},
    }
    path = tmp / "recipe.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


@pytest.mark.parametrize(
    ("task", "classify", "drop"),
    [
        ("text-classification", True, "classifier.weight"),
        ("text-classification", True, "bert.encoder.layer.1.output.dense.bias"),
        ("feature-extraction", False, "encoder.layer.2.attention.self.query.weight"),
        ("sentence-similarity", False, "embeddings.LayerNorm.weight"),
    ],
)
def test_encoder_checkpoint_missing_a_tensor_is_refused(
    tmp_path: Path, task: str, classify: bool, drop: str
) -> None:
    checkpoint = save_without(tmp_path / "ckpt", classify, drop)
    out = tmp_path / "out"
    result = run_anec("convert", write_recipe(tmp_path, checkpoint, task), "--out", out)
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "model.safetensors: the config and the weights disagree: missing tensor" in message
    # transformers names a head's tensor as the model holds it (no base-model prefix).
    assert drop.removeprefix("bert.") in message, message
    assert not (out / "bert-incomplete").exists()


def test_encoder_checkpoint_with_a_wrongly_shaped_tensor_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    hf_model(tiny_config("bert"), classify=True).save_pretrained(checkpoint)
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors["classifier.weight"] = torch.zeros(5, 64)
    save_file(tensors, weights, metadata={"format": "pt"})
    recipe = write_recipe(tmp_path, checkpoint, "text-classification")
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "tensor classifier.weight has shape [5, 64] in the file" in message, message
    assert "the config expects [3, 64]" in message


def test_the_hidden_states_of_a_classifier_checkpoint_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Feature extraction reads the base model only: a classifier checkpoint's head is unused,
    recorded in the log by name, not a reason to refuse the checkpoint."""
    import logging

    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import ResolvedSource

    checkpoint = tmp_path / "ckpt"
    hf_model(tiny_config("bert"), classify=True).save_pretrained(checkpoint)
    with caplog.at_level(logging.INFO, logger="converter.checkpoints.loading"):
        ckpt = load_checkpoint(ResolvedSource("hf-dir", checkpoint, None), "feature-extraction")
    assert type(ckpt.model).__name__ == "BertModel"
    assert "does not use" in caplog.text and "classifier.weight" in caplog.text
