"""The ``anec generate`` command: greedy generation with a cached draft decoder artifact."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import click


def artifact_source(directory: Path) -> tuple[Any, str]:
    """Where the checkpoint an artifact was converted from is (from its manifest), and its task."""
    from converter.recipe import recipe_from_dict
    from converter.recipe.sources import ResolvedSource

    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    recipe = recipe_from_dict(manifest["recipe"])
    resolved = manifest["recipe"].get("resolved_source")
    source = (
        ResolvedSource(resolved["kind"], Path(resolved["directory"]), resolved["gguf_file"])
        if resolved
        else recipe.resolve_source()
    )
    return source, recipe.task


def reference_ids(directory: Path, prompt_ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation (fp32) of the checkpoint the manifest names."""
    from converter.checkpoint import load_checkpoint
    from converter.errors import InputError
    from parity.kv_reference import greedy_ids

    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    source, task = artifact_source(directory)
    ckpt = load_checkpoint(source, task)
    if ckpt.sha256 != manifest["checkpoint"]["sha256"]:
        raise InputError(f"{source.directory}: not the checkpoint the artifact was made from")
    return greedy_ids(ckpt.model.float().eval(), tuple(prompt_ids), steps)


@click.command("generate")
@click.argument(
    "artifact", type=click.Path(path_type=Path, exists=True, file_okay=False, dir_okay=True)
)
@click.option("--prompt", required=True, help="The prompt text (tokenized as the artifact's "
              "tokenizer.json does).")  # fmt: skip
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option(
    "--backend",
    type=click.Choice(["mil", "coreml"]),
    default="coreml" if platform.system() == "Darwin" else "mil",
    help="mil: anec's MIL evaluator (fp16 profile); coreml: Core ML on macOS (never run on "
    "the machine anec is developed on).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Also run transformers' greedy continuation (fp32) of the original checkpoint and "
    "report how many steps match.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def generate_command(
    artifact: Path, prompt: str, max_new_tokens: int, backend: str, check: bool, as_json: bool
) -> None:
    """Greedy generation from ARTIFACT (a cached decoder: recipe cache.style state or io),
    driven by its manifest alone: prefill the prompt, then one decode call per token.

    Exit codes: 0 generated (with --check: and every step matched), 1 --check found a
    divergence, 2 bad input.
    """
    from converter.errors import InputError
    from converter.generate import Runtime, coreml_backend, greedy, mil_backend

    runtime = Runtime.from_artifact(artifact)
    if runtime.tokenizer is None:
        raise InputError(f"{artifact}: the artifact ships no tokenizer.json to encode --prompt")
    make = mil_backend(runtime) if backend == "mil" else coreml_backend(runtime)
    prompt_ids = list(runtime.tokenizer.encode(prompt).ids)
    result = greedy(make, prompt_ids, max_new_tokens)
    doc: dict[str, object] = {
        "backend": backend,
        "prompt_tokens": len(prompt_ids),
        "new_ids": result.new_ids,
        "text": result.text(runtime.tokenizer),
        "evictions": result.evictions,
    }
    matched = None
    if check:
        ref = reference_ids(artifact, prompt_ids, len(result.new_ids))
        matched = next(
            (i for i, (a, b) in enumerate(zip(result.new_ids, ref, strict=True)) if a != b),
            len(ref),
        )
        doc["reference_ids"] = ref
        doc["steps_matched"] = matched
        doc["steps"] = len(ref)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        click.echo(f"{prompt}{doc['text']}")
        if matched is not None:
            click.echo(f"steps matched against transformers fp32: {matched} / {doc['steps']}")
    if matched is not None and matched < len(result.new_ids):
        raise SystemExit(1)
