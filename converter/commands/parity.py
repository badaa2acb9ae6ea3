"""The ``anec parity`` command: re-run the parity gates on a published artifact."""

from __future__ import annotations

import json
from pathlib import Path

import click

from parity.mil.profiles import PROFILES


@click.command("parity")
@click.argument(
    "artifact", type=click.Path(path_type=Path, exists=True, file_okay=False, dir_okay=True)
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where to write parity.json, parity.txt and parity.html "
    "(default: ARTIFACT.parity beside the artifact; the artifact itself is not changed).",
)
@click.option(
    "--profile",
    "profiles",
    type=click.Choice(list(PROFILES)),
    multiple=True,
    help="MIL numeric profile(s) to run (default: fp32, fp16, fp16-acc, and device-margin "
    "when the recipe sets gates.device_margin_argmax_agreement; fp32 and fp16 are gated).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Allow pickle-based weights, loaded with torch.load(weights_only=True).",
)
@click.option(
    "--device-evidence",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="An anec device-check file of ARTIFACT: its Core ML gates join the report with "
    "their provenance; a file of another artifact exits 2.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the parity document as JSON.")
def parity_command(
    artifact: Path,
    out_dir: Path | None,
    profiles: tuple[str, ...],
    allow_pickle: bool,
    device_evidence: Path | None,
    as_json: bool,
) -> None:
    """Re-run every parity gate on ARTIFACT (a directory written by anec convert).

    The checkpoint named in the artifact's manifest is loaded (its hash must match), the BC1L
    module and the fixtures are rebuilt from the recorded recipe, and three levels are
    checked: the rewrite (torch fp32 and fp16 against the original model), the conversion
    (the saved package run by anec's MIL evaluator: fp32 per layer against the BC1L module,
    fp16 gated and fp16-acc reported against the original) and the Core ML runtime (macOS
    only; elsewhere marked "not run on this platform").

    Exit codes: 0 every gate passed, 1 a gate failed, 2 bad input.
    """
    from converter.evidence.recheck import recheck
    from converter.pipeline.progress import Steps

    with Steps(quiet=as_json) as steps:
        result = recheck(artifact, out_dir, profiles or None, allow_pickle, steps, device_evidence)
    if as_json:
        click.echo(json.dumps(result.document, sort_keys=True))
    else:
        click.echo(result.text)
        click.echo(f"reports: {result.report_dir}")
    if result.exit_code:
        raise SystemExit(result.exit_code)
