"""``method: skm``: sensitive k-means palettes (coremltools ``SKMPalettizer``) on the recipe's
calibration text, per tensor or per group of output channels.

What ``SKMPalettizer`` does (read in coremltools 9.0, ``palettization/sensitive_k_means.py``):
for each calibration item it runs ``loss_fn(model, item)`` and backpropagates with a hook that
squares every parameter's gradient, so the accumulated gradients are the diagonal empirical
Fisher information ``sum_items (dL/dw)**2``; normalised to a maximum of 1 and clipped from
below (zero sensitivities let k-means diverge), it weights each value in a 1-D weighted
k-means of 2**bits centroids per table. anec's loss is the next-token cross-entropy of each
calibration text (one text an item, so the squares are per text, not of a batch sum). anec
computes those sensitivities itself, for the compressed weights only (`fisher_sensitivity`,
equal to ``compute_sensitivity``'s), and hands them to ``SKMPalettizer.compress`` as its
documented ``sensitivity_path``: the k-means is coremltools'.

Stored as such: the clustered weights (fp32 centroids rounded to fp16, the values the program
holds) replace the fp16 constants, then ``palettize_weights`` (mode ``custom``, `exact_table`)
stores each table's distinct values exactly, no second clustering.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    SearchData,
    SiteValues,
    VariantFields,
    quiet_progress,
)
from converter.compression.methods.lut import METHOD as LUT
from converter.compression.methods.lut import palette_bytes, palette_candidates
from converter.compression.sites import WeightSite


class Skm(CompressionMethod):
    """Fisher-weighted k-means palettes, calibrated on the recipe's calibration text."""

    name = "skm"
    summary = "sensitive k-means palettes (coremltools SKMPalettizer) on the calibration text"
    tasks = frozenset({"text-generation"})
    needs_calibration = True
    order = 80
    searchable = True
    search_summary = "sensitive k-means"

    def check(self, variant: VariantFields) -> list[Problem]:
        return LUT.check(variant)

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        return LUT.features(variant)

    def scheme(self, variant: VariantFields) -> Scheme:
        assert variant.bits is not None  # check()
        return Scheme("skm", variant.bits, variant.granularity, variant.group_size)

    def describe(self, scheme: Scheme) -> str:
        group = f" (groups of {scheme.group_size} output channels)" if scheme.group_size else ""
        return f"lut{scheme.bits} sensitive k-means {scheme.granularity}{group}"

    def ct_config(self, scheme: Scheme) -> Any:
        from coremltools.optimize.coreml import OpPalettizerConfig

        return OpPalettizerConfig(
            mode="custom",  # the values are already SKM's centroids: store them as they are
            lut_function=functools.partial(exact_table, bits=scheme.bits),
            granularity=scheme.granularity.replace("-", "_"),
            group_size=scheme.group_size or 32,
            channel_axis=0,
            weight_threshold=1,
        )

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        return (
            "sensitive k-means (coremltools SKMPalettizer: Fisher-weighted 1-D k-means, "
            "next-token loss on the calibration text), fp16 centroids stored exactly "
            "(palettize_weights, each table its distinct values)"
        )

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        from coremltools.optimize.coreml import OptimizationConfig, palettize_weights

        with quiet_progress():
            return palettize_weights(mlmodel, OptimizationConfig(op_name_configs=op_configs))

    def search_candidates(self, space: Any, widths: list[int]) -> list[Scheme]:
        return palette_candidates(self.name, space, widths)

    def stored_bytes(self, site: WeightSite, scheme: Scheme) -> int:
        return palette_bytes(site, scheme)

    def search_values(self, c: Scheme, sites: list[WeightSite], data: SearchData) -> SiteValues:
        """All sites at ``c`` in one SKMPalettizer run."""
        plan = {s.name: c for s in sites}
        values = skm_weights(
            data.module, sites, plan, data.calibration, data.embed_table, data.pad_id
        )
        return {n: (c, v) for n, v in values.items()}

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with each planned weight replaced by its clustered fp16 values."""
        from converter.compression.smooth import replace_constants

        # a DecoderSubject (tasks: text-generation): its module, calibration slice, table
        subject: Any = ctx.subject
        sites = [s for s in ctx.sites if s.name in plan]
        start = time.perf_counter()
        with ctx.progress.step(f"{variant.suffix}: sensitive k-means ({len(sites)} weights)"):
            values = skm_weights(
                subject.module, sites, {s.name: plan[s.name] for s in sites},
                subject.held_out.calibration, subject.embed_table, subject.held_out.pad_id,
            )  # fmt: skip
        model = replace_constants(mlmodel, {s.const: values[s.name] for s in sites})
        return model, {"seconds": time.perf_counter() - start}


def exact_table(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """A table of ``2**bits`` entries holding ``values``' distinct fp16 values (zero-padded),
    and each value's index. Distinct by bit pattern: numpy 2.4's ``np.unique`` on a large
    float16 array returned repeated values here (22 "distinct" values of 16), which made
    coremltools' ``unique`` mode pick 6-bit indices for a 4-bit table."""
    flat = np.ascontiguousarray(values, np.float16).reshape(-1)
    patterns, indices = np.unique(flat.view(np.uint16), return_inverse=True)
    if patterns.size > 2**bits:
        raise ValueError(f"{patterns.size} distinct values do not fit a {bits}-bit table")
    table = np.zeros(2**bits, np.float16)
    table[: patterns.size] = patterns.view(np.float16)
    return table, indices.astype(np.uint8)


