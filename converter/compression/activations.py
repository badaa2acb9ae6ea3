"""W8A8: int8 activations in front of the compressed projections, calibrated on Linux.

coremltools' own ``linear_quantize_activations`` measures ranges with ``MLModel.predict``,
which needs macOS. Here the ranges come from anec's MIL evaluator running the fp16 program
itself on the calibration text (profile ``fp16``, the values the program stores), so they are
ranges of the emitted program's own tensors under the names coremltools' pass looks up; the
quantize/dequantize pairs are then inserted with coremltools' ``insert_prefix_quantize_
dequantize_pair`` pass, per op name.

Only the inputs of the projections whose weights are compressed get an int8 scale (one
symmetric per-tensor scale each). The residual stream and every norm input stay fp16: they
carry outliers (|h| ~ 27k in SmolLM2) that one per-tensor int8 scale cannot hold next to the
ordinary values. The report lists every quantized input with its range, and what stays fp16.

Torch level: ``ActivationFakeQuant`` applies the same scales with forward pre-hooks on the
same convs, ``round half to even(x / s)`` clipped to [-127, 127], as the MIL ``quantize`` op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from converter.compression.sites import WeightSite

INT8_MAX = 127.0


@dataclass(frozen=True)
class ActivationSite:
    """One projection whose input gets an int8 scale."""

    weight: str  # torch parameter name of its weight
    module: str  # torch module name of the conv
    op: str  # the conv op's name in the program
    input: str  # the program value it reads
    rmin: float = 0.0
    rmax: float = 0.0


def activation_sites(function: Any, sites: list[WeightSite]) -> list[ActivationSite]:
    """The conv op (and its input value) that consumes each weight site."""
    by_const = {s.const: s for s in sites}
    found = []
    for op in function.operations:
        if op.op_type != "conv":
            continue
        weight = op.inputs["weight"]
        site = by_const.get(weight.name)
        if site is None:
            continue
        module = site.name.rsplit(".", 1)[0]
        found.append(ActivationSite(site.name, module, op.name, op.inputs["x"].name))
    return found


def calibrate(
    evaluator: Any, feeds: list[dict[str, np.ndarray]], sites: list[ActivationSite]
) -> list[ActivationSite]:
    """Ranges of every site's input over ``feeds`` (evaluator runs of the fp16 program)."""
    lo = {s.input: np.inf for s in sites}
    hi = {s.input: -np.inf for s in sites}
    for feed in feeds:
        captured = evaluator.run(feed, capture=list(lo)).captured
        for name, value in captured.items():
            lo[name] = min(lo[name], float(np.min(value)))
            hi[name] = max(hi[name], float(np.max(value)))
    return [
        ActivationSite(s.weight, s.module, s.op, s.input, lo[s.input], hi[s.input]) for s in sites
    ]


def insert_activation_quantization(mlmodel: Any, sites: list[ActivationSite]) -> Any:
    """A new MLModel with a quantize/dequantize pair (int8, symmetric) before each site's op."""
    from coremltools.models.utils import _apply_graph_pass
    from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig
    from coremltools.optimize.coreml._quantization_passes import (
        insert_prefix_quantize_dequantize_pair,
    )

    from converter.compression.methods.base import quiet_progress

    config = OptimizationConfig(
        op_name_configs={
            s.op: OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8") for s in sites
        }
    )
    graph_pass = insert_prefix_quantize_dequantize_pair(config=config)
    graph_pass.activation_stats = {s.input: {"rmin": s.rmin, "rmax": s.rmax} for s in sites}
    with quiet_progress():
        return _apply_graph_pass(mlmodel, graph_pass)


def program_scales(function: Any, sites: list[ActivationSite]) -> dict[str, float]:
    """The scale the program's ``dequantize`` in front of each site's conv holds, by module."""
    ops = {op.name: op for op in function.operations}
    scales = {}
    for site in sites:
        producer = ops[site.op].inputs["x"].op
        if producer is None or producer.op_type != "dequantize":
            raise ValueError(f"{site.op}: no dequantize in front of it in the program")
        scales[site.module] = float(np.asarray(producer.inputs["scale"].val).reshape(-1)[0])
    return scales


