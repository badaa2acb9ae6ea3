"""``method: gptq``: GPTQ-rounded integer weights (int4 or int8, symmetric, one scale per output
channel), computed by coremltools' implementation (``optimize.torch.layerwise_compression``)
on the recipe's calibration text.

What coremltools' GPTQ does (``algorithms.GPTQ``, read in coremltools 9.0): per weight, the
Hessian ``H = 2/n X X^T`` of its conv's real input columns ``X``; the per-row grid
``scale * (q - 2**(bits-1))``, ``q`` in 0..2**bits-1, ``scale = 2 max|w_row| / (2**bits - 1)``
(its ``Quantizer``, symmetric); then columns are rounded one at a time and each rounding
error is spread over the columns not yet rounded through the inverse Hessian's Cholesky
factor (damping 1 % of the mean diagonal, blocks of 128 columns). It leaves the dequantized
weights in the layer. anec runs it layer by layer in order, each layer's Hessians measured with
the layers before it already rounded (the paper's sequential form), the LM head last.

Stored as such: the integers GPTQ chose and its scales (fp16) go into one constexpr op per
weight (``constexpr_blockwise_shift_scale``, iOS 18 / macOS 15; int8 before that
``constexpr_affine_dequantize``), written by ``compress.integer_weights`` rather than by
``linear_quantize_weights``, which would recompute the scale and could move the integers. The
only change from GPTQ's own result is the fp16 rounding of each row's scale (relative error
at most 2**-11, far under the grid step).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from converter.compress.integer_weights import Integers, write_integers
from converter.compress.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    VariantFields,
)
from converter.compress.sites import WeightSite
from converter.targets import Feature


class Gptq(CompressionMethod):
    """GPTQ integers per output channel, calibrated on the recipe's calibration text."""

    name = "gptq"
    summary = "GPTQ (coremltools) int4 / int8 per output channel on the calibration text"
    tasks = frozenset({"text-generation"})
    needs_calibration = True

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.bits not in (4, 8):
            problems.append((("bits",), "a gptq variant needs bits 4 or 8"))
        if variant.granularity != "per-channel":
            problems.append((("granularity",), "gptq weights are per-channel (one scale a row)"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        if variant.bits == 4:
            fix = "set target: macOS15 (or iOS18) or use bits: 8"
            return [(("bits",), Feature.BLOCKWISE_INT4, fix)]
        return []

    def scheme(self, variant: VariantFields) -> Scheme:
        assert variant.bits is not None  # check()
        return Scheme("gptq", variant.bits, "per-channel", None, True)

    def describe(self, scheme: Scheme) -> str:
        return f"int{scheme.bits} GPTQ per-channel symmetric"

    def ct_config(self, scheme: Scheme) -> Any:
        return scheme  # written by prepare(): the integers are GPTQ's, not recomputed

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        return (
            f"GPTQ int{scheme.bits} (coremltools layerwise_compression, damping 0.01, blocks "
            "of 128 columns) on the calibration text, layer by layer; integers and fp16 row "
            "scales stored as computed"
        )

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        return mlmodel  # prepare() already holds the constexpr ops

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with each planned weight as GPTQ's integers and scales."""
        # a DecoderSubject (tasks: text-generation): its module, calibration slice, table
        subject: Any = ctx.subject
        sites = [s for s in ctx.sites if s.name in plan]
        bits = {s.name: plan[s.name].bits for s in sites}
        start = time.perf_counter()
        with ctx.progress.step(f"{variant.suffix}: GPTQ ({len(sites)} weights)"):
            ints, scales = gptq_weights(
                subject.module, sites, bits, subject.held_out.calibration,
                subject.embed_table, subject.held_out.pad_id,
            )  # fmt: skip
        consts = {s.name: s.const for s in sites}
        values = {consts[n]: row_integers(ints[n], scales[n], bits[n]) for n in ints}
        model = write_integers(mlmodel, values)
        return model, {"seconds": time.perf_counter() - start}


def gptq_weights(
    module: Any,
    sites: list[WeightSite],
    bits: dict[str, int],
    fixtures: list[Any],
    embed_table: Any,
    pad_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """GPTQ's integers (int8 arrays, the sites' shapes, in [-2**(b-1), 2**(b-1) - 1]) and fp16
    row scales of every site, sequentially: decoder layers in order, then the LM head, each
    from the previous layer's output with its weights already rounded (one layer run to
    collect the Hessians, one to move on)."""
    import torch
    from coremltools.optimize.torch.layerwise_compression.algorithms import (
        GPTQ,
        ModuleGPTQConfig,
    )

    from converter.compress.calibrate import calibration, captured_inputs, fp16_copy, owners

    work = fp16_copy(module)
    cal = calibration(work, fixtures, embed_table, pad_id)
    convs = owners(work, sites)
    layers = work.decoder_layers()
    groups: dict[int, list[str]] = {}
    for s in sites:
        parts = s.name.split(".")
        layer = int(parts[1]) if parts[0] == "layers" and parts[1].isdigit() else len(layers)
        groups.setdefault(layer, []).append(s.name)
    masks = work.masks(cal.key_mask)
    ints: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}

    def step(i: int, h: Any) -> Any:
        """Layer ``i`` on ``h`` (``len(layers)``: the final norm and LM head)."""
        if i == len(layers):
            return work.head(h)
        layer = layers[i]
        return layer(h, masks[layer.window if layer.window in masks else None])

    with torch.no_grad():
        h = work.embed_bc1l(cal.x)  # the input of layer i, earlier layers already rounded
        for i in range(len(layers) + 1):
            names = groups.get(i, [])
            algos = {
                n: GPTQ(convs[n], ModuleGPTQConfig(weight_dtype=f"uint{bits[n]}")) for n in names
            }

            def sink(name: str, x: Any, y: Any, algos: dict[str, Any] = algos) -> None:
                algos[name].add_batch(x, y)

            with captured_inputs({n: convs[n] for n in names}, cal.starts, sink):
                step(i, h)
            for n, algo in algos.items():
                if algo._nsamples == 0:
                    raise ValueError(f"{n}: no calibration input reached it (not in a layer "
                                     "or the LM head)")  # fmt: skip
                algo._compress_impl()  # the rounding alone: no compression metadata registered
                q, row_scale = integers(convs[n].weight.data, algo._quantizer, bits[n])
                ints[n], scales[n] = q, row_scale
                # later layers see exactly what the program will hold
                convs[n].weight.copy_(torch.from_numpy(decode(q, row_scale)))
                algo.cleanup()
            if i < len(layers):
                h = step(i, h)
    return ints, scales


def integers(weight: Any, quantizer: Any, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The signed integers and fp16 row scales of GPTQ's dequantized ``weight``."""
    scale = quantizer.scale.reshape(-1).double().numpy()
    zero = quantizer.zero_point.reshape(-1).double().numpy()
    w = weight.reshape(weight.shape[0], -1).double().numpy()
    q = np.rint(w / scale[:, None])
    if not np.allclose(q * scale[:, None], w, rtol=0, atol=1e-6 * np.abs(w).max()):
        raise ValueError("GPTQ left weights off its grid")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if q.min() < lo or q.max() > hi or not np.allclose(zero, 2 ** (bits - 1)):
        raise ValueError(f"GPTQ integers outside the symmetric int{bits} range")
    return q.astype(np.int8).reshape(weight.shape), scale.astype(np.float16)


def decode(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the program computes from ``q`` and fp16 row scales ``scale``."""
    return row_integers(q, scale, 8).decode()


def row_integers(q: np.ndarray, scale: np.ndarray, bits: int) -> Integers:
    """GPTQ's integers with one scale per output row, as the program stores them."""
    return Integers(q, scale.reshape(-1, *([1] * (q.ndim - 1))), bits)


METHOD = Gptq()
