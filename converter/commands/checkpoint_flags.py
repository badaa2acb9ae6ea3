"""The flags that make a recipe from a checkpoint, as click options
(`converter.recipe.from_checkpoint`
maps each to its recipe field); shared by ``anec convert`` and ``anec recipes new``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from converter.recipe.from_checkpoint import FLAGS

F = TypeVar("F", bound=Callable[..., Any])


def checkpoint_options(command: F) -> F:
    """Add every `FLAGS` option to ``command`` (in table order in its help)."""
    for flag in reversed(FLAGS):
        kind: Any = click.Choice(flag.choices) if flag.choices else flag.kind
        if flag.kind is int:
            kind = click.IntRange(min=1)
        command = click.option(
            flag.option, flag.dest, type=kind, multiple=flag.multiple, help=flag.help
        )(command)
    return command
