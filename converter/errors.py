"""Errors that the CLI turns into exit codes.

Exit codes: 0 converted and every gate passed, 1 a gate failed, 2 bad input. The error types
are defined in `graph_passes.errors` (every layer may raise them) and re-exported here.
"""

from __future__ import annotations

from graph_passes.errors import AnecError, GateFailure, InputError

__all__ = ["AnecError", "GateFailure", "InputError", "report_error"]


def report_error(error: AnecError) -> None:
    """Print an AnecError to stderr, one "error: " line per message line, without traceback."""
    import click

    for line in str(error).splitlines() or [type(error).__name__]:
        click.echo(f"error: {line}", err=True)