def fake_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 symmetric quantize and dequantize, as the MIL ``quantize`` / ``dequantize`` pair."""
    q = torch.clamp(torch.round(x.float() / scale), -INT8_MAX - 1, INT8_MAX)
    return (q * scale).to(x.dtype)


def quantizer_mismatches(
    evaluator: Any,
    feed: dict[str, np.ndarray],
    function: Any,
    sites: list[ActivationSite],
    scales: dict[str, float],
) -> int:
    """Sites whose torch fake-quantizer, given the program's own input, does not give the
    program's dequantized value bit for bit (0 expected).

    Quantization is discontinuous: torch and the program reach each quantizer with values
    that differ in the last bits, so a code flips now and then and end-to-end logits cannot
    agree to 1e-5; each quantizer is therefore checked on the program's own input.
    """
    ops = {op.name: op for op in function.operations}
    pairs = {}
    for site in sites:
        dq = ops[site.op].inputs["x"].op
        q = dq.inputs["input"].op
        pairs[site.module] = (q.inputs["input"].name, dq.outputs[0].name)
    names = [n for pair in pairs.values() for n in pair]
    captured = evaluator.run(feed, capture=names).captured
    bad = 0
    for module, (before, after) in pairs.items():
        want = captured[after]
        got = fake_quantize(
            torch.from_numpy(np.asarray(captured[before], np.float32)), scales[module]
        )
        bad += 0 if np.array_equal(got.numpy(), np.asarray(want, np.float32)) else 1
    return bad


@contextmanager
def fake_quantized_inputs(module: nn.Module, scales: dict[str, float]) -> Iterator[None]:
    """While active, each named conv sees its input quantized to int8 and back."""
    modules = dict(module.named_modules())
    handles = []
    for name, scale in scales.items():

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...], s: float = scale) -> Any:
            return (fake_quantize(args[0], s),)

        handles.append(modules[name].register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def activation_report(
    sites: list[ActivationSite], scales: dict[str, float], kept_inputs: list[str]
) -> dict[str, Any]:
    """What is quantized (with ranges and scales) and what stays fp16 (``kept_inputs``: the
    weights of int8 projections whose input the recipe keeps fp16)."""
    return {
        "calibration": "anec MIL evaluator, profile fp16, on the fp16 program and the recipe's "
        "calibration text (coremltools' own calibration needs MLModel.predict, i.e. macOS)",
        "quantized_inputs": [
            {
                "op": s.op,
                "weight": s.weight,
                "input": s.input,
                "rmin": s.rmin,
                "rmax": s.rmax,
                "scale": scales.get(s.module),
            }
            for s in sites
        ],  # fmt: skip
        "kept_fp16_inputs": kept_inputs,
        "kept_fp16": "the residual stream, every norm input and output not listed above, "
        "attention scores and softmax, RoPE, the LM head input: outliers (|h| ~ 27k in the "
        "residual stream) that one per-tensor int8 scale cannot hold",
        "pays_on": "int8 x int8 arithmetic pays only on A17 Pro / M4 and later (SPEC 3); "
        "older NEs dequantize to fp16",
    }


def ranges_text(
    sites: list[ActivationSite], scales: dict[str, float], kept_inputs: list[str], worst: int = 5
) -> str:
    """The widest int8 inputs (range and scale) and the inputs kept fp16, as a short table:
    one wide input makes its scale coarse for every ordinary value it carries."""
    rows = sorted(sites, key=lambda s: max(abs(s.rmin), abs(s.rmax)), reverse=True)[:worst]
    lines = [
        f"Activation inputs: {len(sites)} int8 (the widest below), {len(kept_inputs)} kept fp16 "
        "by activations_keep_fp16",
        f"  {'projection weight':<44} {'min':>9} {'max':>9} {'scale':>9}",
    ]
    for s in rows:
        scale = scales.get(s.module, float("nan"))
        lines.append(f"  {s.weight:<44} {s.rmin:9.3g} {s.rmax:9.3g} {scale:9.3g}")
    return "\n".join(lines)
