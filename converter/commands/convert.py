"""The ``anec convert`` command: recipes to proven Core ML artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from converter.commands.checkpoint_flags import checkpoint_options


@click.command("convert")
@click.argument("recipe_refs", metavar="RECIPE|CHECKPOINT...", nargs=-1, required=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Output directory (default: the recipe's output_dir, normally artifacts/).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing artifact (atomically, only once the new one passed).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Allow pickle-based weights, loaded with torch.load(weights_only=True).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON summary per recipe instead of tables."
)
@checkpoint_options
def convert_command(
    recipe_refs: tuple[str, ...],
    out_dir: Path | None,
    force: bool,
    allow_pickle: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Convert each RECIPE or CHECKPOINT into a proven Core ML artifact.

    \b
    Each argument is, in this order:
      recipe:NAME         the shipped recipe NAME (anec recipes list)
      pkg:PACKAGE[/FILE]  a checkpoint in an installed Python package (import name); FILE
                          (a .gguf file or a folder) when it holds more than one
      a directory         a Hugging Face checkpoint (config.json, weights, tokenizer)
      a .gguf file        a GGUF checkpoint
      another file        a recipe file
      NAME                a shipped recipe, when no such path exists
    A path that is also a shipped recipe's name is an error: write ./NAME or recipe:NAME.

    A checkpoint is converted with a recipe made from it: the flags below set their fields,
    the rest is read from the checkpoint (task, inputs from tied embeddings, LM-head chunks
    from the vocabulary, fixtures from anec's fixture text and its tokenizer) or the schema's
    defaults; a choice anec cannot make exits 2 naming the flag. The flags apply to
    checkpoints only. Every artifact holds its recipe as recipe.yaml; `anec recipes new
    CHECKPOINT` writes one to edit.

    Steps: check the inputs, load the checkpoint, rewrite it into BC1L, run the parity gates
    in torch (fp32 per layer, fp16 end to end), trace, convert to an fp16 ML Program and
    publish OUT/<name>/ atomically: <name>.mlpackage, manifest.json, parity.json,
    recipe.yaml, tokenizer.json, convert.log and, for host-side embeddings, embeddings.npy.
    A failed gate publishes nothing under the final name and keeps its reports in
    OUT/<name>.failed/.

    Several recipes are converted one after another; a failing one does not stop the rest.
    With --json, one JSON line per recipe.

    Exit codes (the highest over all recipes): 0 every recipe converted and passed, 1 a
    gate failed (parity, plan or a compressed variant's), 2 bad input, 3 internal error;
    130 / 143 interrupted by SIGINT / SIGTERM (nothing partial is left, a previous artifact
    stays as it was).
    """
    import signal

    from converter.commands.batch import convert_recipes
    from converter.pipeline.publish import signals_as_interrupts

    # SIGINT too, so a Ctrl-C during a publishing rename is deferred like SIGTERM.
    with signals_as_interrupts((signal.SIGINT, signal.SIGTERM)):
        code = convert_recipes(recipe_refs, out_dir, force, allow_pickle, as_json, flags)
    if code:
        raise SystemExit(code)
