"""Parity reports: one document (``parity.json``, rendered as ``parity.txt`` and
``parity.html``) covering every level, each number labelled with the implementation that
produced it: the rewrite (torch fp32 and fp16 against the original), the conversion (the
emitted program in the MIL evaluator: what `parity.conversion` measured, its gates rendered
with the torch levels'), the Core ML runtime (macOS only, otherwise marked not run), and the
residual stream's measured range with the power-of-two scales chosen from it
(`graph_passes.stream_scale`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from graph_passes.stream_scale import FP16_MAX, LIMIT, StreamScaling
from parity.conversion import RUNTIME, ConversionReport, ProfileRun
from parity.decoder_fp32 import MODULE_BASELINE
from parity.device_margin import DeviceMargin
from parity.gate_registry import GateResult, first_few, json_number
from parity.metrics import slices
from parity.result import ParityReport, clean_json, rows_to_json

SCHEMA_VERSION = 1


def report_to_json(report: ParityReport, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parity report as JSON-ready data (``parity.json``)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": report.passed,
        "first_diverging_layer": report.first_diverging_layer,
        "implementations": report.implementations,
        "gates": [g.to_json() for g in report.gates],
        "layers": [
            doc | {"fp16_overflow_margin": json_number(row.fp16_overflow_margin)}
            for doc, row in zip(rows_to_json(report.layers), report.layers, strict=True)
        ],
        "fixtures": rows_to_json(report.fixtures),
        **({"stream": stream_to_json(report.stream)} if report.stream else {}),
        **(extra or {}),
    }


def gate_line(g: GateResult) -> str:
    """One gate as parity.txt lists it: verdict, name, implementation, relation, notes."""
    mark = "PASS" if g.passed else "FAIL"
    where = f"(worst at {g.where})" if g.where else ""
    notes = " ".join(text for text in (g.detail, where) if text)
    return f"  {mark}  {g.name:<26} [{g.implementation}] {g.relation()}  {notes}"


def report_to_text(report: ParityReport) -> str:
    """A readable summary: gates, the first diverging layer, the per-layer table."""
    lines = ["Parity gates:"]
    lines += [gate_line(g) for g in report.gates]
    if report.first_diverging_layer is not None:
        lines.append(f"  first diverging layer: {report.first_diverging_layer}")
    lines.append("")
    if report.torch_fp16 == "run":
        lines.append("layer  fp32 rel err  fp16 rel err  fp16 max|h|  overflow margin")
        lines += [
            f"{row.layer:>5}  {row.fp32_rel_error:>12.3g}  {row.fp16_rel_error:>12.3g}  "
            f"{row.fp16_max_abs:>11.1f}  {row.fp16_overflow_margin:>14.1f}x"
            for row in report.layers
        ]
    else:  # the fp16 columns are the torch-fp16 level's
        lines += [f"  torch-fp16: {report.torch_fp16}", "layer  fp32 rel err"]
        lines += [f"{row.layer:>5}  {row.fp32_rel_error:>12.3g}" for row in report.layers]
    if report.stream is not None:
        lines += ["", stream_to_text(report.stream)]
    if not report.fixtures:
        return "\n".join(lines)  # an encoder report: its own fixture table follows
    lines.append("")
    lines.append("fixture                          slice        tokens  argmax  max|dp|  certified")
    for f in report.fixtures:
        lines.append(
            f"{f.name[:32]:<32} {f.slice:<12} {f.tokens:>6}  {f.fp16_argmax_agreement:>6.1%}  "
            f"{f.fp16_max_abs_dprob:>7.4f}  {f.certified_positions}/{f.tokens}"
        )
    return "\n".join(lines)


RANGE_SERIES = {
    "stream": "residual stream",
    "attention_out": "attention output",
    "mlp_product": "act(gate) * up",
    "mlp_out": "down projection output",
    "projections": "q/k/v, gate/up outputs",
}
MEASURED_ON = (
    "largest |value| per layer, fp32, the checkpoint's scale, on every fixture position "
    "(padding included)"
)


def stream_to_json(scaling: StreamScaling) -> dict[str, Any]:
    """The ``stream`` section of parity.json."""
    return {
        "measured_on": MEASURED_ON,
        "limit": LIMIT,
        "fp16_max": FP16_MAX,
        "scale": scaling.scale,
        "peak": scaling.peak,
        "branch_scales": [{**dataclasses.asdict(b), "where": b.where} for b in scaling.branches],
        "layers": [dataclasses.asdict(row) for row in scaling.layers],
        "scaled_tensors": [dataclasses.asdict(t) for t in scaling.tensors],
        "weights_to_fp16_subnormal": scaling.to_subnormal,
        "weights_to_fp16_zero": scaling.to_zero,
    }


def stream_to_text(scaling: StreamScaling) -> str:
    """The range table and the chosen scales, for parity.txt."""
    lines = [
        f"Residual stream range ({MEASURED_ON}); values above {LIMIT:g} are scaled by powers "
        "of two:",
        f"  stream scale s = {scaling.scale:g} (peak |h| {scaling.peak:.1f}, "
        f"{FP16_MAX / max(scaling.peak * scaling.scale, 1e-30):.2f}x below fp16's largest "
        "value once scaled)",
    ]
    for b in scaling.branches:
        lines.append(
            f"  branch scale {b.scale:g} at {b.where} (layer {b.layer} {b.branch}: "
            f"{b.measured:.1f} inside the branch)"
        )
    if scaling.tensors:
        lines.append(
            f"  scaled weights pushed into fp16 subnormals: {scaling.to_subnormal}, to zero: "
            f"{scaling.to_zero} (over {len(scaling.tensors)} tensors)"
        )
    lines.append("layer  " + "  ".join(f"{name:>12}" for name in RANGE_SERIES))
    for row in scaling.layers:
        values = "  ".join(f"{getattr(row, key):>12.1f}" for key in RANGE_SERIES)
        lines.append(f"{row.layer:>5}  {values}")
    return "\n".join(lines)


def conversion_to_json(report: ConversionReport) -> dict[str, Any]:
    """The conversion and runtime levels as JSON-ready data (inf spelt as a string)."""

    def run_doc(run: ProfileRun) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "implementation": run.implementation,
            "baseline": run.baseline,
            "description": run.description,
            "status": "run",
            "finite": run.finite,
            "layer_rel_error": [json_number(v) for v in run.layer_rel_error],
            "logits_rel_error": json_number(run.logits_rel_error),
        }
        if run.device_margin is not None:
            doc["device_margin"] = run.device_margin.to_json()
        if run.positions:
            doc["slices"] = {
                name: clean_json(vars(s))
                for name, s in slices(run.positions, report.length).items()
            }
            doc["positions"] = [
                row_doc | {"certified": row.certified}
                for row_doc, row in zip(rows_to_json(run.positions), run.positions, strict=True)
            ]
        return doc

    runtime_doc: dict[str, Any] = {
        "level": "runtime",
        "implementation": RUNTIME,
        "status": report.runtime_status,
    }
    if report.runtime is not None:
        runtime_doc |= run_doc(report.runtime) | {"status": report.runtime_status}
    gated = {g.implementation for g in report.gates}
    levels = [
        level_row("conversion", run.implementation, run.baseline, gated=run.implementation in gated)
        for run in report.runs
    ]
    levels.append(level_row("runtime", RUNTIME, "reference", report.runtime_status, False))
    return {
        "levels": levels,
        "conversion": {
            "markers": report.markers,
            "runs": [{"level": "conversion"} | run_doc(run) for run in report.runs],
        },
        "runtime": runtime_doc,
    }


def conversion_to_text(report: ConversionReport) -> str:
    """A readable summary of the conversion and runtime levels."""
    lines = ["Conversion level (the emitted program, MIL evaluator):"]
    failed = report.implementations.get("mil-fp32", "")
    if not report.runs and failed.startswith("failed: "):  # the program could not be prepared
        lines.append(f"  not run: {failed.removeprefix('failed: ')}")
    for run in report.runs:
        summary = run.summary()
        line = (
            f"  {run.implementation:<13} worst layer {max(run.layer_rel_error, default=0):.3g}"
            f"  logits {run.logits_rel_error:.3g}  finite {'yes' if run.finite else 'NO'}"
        )
        if summary.positions:
            line += (
                f"  argmax {summary.argmax_agreement:.1%}  max|dp| {summary.max_abs_dprob:.3g}"
                f"  max KL {summary.max_kl:.3g}  certified {summary.certified_share:.1%}"
            )
        against = "BC1L module (fp64)" if run.baseline == MODULE_BASELINE else run.baseline
        lines.append(line + f"  (against {against})")
        for name, s in slices(run.positions, report.length).items() if run.positions else []:
            if name != "all" and s.positions:
                lines.append(
                    f"      slice {name:<16} {s.positions:>4} positions  argmax "
                    f"{s.argmax_agreement:.1%}  max|dp| {s.max_abs_dprob:.3g}  certified "
                    f"{s.certified_share:.1%}"
                )
        if summary.uncertified:
            lines.append(f"      uncertified: {first_few(summary.uncertified, 10)}")
        if run.device_margin is not None:
            lines += device_margin_lines(run.device_margin)
    lines.append(f"Runtime level (Core ML): {report.runtime_status}")
    names = [run.implementation for run in report.runs if run.layer_rel_error]
    if names:
        lines.append("")
        lines.append("layer  " + "  ".join(f"{n:>13}" for n in names))
        for i in range(len(report.runs[0].layer_rel_error)):
            cells = [
                f"{run.layer_rel_error[i]:>13.3g}" for run in report.runs if run.layer_rel_error
            ]
            lines.append(f"{i:>5}  " + "  ".join(cells))
    return "\n".join(lines)


def device_margin_lines(found: DeviceMargin) -> list[str]:
    """The device-margin profile's summary, its deviations and flipped positions (parity.txt)."""
    lines = [f"      device margin: {found.summary()}"]
    for d in found.deviations:
        lines.append(f"      deviation {d.name}: +-{d.bound:g} absolute, {d.evidence}")
    for row in found.flipped:
        lines.append(
            f"      flipped {row.fixture}@{row.position}: seed {row.worst_seed}, margin "
            f"{row.margin:.3g}, |dp| {row.abs_dprob:.3g} (fp16 {row.fp16_abs_dprob:.3g}, "
            f"fp16-acc {row.acc_abs_dprob:.3g})"
        )
    return lines


