"""The `anec` command line: the top-level group `main`, one module per command group.

Add a command as a click command in its own module of this package and register it below
(`main.add_command`); a group uses `AnecGroup` (converter/commands/group.py). Commands raise
AnecError subclasses for expected failures; `AnecGroup` prints them without a traceback and
exits with their exit code, so commands need no error handling of their own.
"""

from __future__ import annotations

from pathlib import Path

import click

from converter.commands.archs import archs_command
from converter.commands.convert import convert_command
from converter.commands.device_check import device_check_command
from converter.commands.generate import generate_command
from converter.commands.group import AnecGroup
from converter.commands.parity import parity_command
from converter.commands.plan import plan_commands
from converter.commands.recipes import recipes_group
from converter.commands.speculate import speculate_command

__all__ = ["AnecGroup", "main"]


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
    from converter.pipeline.runlog import route_library_output, write_session_log

    # Before any command imports coremltools or torch: their notes go to the log, not here.
    route_library_output()
    if log_file is not None:
        ctx.call_on_close(lambda: write_session_log(log_file))


main.add_command(recipes_group)  # anec recipes validate|list
main.add_command(convert_command)  # anec convert RECIPE...
for _command in plan_commands():  # plan-inspect, bench-device, plan-baseline, energy-report
    main.add_command(_command)
main.add_command(parity_command)  # anec parity ARTIFACT_DIR
main.add_command(archs_command)  # anec archs
main.add_command(generate_command)  # anec generate ARTIFACT --prompt TEXT
main.add_command(speculate_command)  # anec speculate --draft ARTIFACT [--target DIR] --k 1..8
main.add_command(device_check_command)  # anec device-check ARTIFACT (macOS)
