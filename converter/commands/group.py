"""`AnecGroup`: the click group every `anec` command group is built from."""

from __future__ import annotations

from typing import Any

import click

from converter.errors import AnecError, report_error


class AnecGroup(click.Group):
    """A click group that turns AnecError from any subcommand into a clean exit."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; report AnecError without a traceback and exit with its code."""
        try:
            return super().invoke(ctx)
        except AnecError as e:
            report_error(e)
            ctx.exit(e.exit_code)