def skm_weights(
    module: Any,
    sites: list[WeightSite],
    plan: dict[str, Scheme],
    fixtures: list[Any],
    embed_table: Any,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Every site's SKM-clustered weight, fp16, the site's shape."""
    import tempfile
    from pathlib import Path

    import torch
    from coremltools.optimize.torch.palettization import (
        ModuleSKMPalettizerConfig,
        SKMPalettizer,
        SKMPalettizerConfig,
    )

    from converter.compression.calibrate import calibration, fp16_copy, next_token_loss, owners

    work = fp16_copy(module)
    items = [calibration(work, [f], embed_table, pad_id) for f in fixtures]
    sensitivity = fisher_sensitivity(work, [s.name for s in sites], items, next_token_loss)
    convs = owners(work, sites)
    configs = {}
    for s in sites:
        scheme = plan[s.name]
        grouped = scheme.granularity == "per-grouped-channel"
        configs[s.name.rpartition(".")[0]] = ModuleSKMPalettizerConfig(
            n_bits=scheme.bits,
            granularity=scheme.granularity.replace("-", "_"),
            group_size=scheme.group_size if grouped else None,
            channel_axis=0,
        )
    config = SKMPalettizerConfig(module_name_configs=configs, calibration_nsamples=len(items))
    with tempfile.TemporaryDirectory(prefix="anec-skm-") as tmp, quiet_progress():
        path = Path(tmp) / "sensitivity.pt"
        torch.save(sensitivity, path)  # SKMPalettizer takes precomputed values as a file
        del sensitivity
        SKMPalettizer(work, config).compress(sensitivity_path=str(path), inplace=True)
    out = {}
    for s in sites:
        w = convs[s.name].weight.detach().half().numpy()
        out[s.name] = w
    return out


def fisher_sensitivity(
    work: Any, names: list[str], items: list[Any], loss_fn: Any
) -> dict[str, Any]:
    """coremltools' ``SKMPalettizer.compute_sensitivity`` for the named weights only, and
    without its copies of the model: per item, the loss's gradient with respect to those
    weights (``torch.autograd.grad``: no ``.grad`` kept on any parameter), squared and summed
    over the items, then its normalisation (times 100, divided by the maximum, zeros raised to
    the smallest non-zero value, floored at ``_SENSITIVITY_CLIP_THR``). Same values (test).
    Leaves every parameter of ``work`` with ``requires_grad`` off.

    Why not theirs: it keeps a gradient for every parameter, saves and reloads the whole
    state dict and the raw sensitivities, and ``compress`` deep-copies the model once more; at
    Qwen2.5-0.5B size that passed 13 GiB (bench/README.md, compress.py methods)."""
    import torch
    from coremltools.optimize.torch.palettization import SKMPalettizer

    params = [work.get_parameter(n) for n in names]
    totals = [torch.zeros_like(p) for p in params]
    for p in work.parameters():
        p.requires_grad_(False)
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        for item in items:
            grads = torch.autograd.grad(loss_fn(work, item), params)
            for total, grad in zip(totals, grads, strict=True):
                total.add_(torch.square(grad))
            del grads
        for p in params:
            p.requires_grad_(False)
    floor = SKMPalettizer._SENSITIVITY_CLIP_THR
    out = {}
    for name, total in zip(names, totals, strict=True):
        val = 100 * total
        if len(val.nonzero()) == 0:
            val[val == 0] = 1.0
        val = val / torch.max(val)
        val[val == 0] = torch.min(val[val != 0])
        val[val < floor] = floor
        out[name] = val
    return out


METHOD = Skm()
