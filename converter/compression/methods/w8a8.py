"""``method: w8a8``: int8 weights (as ``int8``) and int8 activations in front of every
compressed projection, calibrated on Linux by anec's MIL evaluator (``compress.activations``).

The projections listed in ``activations_keep_fp16`` keep an fp16 input. int8 x int8
arithmetic pays only on A17 Pro / M4 and later (SPEC 3); older NEs dequantize to fp16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Inspected,
    Problem,
    Scheme,
    Selection,
    VariantFields,
)
from converter.compression.methods.int8 import int8_problems
from converter.compression.sites import keep_reason
from converter.compression.smooth import ALPHA
from converter.coreml.targets import Feature


class W8A8(CompressionMethod):
    """int8 weights and int8 projection inputs."""

    name = "w8a8"
    summary = "int8 weights and int8 inputs of the compressed projections (calibrated)"
    order = 30
    tasks = frozenset({"text-generation"})
    needs_calibration = True
    fields = {
        "symmetric": "weights have a zero point",
        "activations_keep_fp16": None,
        "smooth": None,
        "smooth_alpha": None,
    }

    def check(self, variant: VariantFields) -> list[Problem]:
        problems = int8_problems(variant)
        if not variant.smooth and variant.smooth_alpha != ALPHA:
            problems.append((("smooth_alpha",), "only with smooth: true"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        return [(("method",), Feature.INT8_ACTIVATIONS, "choose a later target")]

    def scheme(self, variant: VariantFields) -> Scheme:
        return Scheme("int8", 8, "per-channel", None, variant.symmetric)

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """Input ranges of every planned projection (the fp16 program in the MIL evaluator,
        profile fp16, on the calibration text), then a quantize/dequantize pair before each.
        With ``smooth``, the quantized inputs' scales are folded into the weights first
        (``compress.smooth``) and the ranges are those of the folded program."""
        from converter.compression.activations import (
            activation_sites,
            calibrate,
            insert_activation_quantization,
        )
        from parity.mil import Evaluator, load_package

        program = load_package(Path(ctx.fp16_package))
        evaluator = Evaluator(program, "fp16")
        feeds = ctx.subject.calibration_feeds(evaluator)
        keep = variant.activations_keep_fp16
        quantized = [s for s in ctx.sites if s.name in plan and keep_reason(s, keep, 0) is None]
        smoothing = None
        if variant.smooth:
            from converter.compression.smooth import folded_constants, replace_constants, smooth

            function = program.functions["main"]
            smoothing = smooth(
                function, ctx.subject.module, ctx.sites, quantized, evaluator, feeds,
                variant.smooth_alpha,
            )  # fmt: skip
            mlmodel = replace_constants(mlmodel, folded_constants(function, smoothing.folds))
            program = mlmodel._mil_program  # the folded program: ranges are measured on it
            evaluator = Evaluator(program, "fp16")
        chosen = activation_sites(program.functions["main"], quantized)
        sites = calibrate(evaluator, feeds, chosen)
        return insert_activation_quantization(mlmodel, sites), (sites, smoothing)

    def effective(self, decoded: dict[str, Any], state: Any) -> dict[str, Any]:
        """The decoded weights with every fold undone: what they stand for in the original
        model (for the weight-error table; the program computes the same function)."""
        from converter.compression.smooth import unfolded

        smoothing = state[1]
        return decoded if smoothing is None else unfolded(decoded, smoothing.folds)

    def inspect(self, function: Any, state: Any, selection: Selection) -> Inspected | None:
        from converter.compression.activations import (
            activation_report,
            fake_quantized_inputs,
            program_scales,
            quantizer_mismatches,
            ranges_text,
        )

        sites, smoothing = state
        folds = smoothing.folds if smoothing is not None else []
        if not sites:
            return None
        scales = program_scales(function, sites)
        kept_inputs = sorted(set(selection.plan) - {a.weight for a in sites})

        decoded = set(selection.plan)  # these already hold the program's folded values

        @contextlib.contextmanager
        def wrap(module: Any) -> Iterator[None]:
            from converter.compression.smooth import scale_tensors

            scale_tensors(module, folds, decoded)
            try:
                with fake_quantized_inputs(module, scales):
                    yield
            finally:
                scale_tensors(module, folds, decoded, inverse=True)

        def check(evaluator: Any, feed: dict[str, Any]) -> int:
            return quantizer_mismatches(evaluator, feed, function, sites, scales)

        doc: dict[str, Any] = {"activations": activation_report(sites, scales, kept_inputs)}
        text = ranges_text(sites, scales, kept_inputs)
        if smoothing is not None:
            doc["smoothing"] = smoothing.to_json()
            text += "\n" + smoothing.text()
        return Inspected(
            wrap=wrap,
            check=check,
            doc=doc,
            text=text,
            notes=[
                "mil-fp32 logits relative error is reported, not gated, for int8 activations: "
                "a last-bit difference before a quantizer flips a code (one scale step)",
                "int8 x int8 arithmetic pays only on A17 Pro / M4 and later (SPEC 3)",
            ],
        )

    def manifest(self, variant: VariantFields) -> dict[str, Any]:
        return {
            "int8_activations": "int8 x int8 arithmetic pays only on A17 Pro / M4 and later; "
            "older NEs dequantize to fp16"
        }


METHOD = W8A8()
