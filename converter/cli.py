"""The `anec` command line.

Add a command with `@main.command()` (or a group with `@main.group(cls=AnecGroup)`). Commands
raise AnecError subclasses for expected failures; `AnecGroup` prints them without a traceback
and exits with their exit code, so commands need no error handling of their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from converter.cli_archs import archs_command
from converter.cli_generate import generate_command
from converter.cli_parity import parity_command
from converter.cli_speculate import speculate_command
from converter.errors import AnecError, InputError, report_error
from converter.plan.cli import plan_commands
from converter.recipe import Recipe, RecipeError, load_recipe, shipped_recipes


class AnecGroup(click.Group):
    """A click group that turns AnecError from any subcommand into a clean exit."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; report AnecError without a traceback and exit with its code."""
        try:
            return super().invoke(ctx)
        except AnecError as e:
            report_error(e)
            ctx.exit(e.exit_code)


@click.group(cls=AnecGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="anec", prog_name="anec")
@click.option(
    "--log",
    "log_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the libraries' log records and warnings (kept off the terminal; "
    "convert records them in each artifact's convert.log) to this file.",
)
@click.pass_context
def main(ctx: click.Context, log_file: Path | None) -> None:
    """Convert transformer checkpoints to Core ML packages for the Apple Neural Engine.

    Every conversion is described by a YAML recipe and proven by parity gates.
    Exit codes: 0 success, 1 a gate failed, 2 bad input; convert also 3 internal
    error and 130 / 143 when interrupted by SIGINT / SIGTERM.
    """
    from converter.runlog import route_library_output, write_session_log

    # Before any command imports coremltools or torch: their notes go to the log, not here.
    route_library_output()
    if log_file is not None:
        ctx.call_on_close(lambda: write_session_log(log_file))


@main.group(cls=AnecGroup)
def recipes() -> None:
    """Check recipe files and list the recipes shipped with anec."""


def _source_text(recipe: Recipe) -> str:
    src = recipe.source
    if src.kind == "python-package":
        return f"{src.package}/{src.file}"
    return f"{src.path}" + (f" ({src.file})" if src.file else "")


def _path_note(recipe: Recipe) -> str | None:
    """Why the checkpoint cannot be found here, if so; only `convert` requires it."""
    try:
        recipe.source.resolve(recipe.recipe_dir)
    except InputError as e:
        return f"{e} (checked again when converting)"
    return None


@recipes.command("validate")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {file, ok, errors}.")
def validate(files: tuple[Path, ...], as_json: bool) -> None:
    """Check recipe FILES against the schema and report every mistake with its line.

    Prints "ok: FILE (name, task, target)" for each valid file. A checkpoint that cannot be
    found on this machine is a note, not an error: it is only needed by `anec convert`.
    Exits with 2 when any file is invalid.
    """
    results: list[dict[str, Any]] = []
    for file in files:
        try:
            recipe = load_recipe(file)
        except RecipeError as e:
            errors = [
                {"line": i.line, "field": i.field, "message": i.message, "text": str(i)}
                for i in e.issues
            ]
            results.append({"file": str(file), "ok": False, "errors": errors, "notes": []})
            continue
        note = _path_note(recipe)
        results.append(
            {
                "file": str(file),
                "ok": True,
                "errors": [],
                "notes": [note] if note else [],
                "name": recipe.name,
                "task": recipe.task,
                "target": recipe.target,
            }
        )

    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["ok"]:
                click.echo(f"ok: {r['file']} ({r['name']}, {r['task']}, {r['target']})")
            for error in r["errors"]:
                click.echo(f"error: {error['text']}", err=True)
            for note in r["notes"]:
                click.echo(f"  note: {note}")
    if not all(r["ok"] for r in results):
        raise click.exceptions.Exit(InputError.exit_code)


def _summary(file: Path, recipe: Recipe) -> dict[str, Any]:
    return {
        "name": recipe.name,
        "task": recipe.task,
        "source": f"{recipe.source.kind}: {_source_text(recipe)}",
        "shapes": f"B={recipe.shapes.batch} L={recipe.shapes.sequence_length}",
        "target": recipe.target,
        "file": str(file),
    }


@recipes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def list_recipes(as_json: bool) -> None:
    """List the recipes shipped with anec: name, task, source, shapes and target.

    Pass a name from this list, or any recipe file, to the commands that take a recipe.
    """
    rows = [_summary(path, load_recipe(path)) for path in shipped_recipes()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="Shipped recipes")
    for column in ("name", "task", "source", "shapes", "target"):
        # Only the source (a path) may wrap; names are copied from here into commands.
        table.add_column(column, no_wrap=column != "source", overflow="fold")
    for row in rows:
        # Text(): recipe values are data, never rich markup.
        cells = (row[c] for c in ("name", "task", "source", "shapes", "target"))
        table.add_row(*(Text(c) for c in cells))
    Console(highlight=False).print(table)


@main.command("convert")
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


for _command in plan_commands():  # plan-inspect, bench-device, plan-baseline
    main.add_command(_command)
main.add_command(parity_command)  # anec parity ARTIFACT_DIR
main.add_command(archs_command)  # anec archs
main.add_command(generate_command)  # anec generate ARTIFACT --prompt TEXT
main.add_command(speculate_command)  # anec speculate --draft ARTIFACT [--target DIR] --k 1..8


if __name__ == "__main__":
    main()
