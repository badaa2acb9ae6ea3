"""The ``anec generate`` command: greedy generation with a cached draft decoder artifact."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import click


def reference_steps(directory: Path, prompt_ids: list[int], steps: int) -> list[tuple[int, float]]:
    """transformers' greedy continuation (fp32) of the checkpoint the manifest names, with
    each step's top-1 minus top-2 logit gap."""
    import torch

    from converter.drafts.host_loop import Runtime, artifact_checkpoint
    from parity.reference import greedy_steps, restrict_head

    model = artifact_checkpoint(directory).model.float().eval()
    head_ids = Runtime.from_artifact(directory).head_ids()
    if head_ids is None:
        return greedy_steps(model, tuple(prompt_ids), steps)
    # A trimmed draft is checked against the checkpoint restricted to its head's ids.
    ids = torch.from_numpy(head_ids)
    restrict_head(model, ids)
    return greedy_steps(model, tuple(prompt_ids), steps, ids)


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
    help="Also run transformers' greedy continuation (fp32) of the original checkpoint, report "
    "how many steps match and the first step where its top-1 and top-2 logits are within "
    "0.05 (a near tie, where either token is a valid pick); every step before it must match.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def generate_command(
    artifact: Path, prompt: str, max_new_tokens: int, backend: str, check: bool, as_json: bool
) -> None:
    """Greedy generation from ARTIFACT (a cached decoder: recipe cache.style state or io),
    driven by its manifest alone: prefill the prompt, then one decode call per token.

    Exit codes: 0 generated (with --check: and every step before the first near tie
    matched), 1 --check found a divergence before it, 2 bad input.
    """
    from converter.drafts.host_loop import Runtime, coreml_backend, greedy, mil_backend
    from converter.errors import InputError

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
    checked = None
    if check:
        from parity.reference import NEAR_TIE, check_greedy

        reference = reference_steps(artifact, prompt_ids, len(result.new_ids))
        checked = check_greedy(result.new_ids, reference)
        doc["reference_ids"] = [token for token, _ in reference]
        doc["reference_gaps"] = [round(gap, 4) for _, gap in reference]
        doc["steps_matched"] = checked.matched
        doc["steps"] = checked.steps
        doc["first_near_tie"] = checked.first_near_tie
        doc["passed"] = checked.passed
    if as_json:
        click.echo(json.dumps(doc))
    else:
        click.echo(f"{prompt}{doc['text']}")
        if checked is not None:
            click.echo(
                f"steps matched against transformers fp32: {checked.matched} / {checked.steps}"
            )
            tie = checked.first_near_tie
            click.echo(
                f"no near tie (transformers' top-1 - top-2 logit < {NEAR_TIE}) in these steps"
                if tie is None
                else f"first near tie (transformers' top-1 - top-2 logit < {NEAR_TIE}): step {tie}"
            )
    if checked is not None and not checked.passed:
        raise SystemExit(1)
