"""``anec convert RECIPE...``: convert several recipes, keep going past failures, one exit code.

Each recipe is converted on its own: bad input (exit 2) or a failed gate (exit 1) in one
does not stop the next. The process exits with the highest per-recipe code, so any failure
fails the CI job and bad input outranks a failed gate. An unexpected error (a bug) is
reported with its traceback and counts as exit code 3. An interruption (SIGINT, SIGTERM)
stops the whole run at once with 128 + the signal number: 130 or 143; recipes converted
before it stay published (each one atomically), the one in progress leaves nothing behind.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from converter.errors import AnecError

INTERNAL_ERROR = 3
_STATUS = {
    0: "converted",
    1: "a gate failed",  # the outcome names the kind when the conversion result says it
    2: "bad input",
    INTERNAL_ERROR: "internal error",
}


@dataclass
class Outcome:
    """How one recipe ended."""

    recipe: str  # as given on the command line
    name: str | None  # the recipe's name, once it was read
    exit_code: int
    summary: dict[str, Any] | None = None  # result_to_json of a conversion that ran to the end
    error: str | None = None
    failed_gate: str | None = None  # "parity", "MIL-level", "plan" or "variant"

    @property
    def status(self) -> str:
        """The exit code in words; for a failed gate, which kind failed where known."""
        if self.exit_code == 1 and self.failed_gate is not None:
            return f"{self.failed_gate} gate failed"
        return _STATUS[self.exit_code]

    def to_json(self) -> dict[str, Any]:
        """The per-recipe line of ``--json``: the conversion summary, or the error."""
        head = {
            "recipe": self.recipe,
            "name": self.name,
            "exit_code": self.exit_code,
            "status": self.status,
        }
        if self.summary is not None:
            return {**head, **self.summary}
        return {**head, "passed": False, "error": self.error}


def combined_exit_code(outcomes: list[Outcome]) -> int:
    """The highest per-recipe exit code (0 when every recipe converted and passed)."""
    return max((o.exit_code for o in outcomes), default=0)


def convert_recipes(
    refs: tuple[str, ...],
    out_dir: Path | None,
    force: bool,
    allow_pickle: bool,
    as_json: bool,
    flags: Mapping[str, Any] | None = None,
) -> int:
    """Convert every recipe (or checkpoint, with the recipe ``flags`` make for it:
    `converter.recipe.from_checkpoint`) in ``refs``, print a summary per recipe, return the combined
    code. Raises SystemExit(128 + signum) when interrupted.
    """
    outcomes = [_convert_one(ref, out_dir, force, allow_pickle, as_json, flags) for ref in refs]
    if len(outcomes) > 1 and not as_json:
        click.echo("\nrecipes:")
        for o in outcomes:
            click.echo(f"  {o.recipe} ({o.name or '?'}): {o.status} [{o.exit_code}]")
    return combined_exit_code(outcomes)


def _convert_one(
    ref: str,
    out_dir: Path | None,
    force: bool,
    allow_pickle: bool,
    as_json: bool,
    flags: Mapping[str, Any] | None,
) -> Outcome:
    from converter.errors import report_error
    from converter.pipeline.progress import Steps
    from converter.pipeline.publish import Interrupted
    from converter.pipeline.run import convert
    from converter.pipeline.runlog import RunLog
    from converter.pipeline.summary import failed_gate, print_summary, result_to_json
    from converter.recipe.from_checkpoint import recipe_for

    outcome = Outcome(ref, None, INTERNAL_ERROR)
    with RunLog(ref):
        try:
            recipe = recipe_for(ref, flags or {})
            outcome.name = recipe.name
            with Steps(quiet=as_json) as steps:
                result = convert(recipe, out_dir, force, allow_pickle, steps)
        except (Interrupted, KeyboardInterrupt) as e:
            code = getattr(e, "exit_code", 130)  # KeyboardInterrupt: SIGINT
            click.echo(f"error: {ref}: interrupted; nothing was published for it", err=True)
            raise SystemExit(code) from None
        except AnecError as e:
            report_error(e)
            outcome.exit_code, outcome.error = e.exit_code, str(e)
        except Exception as e:
            # A bug, not bad input: keep the traceback for the report, go on with the rest.
            click.echo(f"error: {ref}: internal error (a bug in anec or a library):", err=True)
            click.echo(traceback.format_exc().rstrip(), err=True)
            outcome.error = f"internal error: {type(e).__name__}: {e}"
        else:
            outcome.exit_code, outcome.summary = result.exit_code, result_to_json(result)
            outcome.failed_gate = failed_gate(result)
            if not as_json:
                print_summary(result, Console(highlight=False))
    if as_json:
        click.echo(json.dumps(outcome.to_json()))
    return outcome
