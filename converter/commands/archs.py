"""The ``anec archs`` command: the registered architectures, their tasks and their refusals."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text


@click.command("archs")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def archs_command(as_json: bool) -> None:
    """List the architectures anec converts: model types, Hugging Face classes, tasks, and the
    config features each refuses (an error naming the key, never a different model)."""
    # Imported here: the registry imports torch, which `anec --help` should not wait for.
    from graph_passes.archs import architectures

    rows = [
        {
            "name": a.name,
            "family": a.family,
            "model_types": list(a.model_types),
            "classes": list(a.classes),
            "tasks": list(a.tasks),
            "refuses": list(a.refuses),
        }
        for a in architectures()
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="Architectures")
    for column in ("name", "model_type", "classes", "tasks", "refuses"):
        table.add_column(column, overflow="fold")
    for row in rows:
        cells = (
            row["name"],
            ", ".join(row["model_types"]),
            "\n".join(row["classes"]),
            "\n".join(row["tasks"]),
            "\n".join(row["refuses"]),
        )
        table.add_row(*(Text(str(c)) for c in cells))
    Console(highlight=False).print(table)
