"""The naive baseline: a recipe's checkpoint converted without the BC1L rewrite.

The same checkpoint through ``graph_passes.naive_llama.NaiveLlama`` — a plain (B, L, C) port
with ``nn.Linear``, heads batched as (B, H, L, d), softmax on the last axis and one
vocabulary-wide LM head — traced and converted to an fp16 ML Program exactly as anec
converts its own module. It exists to be compared with ``anec plan-inspect --compare``; it
is not an artifact: no parity gate runs on it (its RMSNorm is not fp16-safe on SmolLM2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.recipe import Recipe

BASELINE_FILE = "baseline.json"
SUFFIX = "-naive"


def baseline_module(recipe: Recipe, checkpoint: Any) -> Any:
    """The naive port of a Llama-family checkpoint for the recipe's window."""
    from graph_passes.naive_llama import NaiveLlama

    try:
        return NaiveLlama.from_hf(
            checkpoint.config, checkpoint.model.state_dict(), recipe.shapes.sequence_length
        )
    except (KeyError, AttributeError) as e:
        raise InputError(
            f"{recipe.name}: the naive baseline covers Llama-style decoders only ({e})"
        ) from None


def build_baseline(recipe: Recipe, out_dir: Path, force: bool = False) -> Path:
    """Convert the recipe's checkpoint naively into ``OUT/<name>-naive/``; returns that dir.

    Writes ``<name>-naive.mlpackage`` and ``baseline.json`` (what it is and how it was made).
    """
    from dataclasses import asdict

    from converter.checkpoints.loading import load_checkpoint
    from converter.coreml.program import TensorIO, save_package, to_mlprogram, trace
    from converter.coreml.targets import TARGETS
    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.pipeline.publish import stage_artifact, write_json_atomic

    if recipe.task != "text-generation":
        raise InputError(f"{recipe.name}: the naive baseline is for decoders (text-generation)")
    name = recipe.name + SUFFIX
    with stage_artifact(out_dir, name, force=force) as stage:
        ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
        module = baseline_module(recipe, ckpt).eval()
        del ckpt.model
        cfg = module.cfg
        b, length = recipe.shapes.batch, recipe.shapes.sequence_length
        inputs = [
            TensorIO("inputs_embeds", (b, length, cfg.hidden_size), "float16", "embedding rows"),
            TensorIO("key_mask", (b, length), "float16", "additive key mask"),
        ]
        outputs = [TensorIO("logits", (b, 1, cfg.vocab_size), "float16", "last-position logits")]
        traced = trace(module, inputs)
        mlmodel = to_mlprogram(
            traced, inputs, outputs, TARGETS[recipe.target].ct_target(), recipe.precision
        )
        package = stage.path / f"{name}.mlpackage"
        save_package(mlmodel, package)  # canonical, like anec's own packages
        write_json_atomic(
            stage.path / BASELINE_FILE,
            {
                "name": name,
                "recipe": recipe.name,
                "form": "naive (B, L, C): nn.Linear, heads batched (B, H, L, d), softmax on the "
                "last axis, one vocabulary-wide LM head (graph_passes/naive_llama.py)",
                "not_an_artifact": "no parity gates ran; for side-by-side comparison only",
                "layers": cfg.num_layers,
                "shapes": {"batch": b, "sequence_length": length},
                "target": recipe.target,
                "precision": recipe.precision,
                "package": package.name,
                "content_sha256": mlpackage_content_hash(package),
                "inputs": [asdict(t) for t in inputs],
                "outputs": [asdict(t) for t in outputs],
            },
        )
        return stage.commit()
