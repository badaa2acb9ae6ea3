"""The plan commands: ``anec plan-inspect``, ``anec bench-device``, ``anec plan-baseline``.

Registered on the ``anec`` group by ``converter/commands/__init__.py`` through ``plan_commands()``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from converter.errors import GateFailure, InputError
from converter.placement.chips import CHIPS, STRICTEST
from converter.placement.rules import COMPUTE_UNITS, ComputeUnits

_PATH = click.Path(path_type=Path)


def _single_package(path: Path) -> Path:
    from converter.placement.inspect import find_packages

    found = find_packages(path)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise InputError(f"{path} holds several packages ({names}); name one .mlpackage")
    return found[0]


@click.command("plan-inspect")
@click.argument("path", required=False, type=_PATH)
@click.option(
    "--chip",
    default=STRICTEST,
    show_default=True,
    help=f"Chip for the per-op static table ({', '.join(CHIPS)}); every chip is summarised.",
)
@click.option(
    "--compute-units",
    type=click.Choice(COMPUTE_UNITS),
    default="CPU_AND_NE",
    show_default=True,
    help="Compute units the prediction (and the recorded plan shown) is for.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.option("--html", "html_file", type=_PATH, help="Also write a self-contained HTML report.")
@click.option("--no-ops", is_flag=True, help="Omit the per-op table from the terminal output.")
@click.option(
    "--from-plan",
    "plan_file",
    type=_PATH,
    help="Read a recorded compute-plan dump (any platform) and compare it with the static "
    "prediction op by op.",
)
@click.option(
    "--dump",
    "dump_file",
    type=_PATH,
    help="macOS 14.4+: compile, read MLComputePlan (ALL, CPU_AND_NE, CPU_AND_GPU, every "
    "function) and write it as JSON keyed by the package's content hash.",
)
@click.option(
    "--observed",
    "observed_file",
    type=_PATH,
    help="A bench-device result for this package to show beside the predictions.",
)
@click.option(
    "--compare",
    nargs=2,
    type=_PATH,
    default=None,
    help="Show two packages side by side (e.g. an anec artifact and its naive baseline).",
)
@click.option(
    "--gate-ne-flop-share",
    type=click.FloatRange(0, 1),
    help="Exit 1 unless the NE FLOP share reaches this (on the recorded plan if given, else "
    "on the static prediction for --chip).",
)
@click.option(
    "--gate-max-ne-segments",
    type=click.IntRange(min=1),
    help="Exit 1 if any function has more NE segments than this.",
)
def plan_inspect(
    path: Path | None,
    chip: str,
    compute_units: ComputeUnits,
    as_json: bool,
    html_file: Path | None,
    no_ops: bool,
    plan_file: Path | None,
    dump_file: Path | None,
    observed_file: Path | None,
    compare: tuple[Path, Path] | None,
    gate_ne_flop_share: float | None,
    gate_max_ne_segments: int | None,
) -> None:
    """Where every op of PATH (an .mlpackage or an artifact directory) will run.

    Prints each op (type, name, output shape, dtype, FLOPs, weight bytes) with the device it
    will prefer, the rule that decided it and the rule's confidence; a summary (NE shares of
    ops, FLOPs and weight bytes, transitions, NE segments, per-layer residency); every op that
    breaks NE residency with its reason and what to change; and a predicted floor per chip.

    Evidence labels: static (anec's rules, uncalibrated until a real compute-plan dump of an
    anec artifact has been compared), compute-plan (MLComputePlan, from --dump on a Mac or
    --from-plan anywhere), predicted (the cost model), observed (bench-device results).

    Exit codes: 0 ok, 1 a --gate-... failed, 2 bad input.
    """
    from converter.placement.chips import chip as find_chip
    from converter.placement.compare import compare as compare_items
    from converter.placement.inspect import find_packages, inspect_package

    find_chip(chip)  # an unknown chip is bad input before any work
    if compare is not None:
        if path is not None or plan_file or dump_file or observed_file:
            raise InputError("--compare A B takes no PATH, --from-plan, --dump or --observed")
        items = [inspect_package(_single_package(p), chip, compute_units) for p in compare]
        comparison: dict[str, Any] | None = compare_items(items[0], items[1])
    else:
        if path is None:
            raise InputError(
                "give a PATH (an .mlpackage or an artifact directory) or --compare A B"
            )
        packages = find_packages(path)
        if (plan_file or dump_file or observed_file) and len(packages) > 1:
            raise InputError(f"{path} holds several packages; name one .mlpackage")
        recorded = _record(packages[0], dump_file) if dump_file else None
        items = [
            inspect_package(p, chip, compute_units, recorded, plan_file, observed_file)
            for p in packages
        ]
        comparison = None

    gates = []
    for item in items:
        report = item.compute_plan or item.static
        from converter.placement.residency import check_plan_gates

        gates += check_plan_gates(report, gate_ne_flop_share, gate_max_ne_segments)

    if html_file is not None:
        from converter.pipeline.publish import write_text_atomic
        from converter.placement.render_html import render_html

        write_text_atomic(html_file, render_html(items, comparison))
    if as_json:
        doc = {
            "tool": "anec plan-inspect",
            "packages": [i.to_json() for i in items],
            "comparison": comparison,
            "gates": [g.to_json() for g in gates],
        }
        click.echo(json.dumps(doc, indent=1))
    else:
        _print(items, comparison, gates, no_ops, html_file)
    failed = [g for g in gates if not g.passed]
    if failed:
        raise GateFailure("\n".join(g.text() for g in failed))


def _record(package: Path, dump_file: Path) -> Any:
    """Read the package's compute plans on this Mac and write them to ``dump_file``."""
    from converter.pipeline.hashing import mlpackage_content_hash
    from converter.placement.computeplan import read_plans
    from converter.placement.dump import RecordedPlan, recording_metadata, write_dump

    plans = read_plans(package, ["ALL", "CPU_AND_NE", "CPU_AND_GPU"])
    recorded = RecordedPlan(
        content_sha256=mlpackage_content_hash(package),
        package=package.name,
        recorded=recording_metadata(),
        plans=plans,
    )
    write_dump(dump_file, recorded)
    return recorded


