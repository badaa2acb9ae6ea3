"""Which fixture positions' argmax flips under the per-op deviations others report for the NE.

    python bench/device_margin.py RECIPE [--artifact DIR] [--out DIR]

Issue 23, item 3. Converts RECIPE with ``anec convert`` into ``--out`` (default a temporary
folder), or takes an already converted ``--artifact`` (the recipe's own folder), rebuilds the
module, fixtures and reference runs as the conversion does, and runs the emitted program under
the ``device-margin`` profile (`parity.mil.deviations`) once with each deviation alone and
once with all of them, every time once per seed (worst seed per position), beside the fp16
and fp16-acc profiles. Prints the ops of each deviated type in the program and how many were
perturbed, then per deviation set the positions flipped and the largest |dp| growth over fp16
and over fp16-acc (the same assumptions without the deviations: the deviations' own share),
and a table of every position whose argmax flips under some set.

Every deviation is a figure *reported by* its source (the table names it), not a measurement
of a chip; the flips say what the program's margins survive if the NE is as far off as reported.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from converter.checkpoints.loading import load_checkpoint
from converter.evidence.recheck import read_manifest
from converter.recipe import DecoderRecipe
from converter.recipe.loader import load_recipe
from converter.tasks.text_generation import reference_runs, rewrite_decoder, thresholds
from parity.conversion import check_conversion
from parity.device_margin import IMPLEMENTATION, DeviceMargin, MarginRow, program_op_counts
from parity.mil import load_package
from parity.mil.deviations import DEVIATIONS, SEEDS
from parity.mil.profiles import DEVICE_MARGIN, Profile
from parity.torch_settings import parity_torch


def convert(recipe: Path, out: Path) -> Path:
    """``anec convert RECIPE --out OUT`` in this process; the artifact's folder."""
    from converter.commands import main

    try:
        main.main(["convert", str(recipe), "--out", str(out)], standalone_mode=False)
    except SystemExit as e:  # the CLI's exit code: a failed gate still leaves its reports
        if e.code:
            raise
    return out / load_recipe(recipe).name


def deviation_sets(present: set[str]) -> list[tuple[str, Profile]]:
    """Each deviation whose op type is in the program (``present``) alone, then all of them
    (none when the program has no op of any deviated type: every run would be fp16-acc's)."""
    held = [d for d in DEVIATIONS if d.op_type in present]
    sets = [(d.name, replace(DEVICE_MARGIN, deviations=(d,))) for d in held]
    return [*sets, ("all together", DEVICE_MARGIN)] if held else []


def op_counts(package: Path) -> dict[str, int]:
    """How many ops of each deviated type the package's main function holds."""
    return program_op_counts(load_package(package).functions["main"], DEVIATIONS)


def run_sets(recipe: DecoderRecipe, package: Path, present: set[str]) -> dict[str, DeviceMargin]:
    """The device-margin findings of every deviation set on ``package``."""
    sets = deviation_sets(present)
    if not sets:
        return {}
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    rw = rewrite_decoder(recipe, ckpt)
    references = reference_runs(ckpt, rw)
    found: dict[str, DeviceMargin] = {}
    for label, profile in sets:
        start = time.perf_counter()
        report = check_conversion(
            package, rw.module, rw.batches, references, rw.embed_table, thresholds(recipe),
            recipe.precision, ("fp16", "fp16-acc", profile),
        )  # fmt: skip
        run = next(r for r in report.runs if r.implementation == IMPLEMENTATION)
        assert run.device_margin is not None
        found[label] = run.device_margin
        seconds = time.perf_counter() - start
        print(f"  ({label}: {seconds:.0f} s for fp16, fp16-acc and {len(SEEDS)} seeds)")
    return found


def print_tables(found: dict[str, DeviceMargin], counts: dict[str, int]) -> None:
    """The op counts, one summary line per deviation set, and the flipped positions."""
    for d in DEVIATIONS:
        print(f"  {d.name}: +-{d.bound:g} absolute, {d.evidence} ({d.reading})")
    listed = ", ".join(f"{n} {t} ops" for t, n in counts.items())
    if not found:
        print(f"program: {listed}: no deviation applies, nothing to run (fp16-acc's figures)")
        return
    every = found["all together"]
    print(f"program: {listed}; perturbed under all deviations: {len(every.perturbed_ops)}")
    print(f"seeds {', '.join(map(str, SEEDS))}; worst seed per position")
    acc = every.rows
    worst_acc = max(acc, key=lambda r: r.acc_abs_dprob - r.fp16_abs_dprob)
    print(
        f"fp16-acc alone (no deviations): max |dp| growth over fp16 "
        f"{worst_acc.acc_abs_dprob - worst_acc.fp16_abs_dprob:.3g} at "
        f"{worst_acc.fixture}@{worst_acc.position}"
    )
    print(f"{'deviations':<16} {'ops':>4} {'flipped':>9}  {'max |dp| growth over fp16':<36}"
          "over fp16-acc (the deviations' own)")  # fmt: skip
    for label, f in found.items():
        top, own = f.max_growth, f.max_deviation_growth
        growth = f"{top.dprob_growth:.3g} at {top.fixture}@{top.position}" if top else "n/a"
        mine = f"{own.deviation_growth:.3g} at {own.fixture}@{own.position}" if own else "n/a"
        flipped = f"{len(f.flipped)}/{len(f.rows)}"
        print(f"{label:<16} {len(f.perturbed_ops):>4} {flipped:>9}  {growth:<36}{mine}")
    keys = sorted({(r.fixture, r.position) for f in found.values() for r in f.flipped})
    if not keys:
        print("no position's argmax flips under any deviation set")
        return
    labels = list(found)
    print("position".ljust(40) + "margin  fp16|dp|  " + "  ".join(f"{lb:>16}" for lb in labels))
    for key in keys:
        rows = [_row(found[lb], key) for lb in labels]
        cells = [f"flips (seed {r.worst_seed})" if not r.argmax_kept else "kept" for r in rows]
        name = f"{key[0]}@{key[1]}"[:39]
        print(f"{name:<40}{rows[0].margin:>6.3f}  {rows[0].fp16_abs_dprob:>8.3g}  "
              + "  ".join(f"{c:>16}" for c in cells))  # fmt: skip


def _row(found: DeviceMargin, key: tuple[str, int]) -> MarginRow:
    """The row of ``found`` at (fixture, position) ``key``."""
    return next(r for r in found.rows if (r.fixture, r.position) == key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--artifact", type=Path, help="a converted artifact of RECIPE")
    parser.add_argument("--out", type=Path, help="where to convert (default: a temp folder)")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    if not isinstance(recipe, DecoderRecipe):
        raise SystemExit(f"{args.recipe}: a text-generation recipe is needed")
    with tempfile.TemporaryDirectory() as scratch:
        artifact = args.artifact or convert(args.recipe, args.out or Path(scratch))
        package = artifact / read_manifest(artifact).package.file
        counts = op_counts(package)
        with parity_torch():
            found = run_sets(recipe, package, {t for t, n in counts.items() if n})
    print(f"{recipe.name}: {package.name}")
    print_tables(found, counts)


if __name__ == "__main__":
    main()
