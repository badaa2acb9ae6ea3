"""The ``anec convert`` command: recipes to proven Core ML artifacts."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("convert")
@click.argument("recipe_refs", metavar="RECIPE...", nargs=-1, required=True)
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
def convert_command(
    recipe_refs: tuple[str, ...],
    out_dir: Path | None,
    force: bool,
    allow_pickle: bool,
    as_json: bool,
) -> None:
    """Convert each RECIPE (a file or a shipped recipe name) into a proven Core ML artifact.

    Steps: check the inputs, load the checkpoint, rewrite it into BC1L, run the parity gates
    in torch (fp32 per layer, fp16 end to end), trace, convert to an fp16 ML Program and
    publish OUT/<name>/ atomically: <name>.mlpackage, manifest.json, parity.json,
    tokenizer.json, convert.log and, for host-side embeddings, embeddings.npy. A failed gate
    publishes nothing under the final name and keeps its reports in OUT/<name>.failed/.

    Several recipes are converted one after another; a failing one does not stop the rest.
    With --json, one JSON line per recipe.

    Exit codes (the highest over all recipes): 0 every recipe converted and passed, 1 a
    gate failed (parity, plan or a compressed variant's), 2 bad input, 3 internal error;
    130 / 143 interrupted by SIGINT / SIGTERM (nothing partial is left, a previous artifact
    stays as it was).
    """
    import signal

    from converter.batch import convert_recipes
    from converter.publish import signals_as_interrupts

    # SIGINT too, so a Ctrl-C during a publishing rename is deferred like SIGTERM.
    with signals_as_interrupts((signal.SIGINT, signal.SIGTERM)):
        code = convert_recipes(recipe_refs, out_dir, force, allow_pickle, as_json)
    if code:
        raise SystemExit(code)