def _print(
    items: list[Any],
    comparison: dict[str, Any] | None,
    gates: list[Any],
    no_ops: bool,
    html_file: Path | None,
) -> None:
    from rich.table import Table
    from rich.text import Text

    from converter.placement.compare import difference
    from converter.placement.render_text import print_inspected

    console = Console(highlight=False)
    if not console.is_terminal:
        # Piped or captured: wide enough that op names stay whole and greppable.
        console = Console(highlight=False, width=160)
    for item in items:
        print_inspected(item, console, show_ops=not no_ops and comparison is None)
    if comparison is not None:
        table = Table(title="side by side", header_style="bold")
        for c in ("figure", "evidence", "A", "B", "B - A"):
            table.add_column(c, overflow="fold")
        for m in comparison["metrics"]:
            cells = [m["name"], m["evidence"], _fmt(m["a"]), _fmt(m["b"]), difference(m)]
            table.add_row(*(Text(c) for c in cells))
        console.print(Text(f"A = {comparison['a']}\nB = {comparison['b']}"))
        console.print(table)
        console.print(Text(f"floors: {comparison['predicted_note']}", style="dim"))
    for g in gates:
        console.print(Text(g.text(), style="green" if g.passed else "red"))
    if html_file is not None:
        console.print(Text(f"html: {html_file}"))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


