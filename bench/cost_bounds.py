"""Old and new predicted floors per weight format and chip (issue 25 item 3; a model, not a
measurement).

    python bench/cost_bounds.py                  # the anemll-bench LM head, every chip
    python bench/cost_bounds.py --rows 4096 --cols 4096

The workload is one NE op reading a (rows x cols) weight once per call: by default anemll-bench's
``llama_lm_head`` (128256 x 4096, one token), whose fp16 and LUT6 timings are the sources of
the M4 and M4 Max figures in ``converter/placement/chips.py``. "old" is the floor before the weight-
decode bound: max(FLOPs / peak, stored bytes / bandwidth) plus copies and one dispatch. "new"
is ``converter.placement.cost`` as it stands: the third bound on chips with a measured rate, LUT
granularity's relative cost and padded index widths where the chip pads. Both come from the
code; nothing here is measured. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from converter.placement.chips import Chip, cost_chips  # noqa: E402
from converter.placement.cost import Work, floor_of_work, with_decoded  # noqa: E402
from converter.placement.decode import (  # noqa: E402
    DecodedWeight,
    granularity_cost,
    relative_costs_json,
)

# (label, kind, index bits, output channels per palette; None: one palette per tensor)
VARIANTS: list[tuple[str, str, int, int | None]] = [
    ("fp16", "fp16", 16, None),
    ("int8 per channel", "int8", 8, None),
    ("LUT4 per tensor", "lut", 4, None),
    ("LUT4 group 32", "lut", 4, 32),
    ("LUT4 group 8", "lut", 4, 8),
    ("LUT4 group 2", "lut", 4, 2),
    ("LUT4 per channel", "lut", 4, 1),
    ("LUT3 per tensor", "lut", 3, None),
    ("LUT6 per tensor", "lut", 6, None),
    ("LUT8 per tensor", "lut", 8, None),
]
_BOUND = {"compute": "c", "weights": "w", "weight-decode": "d", "dispatch": "x", "copies": "io"}


def decoded_weight(kind: str, bits: int, group: int | None, rows: int, cols: int) -> DecodedWeight:
    """The weight as the op table would record it: indices and fp16 palettes for a LUT, int8
    codes and one fp16 scale per output channel for int8."""
    weights = rows * cols
    if kind == "int8":
        return DecodedWeight("S-INT8", weights, weights + 2 * rows)
    palettes = 1 if group is None else rows // group
    stored = weights * bits // 8 + palettes * 2**bits * 2
    name = "per-tensor" if group is None else "per-channel" if group == 1 else f"group {group}"
    return DecodedWeight("S-LUT", weights, stored, bits, group, name, granularity_cost(group))


def work(kind: str, bits: int, group: int | None, rows: int, cols: int) -> tuple[Work, Work]:
    """(old, new) work of one call: the same op; only the new one knows what it decodes."""
    base = Work(
        ne_flops=2 * rows * cols,
        ne_weight_bytes=2 * rows * cols,
        cpu_flops=0,
        cpu_weight_bytes=0,
        copy_bytes=2 * cols,  # the one token's activation in
        output_bytes=2 * rows,  # its logits out
        ne_segments=1,
        w8a8=False,
    )
    if kind == "fp16":
        return base, base
    d = decoded_weight(kind, bits, group, rows, cols)
    old = replace(base, ne_weight_bytes=d.stored_bytes)
    return old, with_decoded(old, [d])


def old_chip(c: Chip) -> Chip:
    """The chip as the cost model saw it before: no decode rate, no index padding."""
    return replace(c, decode_gweights=None, index_padding=False)


def table(rows: int, cols: int) -> list[str]:
    """Markdown lines: one row per variant, one column per chip, "old -> new (bound)" ms."""
    chips = cost_chips()
    lines = [
        "| variant | " + " | ".join(c.name for c in chips) + " |",
        "|---|" + "---:|" * len(chips),
    ]
    for label, kind, bits, group in VARIANTS:
        old, new = work(kind, bits, group, rows, cols)
        cells = []
        for c in chips:
            before = floor_of_work(label, old, old_chip(c))
            after = floor_of_work(label, new, c)
            cells.append(f"{before.ms:.2f} -> {after.ms:.2f} {_BOUND.get(after.bound, '?')}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Print the table for the weight shape asked for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128256, help="output channels")
    parser.add_argument("--cols", type=int, default=4096, help="input channels")
    args = parser.parse_args()
    print(
        f"predicted floor per call, ms (a model, not a measurement): one NE op on a "
        f"{args.rows} x {args.cols} weight, one token; old -> new; new bound: c compute, "
        "w weights (bytes), d weight-decode, x dispatch"
    )
    print()
    for line in table(args.rows, args.cols):
        print(line)
    rel = relative_costs_json()
    print()
    granularity = ", ".join(f"{k} {v:g}" for k, v in rel["lut_granularity"].items())
    print(f"LUT granularity, time relative to per tensor: {granularity}")
    padded = ", ".join(f"{k} {v}" for k, v in rel["index_width"].items())
    print(f"index width: {padded}")
    rated = [c for c in cost_chips() if c.decode_gweights is not None]
    rates = ", ".join(f"{c.name} {c.decode_gweights.value:g}" for c in rated)  # type: ignore[union-attr]
    print(f"weight-decode rate, G weights/s: {rates}; no rate on the other chips")


if __name__ == "__main__":
    main()
