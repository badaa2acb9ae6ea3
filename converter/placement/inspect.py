"""``plan-inspect`` without the CLI: find the packages, build every section of the report.

Sections, each with its own evidence label: ``static`` (always), ``compute-plan`` (from a
dump, or read live on macOS), the agreement of the two, ``predicted`` (the cost model on
the static placement) and ``observed`` (a bench-device result).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.placement.chips import STRICTEST, Chip
from converter.placement.chips import cost_chips as every_cost_chip
from converter.placement.cost import cost_section
from converter.placement.device_bench import Observed, read_bench
from converter.placement.dump import RecordedPlan, read_dump
from converter.placement.ops import OpTable, op_table
from converter.placement.planreport import agreement, compute_plan_report
from converter.placement.report import PlacementReport
from converter.placement.rules import ComputeUnits
from converter.placement.static import static_report
from converter.placement.stream_rules import streamed_section


@dataclass
class Inspected:
    """Every section of the report for one package."""

    package: Path
    content_sha256: str
    table: OpTable
    static: PlacementReport
    predicted: dict[str, Any]
    compute_plan: PlacementReport | None = None
    agreement: dict[str, Any] | None = None
    observed: Observed | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form: one key per section, each section carrying its evidence label."""
        return {
            "package": str(self.package),
            "content_sha256": self.content_sha256,
            "static": self.static.to_json(),
            "compute_plan": self.compute_plan.to_json() if self.compute_plan else None,
            "agreement": self.agreement,
            "predicted": self.predicted,
            "observed": self.observed.to_json() if self.observed else None,
        }


def find_packages(path: Path) -> list[Path]:
    """The ``.mlpackage`` itself, or every ``.mlpackage`` directly inside an artifact dir."""
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.suffix == ".mlpackage":
        if not path.is_dir():
            raise InputError(f"{path}: an .mlpackage must be a directory")
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.glob("*.mlpackage") if p.is_dir())
        if found:
            return found
    raise InputError(f"{path}: expected an .mlpackage or an artifact directory holding one")


def load_table(package: Path) -> OpTable:
    """The op table of a saved package (every function)."""
    from parity.mil.program import load_package

    try:
        program = load_package(package)
    except Exception as e:  # coremltools raises many types for a damaged package
        raise InputError(f"{package}: cannot read the ML Program: {e}") from None
    return op_table(program)


def uses_w8a8(table: OpTable) -> bool:
    """True when activations are quantized (the int8 throughput applies)."""
    return any(op.op_type == "quantize" for op in table.ops())


def inspect_package(
    package: Path,
    chip: str = STRICTEST,
    compute_units: ComputeUnits = "CPU_AND_NE",
    recorded: RecordedPlan | None = None,
    plan_file: Path | None = None,
    observed_file: Path | None = None,
    cost_chips: list[Chip] | None = None,
    table: OpTable | None = None,
) -> Inspected:
    """Build every section of the report for one package."""
    from converter.pipeline.hashing import mlpackage_content_hash

    sha = mlpackage_content_hash(package)
    table = table if table is not None else load_table(package)
    static = static_report(table, str(package), sha, chip, compute_units)
    chips = cost_chips if cost_chips is not None else every_cost_chip()
    # A variant (M4 Max) is placed as its base chip: one static report per placement chip.
    placed = {
        name: static_report(table, str(package), sha, name, compute_units, ())
        for name in dict.fromkeys(c.placement_chip for c in chips)
    }
    out = Inspected(
        package=package,
        content_sha256=sha,
        table=table,
        static=static,
        predicted=cost_section([(c, placed[c.placement_chip]) for c in chips], uses_w8a8(table))
        | {"streamed": streamed_section(table)},
    )
    if recorded is None and plan_file is not None:
        recorded = read_dump(plan_file, sha)
    if recorded is not None:
        if recorded.content_sha256 != sha:
            raise InputError(f"{package}: the plan was recorded for another package")
        out.compute_plan = compute_plan_report(table, str(package), recorded, compute_units, static)
        out.agreement = agreement(static, out.compute_plan)
    if observed_file is not None:
        out.observed = read_observed(observed_file, sha)
    return out


def read_observed(path: Path, content_sha256: str) -> Observed:
    """A bench-device result, or the decode latency of an ``anec device-check`` file, for the
    package with ``content_sha256``; InputError when it is for another package."""
    from converter.placement.device_evidence import FORMAT, observed_from, read_raw

    doc = read_raw(path)
    if doc.get("format") != FORMAT:
        return read_bench(path, content_sha256)
    found = [p for p in doc.get("packages") or [] if p.get("content_sha256") == content_sha256]
    if not found:
        raise InputError(
            f"{path}: device-check evidence of {doc.get('artifact')!r}, whose packages do not "
            f"include this one ({content_sha256[:12]}): evidence from another artifact"
        )
    functions = list(found[0].get("functions") or ["decode"])
    # a draft's step is its decode; any other package shows its first function
    return observed_from(doc, "decode" if "decode" in functions else functions[0], content_sha256)