@click.command("bench-device")
@click.argument("artifact", type=_PATH)
@click.option("--out", "out_file", type=_PATH, required=True, help="Where to write the JSON.")
@click.option("--runs", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option(
    "--units",
    type=click.Choice(COMPUTE_UNITS),
    multiple=True,
    default=("CPU_ONLY", "CPU_AND_NE"),
    show_default=True,
    help="Compute units to load the package with (repeat the option).",
)
@click.option(
    "--power/--no-power",
    default=True,
    show_default=True,
    help="Sample 'ANE Power' with sudo -n powermetrics while the NE runs (where permitted).",
)
@click.option(
    "--energy",
    is_flag=True,
    help="Record energy per decision against --baseline (see anec energy-report).",
)
@click.option(
    "--baseline",
    type=_PATH,
    default=None,
    help="--energy: the baseline package or artifact (run with CPU_AND_GPU).",
)
@click.option(
    "--blocks",
    type=click.IntRange(min=5),
    default=5,
    show_default=True,
    help="--energy: sustained blocks per arm, alternating baseline and candidate.",
)
@click.option(
    "--block-seconds",
    type=click.FloatRange(min=1.0),
    default=20.0,
    show_default=True,
    help="--energy: length of each sustained block.",
)
@click.option(
    "--extend-drift",
    is_flag=True,
    help="A cached decoder: its K-token extend against K single-token decodes on the fixture "
    "prompts' greedy continuations, per --units (the kv_extend_argmax_flips gate; the "
    "difference reported).",
)
@click.option(
    "--steps",
    type=click.IntRange(1, 4096),
    default=64,
    show_default=True,
    help="--extend-drift: greedy tokens decoded after each prompt.",
)
@click.option(
    "--backend",
    type=click.Choice(["coreml", "mil"]),
    default="coreml",
    show_default=True,
    help="--extend-drift: coreml (the device, macOS) or mil (anec's MIL evaluator, fp16 "
    "profile: the gate's own run, for comparison).",
)
@click.option(
    "--tick-hz",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="--energy: equal offered load at this decision rate (default: saturated).",
)
def bench_device(
    artifact: Path,
    out_file: Path,
    runs: int,
    warmup: int,
    units: tuple[str, ...],
    power: bool,
    energy: bool,
    baseline: Path | None,
    blocks: int,
    block_seconds: float,
    tick_hz: float | None,
    extend_drift: bool,
    steps: int,
    backend: str,
) -> None:
    """Measure prediction latency (and NE power) of ARTIFACT on this Mac (evidence: observed).

    Loads the package once per compute units, runs warm-up predictions with fp16 inputs,
    then times repeated predictions: median, p10/p90, IQR, min, max. Writes a JSON that
    `anec plan-inspect --observed FILE` reads. Needs macOS; it has never run on the Linux
    machines anec is developed on, so treat its first results with care.

    With --energy: energy per decision of ARTIFACT against --baseline in alternating
    sustained blocks, power from powermetrics (CPU + GPU + ANE); `anec energy-report FILE`
    analyses the result (also never run on a Mac yet).

    With --extend-drift (ARTIFACT a cached decoder's directory): the K-token extend against
    K single-token decode steps through Core ML per compute units, judged like the
    kv_extend_* gates; exit 1 when a unit fails them. The Core ML path has never run on a
    Mac; --backend mil runs the same loop in the MIL evaluator.
    """
    from converter.pipeline.publish import write_json_atomic
    from converter.placement.device_bench import bench_package

    if extend_drift:
        from converter.placement.extend_drift import record_drift

        doc = record_drift(artifact, units, steps, backend)
        write_json_atomic(out_file, doc)
        click.echo(f"wrote {out_file}")
        for unit, row in doc["results"].items():
            gates = ", ".join(f"{g['name']} {g['value']:.4g}" for g in row["gates"])
            click.echo(f"{unit}: {'passed' if row['passed'] else 'FAILED'} ({gates})")
        if not all(row["passed"] for row in doc["results"].values()):
            raise SystemExit(1)
        return
    package = _single_package(artifact)
    if energy:
        from converter.placement.energy_run import record_energy

        if baseline is None:
            raise click.UsageError("--energy needs --baseline")
        doc = record_energy(package, _single_package(baseline), blocks, block_seconds, tick_hz)
        write_json_atomic(out_file, doc)
        click.echo(f"wrote {out_file}")
        return
    doc = bench_package(package, runs, warmup, units, power)
    write_json_atomic(out_file, doc)
    click.echo(f"wrote {out_file}")


@click.command("plan-baseline")
@click.argument("recipe_ref", metavar="RECIPE")
@click.option("--out", "out_dir", type=_PATH, default=None, help="Output directory.")
@click.option("--force", is_flag=True, help="Replace an existing baseline.")
def plan_baseline(recipe_ref: str, out_dir: Path | None, force: bool) -> None:
    """Convert RECIPE's checkpoint naively, without the BC1L rewrite, for --compare.

    Writes OUT/<name>-naive/: a (B, L, C) port with nn.Linear, heads batched (B, H, L, d),
    softmax on the last axis and one vocabulary-wide LM head, converted to fp16 like anec's
    own module. No parity gate runs on it: it is a baseline, not an artifact.
    """
    from converter.placement.baseline import build_baseline
    from converter.recipe import load_recipe, locate_recipe

    recipe = load_recipe(locate_recipe(recipe_ref))
    path = build_baseline(recipe, out_dir or recipe.output_dir, force)
    click.echo(f"baseline: {path}")


@click.command("energy-report")
@click.argument("run_file", metavar="FILE", type=_PATH)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def energy_report_command(run_file: Path, as_json: bool) -> None:
    """Energy per decision from a recorded `bench-device --energy` FILE: t, P, E = P x t (raw
    and idle-subtracted), S, R and S x R with 95 % bootstrap intervals over the paired
    blocks, P50/P95 latency, missed deadlines; an N-fold claim only when the interval's lower
    bound reaches N."""
    import json

    from converter.placement.energy import read_energy
    from converter.placement.energy_report import energy_report, report_text

    doc = energy_report(read_energy(run_file))
    click.echo(json.dumps(doc, indent=2) if as_json else report_text(doc))


def plan_commands() -> list[click.Command]:
    """The commands this package adds to ``anec``."""
    return [plan_inspect, bench_device, plan_baseline, energy_report_command]
