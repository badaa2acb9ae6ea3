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
the layers before it already rounded (the paper's sequential form), what follows the layers
last (a decoder's LM head, an encoder classifier's dense projection): `calibrate.Stages`, from
the subject - a decoder's calibration texts, or an encoder's calibration sentences in the
program's own right-padded, folded batches (real slots only).

Stored as such: the integers GPTQ chose and its scales (fp16) go into one constexpr op per
weight (``constexpr_blockwise_shift_scale``, iOS 18 / macOS 15; int8 before that
``constexpr_affine_dequantize``), written by ``compress.integer_weights`` rather than by
``linear_quantize_weights``, which would recompute the scale and could move the integers. The
only change from GPTQ's own result is the fp16 rounding of each row's scale (relative error
at most 2**-11, far under the grid step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from converter.compression.integer_weights import Integers, write_integers
from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    SearchData,
    SiteValues,
    VariantFields,
)
from converter.compression.sites import WeightSite
from converter.coreml.targets import Feature
from converter.errors import InputError

if TYPE_CHECKING:
    from converter.compression.calibrate import Stages


class Gptq(CompressionMethod):
    """GPTQ integers per output channel (or per block of inputs), calibrated on the recipe's
    calibration text."""

    name = "gptq"
    summary = "GPTQ (coremltools) int4 / int8 per output channel or block on the calibration text"
    # every task whose subject has calibration stages (``compress.decoder``, ``.encoder``)
    tasks = frozenset(
        {"text-generation", "feature-extraction", "sentence-similarity", "text-classification"}
    )
    needs_calibration = True
    order = 70
    searchable = True
    search_summary = "GPTQ integers per row"

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.bits not in (4, 8):
            problems.append((("bits",), "a gptq variant needs bits 4 or 8"))
        if variant.granularity not in ("per-channel", "per-block"):
            problems.append(
                (
                    ("granularity",),
                    "gptq weights are per-channel (one scale a row) or per-block (a scale per "
                    "group_size inputs of a row)",
                )
            )
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        fix = "set target: macOS15 (or iOS18)"
        if variant.granularity == "per-block":
            return [(("granularity",), Feature.BLOCKWISE_INT4, fix)]
        if variant.bits == 4:
            return [(("bits",), Feature.BLOCKWISE_INT4, fix + " or use bits: 8")]
        return []

    def scheme(self, variant: VariantFields) -> Scheme:
        assert variant.bits is not None  # check()
        return Scheme("gptq", variant.bits, variant.granularity, variant.group_size, True)

    def describe(self, scheme: Scheme) -> str:
        blocks = f" (blocks of {scheme.group_size} inputs)" if scheme.group_size else ""
        return f"int{scheme.bits} GPTQ {scheme.granularity}{blocks} symmetric"

    def ct_config(self, scheme: Scheme) -> Any:
        return scheme  # written by prepare(): the integers are GPTQ's, not recomputed

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        return (
            f"GPTQ int{scheme.bits} (coremltools layerwise_compression, damping 0.01, blocks "
            "of 128 columns) on the calibration text, layer by layer; integers and fp16 "
            + ("block" if scheme.group_size else "row")
            + " scales stored as computed"
        )

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        return mlmodel  # prepare() already holds the constexpr ops

    def search_check(self, space: Any) -> list[Problem]:
        if not {4, 8} & set(space.bits):
            return [(("methods",), "gptq is 4 or 8 bits: add 4 or 8 to bits")]
        return []

    def search_features(self, space: Any) -> list[FeatureUse]:
        if 4 in space.bits:
            fix = "set target: macOS15 (or iOS18) or drop gptq or 4"
            return [(("search", "methods"), Feature.BLOCKWISE_INT4, fix)]
        return []

    def search_candidates(self, space: Any, widths: list[int]) -> list[Scheme]:
        """Per output channel, symmetric, at 8 and 4 bits only."""
        return [Scheme(self.name, b, "per-channel", None, True) for b in widths if b in (4, 8)]

    def stored_bytes(self, site: WeightSite, scheme: Scheme) -> int:
        """Packed integers and one fp16 scale per output row."""
        return (site.elements * scheme.bits + 7) // 8 + site.shape[0] * 2

    def search_values(self, c: Scheme, sites: list[WeightSite], data: SearchData) -> SiteValues:
        """Every site at ``c``'s width, layer by layer on the calibration text."""
        bits = {s.name: c.bits for s in sites}
        ints, scales = gptq_weights(
            data.module, sites, bits, data.calibration, data.embed_table, data.pad_id
        )
        return {n: (c, decode(q, scales[n]).astype(np.float16)) for n, q in ints.items()}

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with each planned weight as GPTQ's integers and scales."""
        sites = [s for s in ctx.sites if s.name in plan]
        bits = {s.name: plan[s.name].bits for s in sites}
        block = variant.group_size if variant.granularity == "per-block" else None
        uneven = [s.name for s in sites if block is not None and s.elements // s.shape[0] % block]
        if uneven:
            raise InputError(
                f"variant {variant.suffix}: group_size {block} does not divide the inputs of "
                f"{', '.join(uneven[:3])}{' ...' if len(uneven) > 3 else ''}; choose a divisor "
                "or keep them fp16 (keep_fp16)"
            )
        start = time.perf_counter()
        with ctx.progress.step(f"{variant.suffix}: GPTQ ({len(sites)} weights)"):
            stages = ctx.subject.calibration_stages()
            ints, scales = sequential_gptq(stages, sites, bits, block)
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
    """`sequential_gptq` on a decoder: its calibration texts ``fixtures``, one batch."""
    from converter.compression.calibrate import decoder_stages

    return sequential_gptq(decoder_stages(module, fixtures, embed_table, pad_id), sites, bits)


def sequential_gptq(
    stages: Stages, sites: list[WeightSite], bits: dict[str, int], block: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """GPTQ's integers (int8 arrays, the sites' shapes, in [-2**(b-1), 2**(b-1) - 1]) and fp16
    scales of every site ((rows,), or (rows, inputs / block) with ``block``), sequentially:
    layers in order, then what follows them (LM head, classifier tail), each from the previous
    stage's output with its weights already rounded (each stage run once over every
    calibration batch to collect the Hessians, once to move on). Rounds ``stages.module``'s
    weights in place."""
    import torch
    from coremltools.optimize.torch.layerwise_compression.algorithms import GPTQ

    from converter.compression.calibrate import captured, owners

    convs = owners(stages.module, sites)
    groups: dict[int, list[str]] = {}
    for s in sites:
        groups.setdefault(stages.stage_of(s.name), []).append(s.name)
    ints: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    h = list(stages.inputs)  # each batch's input of stage i, earlier stages already rounded
    with torch.no_grad():
        for i in range(max(groups, default=-1) + 1):
            names = groups.get(i, [])
            algos = {n: GPTQ(convs[n], _config(bits[n], block)) for n in names}

            def sink(name: str, x: Any, y: Any, algos: dict[str, Any] = algos) -> None:
                algos[name].add_batch(x, y)

            for b, x in enumerate(h if names else []):
                with captured({n: convs[n] for n in names}, stages.columns[b], sink):
                    stages.run(i, x, b)
            for n, algo in algos.items():
                if algo._nsamples == 0:
                    raise ValueError(f"{n}: no calibration input reached it (not in a layer "
                                     "or the head)")  # fmt: skip
                algo._compress_impl()  # the rounding alone: no compression metadata registered
                q, scale = integers(convs[n].weight.data, algo, bits[n])
                ints[n], scales[n] = q, scale
                # later stages see exactly what the program will hold
                convs[n].weight.copy_(torch.from_numpy(decode(q, scale)))
                algo.cleanup()
            if i < stages.layers:
                h = [stages.run(i, x, b) for b, x in enumerate(h)]
    return ints, scales


def _config(bits: int, block: int | None) -> Any:
    from coremltools.optimize.torch.layerwise_compression.algorithms import ModuleGPTQConfig

    if block is None:
        return ModuleGPTQConfig(weight_dtype=f"uint{bits}")
    return ModuleGPTQConfig(weight_dtype=f"uint{bits}", granularity="per_block", block_size=block)


def integers(weight: Any, algo: Any, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The signed integers and fp16 scales (rows,) - or (rows, blocks), one per block of
    inputs - of GPTQ's dequantized ``weight``: the scales its quantizer stored as it went (per
    block: found on each block's inputs after the earlier blocks' errors moved them)."""
    import torch

    scale = torch.cat(algo._scale, dim=1).double().numpy()
    zero = torch.cat(algo._zero_point, dim=1).double().numpy()
    w = weight.reshape(weight.shape[0], -1).double().numpy()
    per = w.shape[1] // scale.shape[1]
    q = np.rint(w / np.repeat(scale, per, axis=1))
    if not np.allclose(q * np.repeat(scale, per, axis=1), w, rtol=0, atol=1e-6 * np.abs(w).max()):
        raise ValueError("GPTQ left weights off its grid")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if q.min() < lo or q.max() > hi or not np.allclose(zero, 2 ** (bits - 1)):
        raise ValueError(f"GPTQ integers outside the symmetric int{bits} range")
    scale = scale.reshape(-1) if scale.shape[1] == 1 else scale
    return q.astype(np.int8).reshape(weight.shape), scale.astype(np.float16)


def decode(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the program computes from ``q`` and fp16 scales ``scale`` (rows[, blocks])."""
    return row_integers(q, scale, 8).decode()


def row_integers(q: np.ndarray, scale: np.ndarray, bits: int) -> Integers:
    """GPTQ's integers with one scale per output row (``scale`` (rows,) or (rows, 1)) or per
    block of inputs (``scale`` (rows, blocks)), as the program stores them."""
    blocks = scale.reshape(q.shape[0], -1)
    return Integers(q, blocks.reshape(*blocks.shape, *([1] * (q.ndim - 2))), bits)


METHOD = Gptq()
