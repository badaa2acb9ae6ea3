"""The ``anec recipes`` group: ``validate`` recipe files, ``list`` the shipped ones, ``new``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from converter.commands.checkpoint_flags import checkpoint_options
from converter.commands.group import AnecGroup
from converter.errors import InputError
from converter.recipe import Recipe, RecipeError, load_recipe, shipped_recipes


@click.group("recipes", cls=AnecGroup)
def recipes_group() -> None:
    """Check recipe files, list the recipes shipped with anec, make one from a checkpoint."""


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


@recipes_group.command("validate")
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


@recipes_group.command("list")
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


@recipes_group.command("new")
@click.argument("checkpoint")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Where to write the recipe (default: NAME.yaml here; '-' prints it).",
)
@click.option("--force", is_flag=True, help="Replace an existing file.")
@checkpoint_options
def new_recipe(checkpoint: str, output: Path | None, force: bool, **flags: Any) -> None:
    """Write the recipe `anec convert CHECKPOINT [flags]` would use, commented, to edit.

    CHECKPOINT is a Hugging Face directory, a .gguf file or pkg:PACKAGE[/FILE] (see `anec
    convert --help`); the flags are convert's. Each choice read from the checkpoint is
    explained in a comment above its key. Exits 2 when a choice cannot be made (naming the
    flag to pass) or the file exists (without --force).
    """
    from converter.pipeline.fsops import write_text_atomic
    from converter.recipe.from_checkpoint import flags_text, make_recipe
    from converter.recipe.refs import CheckpointRef, parse_ref
    from converter.recipe.writer import recipe_data, recipe_yaml

    ref = parse_ref(checkpoint)
    if not isinstance(ref, CheckpointRef):
        raise InputError(f"{checkpoint}: a recipe, not a checkpoint; copy it to edit it")
    made = make_recipe(ref, flags)
    command = " ".join(["anec recipes new", checkpoint, flags_text(flags)]).strip()
    header = [
        f"Made by `{command}` from the checkpoint and the schema's defaults.",
        "Edit it, check it with `anec recipes validate FILE`, convert it with `anec convert FILE`.",
        "",
    ]
    text = recipe_yaml(recipe_data(made.recipe), header, made.notes)
    if output is not None and str(output) == "-":
        click.echo(text, nl=False)
        return
    file = output or Path(f"{made.recipe.name}.yaml")
    if file.exists() and not force:
        raise InputError(f"{file}: exists; pass --force to replace it or -o to name another file")
    write_text_atomic(file, text)
    click.echo(f"wrote {file} ({made.recipe.name}, {made.recipe.task}, {made.recipe.target})")