def level_row(
    level: str, implementation: str, against: str, status: str = "run", gated: bool = True
) -> dict[str, Any]:
    """One row of the levels table (parity.json ``levels``, parity.html's table)."""
    return dict(
        level=level, implementation=implementation, against=against, status=status, gated=gated
    )


def parity_document(
    report: ParityReport,
    conversion: ConversionReport | None,
    extra: dict[str, Any],
    levels: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON document. ``levels`` lists the levels run instead of the conversion level (a
    cached decoder's cache level); without either, the conversion level says why it did not
    run (a torch gate failed, or it has not run yet)."""
    doc = report_to_json(report, extra)
    table = [
        level_row("rewrite", "torch-fp32", "reference"),
        level_row("rewrite", "torch-fp16", "reference", report.torch_fp16,
                  gated=report.torch_fp16 == "run"),
    ]  # fmt: skip
    if conversion is not None:
        conv = conversion_to_json(conversion)
        table += conv.pop("levels")
        doc |= conv
    elif levels:
        table += levels
    else:
        status = (
            "not run yet: the torch levels passed, the program is converted next"
            if report.passed
            else "not run: a torch-level gate failed, nothing was converted"
        )
        table.append(level_row("conversion", "mil", "-", status))
    doc["levels"] = table
    return doc
