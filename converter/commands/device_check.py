"""The ``anec device-check`` command: an artifact's gates run by Core ML on this Mac."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from converter.coreml.runtime import UNITS

if TYPE_CHECKING:
    from converter.device.evidence_file import Adapters


def mac_adapters() -> Adapters:
    """Core ML's loader, the memory probe, the compute-plan reader and where this runs;
    InputError off macOS (the tests replace this function with stand-ins)."""
    from converter.errors import InputError

    if platform.system() != "Darwin":
        raise InputError(
            f"anec device-check runs Core ML, which needs macOS (this is {platform.system()}); "
            "anec parity and anec generate --backend mil run the program here"
        )
    from converter.coreml.runtime import coreml_loader, memory_now  # pragma: no cover
    from converter.device.evidence_file import Adapters  # pragma: no cover
    from converter.placement.computeplan import read_plans  # pragma: no cover
    from converter.placement.dump import recording_metadata  # pragma: no cover

    def plans(package: Path, units: list[str]) -> Any:  # pragma: no cover
        return read_plans(package, units)  # type: ignore[arg-type]

    return Adapters(coreml_loader, memory_now, plans, recording_metadata())  # pragma: no cover


@click.command("device-check")
@click.argument(
    "artifact", type=click.Path(path_type=Path, exists=True, file_okay=False, dir_okay=True)
)
@click.option(
    "--units",
    type=click.Choice(UNITS),
    multiple=True,
    help="Compute units to run under, repeatable (default: CPU_ONLY and CPU_AND_NE).",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The evidence file (default: ARTIFACT.device-check.json beside the artifact).",
)
@click.option("--no-memory", is_flag=True, help="Skip the per-function memory census.")
@click.option("--json", "as_json", is_flag=True, help="Print the evidence document as JSON.")
def device_check_command(
    artifact: Path, units: tuple[str, ...], out_file: Path | None, no_memory: bool, as_json: bool
) -> None:
    """Run ARTIFACT's gates through Core ML on this Mac, once per compute-units setting, and
    write one evidence file: a cached decoder's cache gates (recipe cache.style state or io),
    a window decoder's output gates (argmax agreement, |dp|, finite), an encoder's (cosine, or
    a classifier's argmax and |dp|), a decision model's decision gates.

    Each gate is also run on the program in anec's MIL evaluator (fp16), so a failure says
    whether it comes from the program or the device. The gates' own calls give each
    function's latency; first loads are timed apart; each package's compute plan gives every
    op's preferred device; memory is read with each function loaded alone and all together.
    `anec plan-inspect --observed FILE` and `anec parity --device-evidence FILE` read the
    file.

    Exit codes: 0 every gate passed under every units setting, 1 a gate failed, 2 bad input
    (not macOS, a compressed variant, a package that differs from its manifest hash).
    """
    from converter.device.dispatch import DEFAULT_UNITS, device_check
    from converter.pipeline.progress import Steps
    from converter.pipeline.publish import write_json_atomic

    mac = mac_adapters()
    with Steps(quiet=as_json) as steps:
        evidence = device_check(artifact, units or DEFAULT_UNITS, mac, not no_memory, steps)
    doc = evidence.to_json()
    target = out_file or artifact.parent / f"{artifact.name}.device-check.json"
    write_json_atomic(target, doc)
    click.echo(json.dumps(doc, sort_keys=True) if as_json else evidence.text())
    if not as_json:
        click.echo(f"evidence: {target}")
    if not evidence.passed:
        raise SystemExit(1)
