"""``method: grid``: each weight re-encoded on the block grid it already lies on.

A checkpoint de-quantized from a block format (the packaged SmolLM2 is a Q4_1 GGUF: 4-bit
integers with an fp16 scale and minimum per 32 inputs, its embedding / LM head Q8_0) is stored
by an fp16 conversion at 16 bits per weight although it holds 4 or 8. Palettes or per-row
integers quantize it a second time (SmolLM2 lut4 / gptq4: top-1 0.6 at best); its own grid
keeps it as it is, up to fp16 rounding. ``compress.grids`` finds, per weight, the cheapest
grid that reproduces it (int4 symmetric, int4 affine, int8 symmetric; blocks of
``group_size`` inputs); a weight on no grid stays fp16 and is listed with that reason. A
variant in which no weight lies on a grid is an error: the method re-encodes quantized
checkpoints, it does not quantize.

Stored as ``constexpr_blockwise_shift_scale`` (iOS 18 / macOS 15): the integers, an fp16
scale per block and, affine, an fp16 offset per block (``scale * (q - offset)``), written by
``compress.integer_weights``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from converter.compression.methods.base import (
    BuildContext,
    CompressionMethod,
    FeatureUse,
    Problem,
    Scheme,
    SearchData,
    Selection,
    SiteValues,
    VariantFields,
    split_sites,
)
from converter.compression.sites import WeightSite
from converter.coreml.targets import Feature


def _scheme(grid: Any, block: int) -> Scheme:
    return Scheme("grid", grid.bits, "per-block", block, grid.symmetric)


class GridMethod(CompressionMethod):
    """The source's own block grid, found per weight."""

    name = "grid"
    summary = "each weight on the block grid it already lies on (de-quantized checkpoints)"
    order = 90
    records_symmetry = True
    searchable = True
    search_summary = "the weight's own block grid (exact)"
    search_fields = {"grid_block": "only when grid is in methods"}

    def check(self, variant: VariantFields) -> list[Problem]:
        problems: list[Problem] = []
        if variant.bits is not None:
            problems.append((("bits",), "a grid variant's bits are found per weight; remove bits"))
        if variant.granularity != "per-block":
            problems.append((("granularity",), "grid weights are per-block (set per-block)"))
        return problems

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        fix = "set target: macOS15 (or iOS18)"
        return [(("granularity",), Feature.BLOCKWISE_INT4, fix)]

    def select(self, ctx: BuildContext, variant: VariantFields) -> Selection:
        """The grid of every weight that lies on one; the others kept fp16 with the reason."""
        from converter.compression.calibrate import owners
        from converter.compression.grid_fit import find_grid

        assert variant.group_size is not None  # config: required for per-block
        block = variant.group_size
        chosen, kept = split_sites(ctx.sites, ctx.keep_fp16, ctx.min_weight_elements)
        convs = owners(ctx.subject.module, chosen)
        plan: dict[str, Scheme] = {}
        with ctx.progress.step(f"{variant.suffix}: find grids", total=len(chosen)) as advance:
            for site in chosen:
                weight = convs[site.name].weight.detach().half().float().numpy()
                found = find_grid(weight, block)
                if found is None:
                    kept[site.name] = f"on no int4 / int8 grid of blocks of {block} inputs"
                else:
                    plan[site.name] = _scheme(found[0], block)
                advance()
        if chosen and not plan:
            from converter.errors import InputError

            raise InputError(
                f"compression variant {variant.suffix}: none of the {len(chosen)} weights lies "
                f"on an int4 / int8 grid of blocks of {block} inputs; method grid re-encodes a "
                "checkpoint de-quantized from a block format (e.g. a GGUF), it does not quantize"
            )
        found_by = Counter(s.describe() for s in plan.values())
        return Selection(plan, kept, {"grid": {"block": block, "weights_by_grid": dict(found_by)}})

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model with each planned weight as its grid's integers, scales and offsets,
        fitted again on the fp16 program's own values (``mlmodel`` is that program)."""
        from pathlib import Path

        import numpy as np

        from converter.compression.grid_fit import find_grid
        from converter.compression.integer_weights import write_integers
        from parity.mil import load_package

        sites = {s.name: s for s in ctx.sites if s.name in plan}
        function = load_package(Path(ctx.fp16_package)).functions["main"]
        consts = {op.outputs[0].name: op for op in function.operations if op.op_type == "const"}
        values = {}
        for name, site in sites.items():
            weight = np.asarray(consts[site.const].outputs[0].val, np.float32)
            found = find_grid(weight, plan[name].group_size or 0)
            if found is None or _scheme(found[0], plan[name].group_size or 0) != plan[name]:
                raise ValueError(f"{name}: the program's weight is not on the grid found for it")
            values[site.const] = found[1]
        return write_integers(mlmodel, values), None

    def check_source(self, variant: VariantFields, tables: list[Any]) -> None:
        """A block-quantized source is re-encoded exactly or not at all: a GGUF holding
        K-quant tensors is refused by name (`converter.compression.grid_fit.K_QUANTS`)."""
        from converter.compression.grid_fit import K_QUANTS, k_quant_tensors
        from converter.errors import InputError

        for table in tables:
            found = k_quant_tensors({name: t.dtype for name, t in table.tensors.items()})
            if found:
                kinds = sorted(set(found.values()))
                listed = ", ".join(f"{n} ({k})" for n, k in list(found.items())[:4])
                raise InputError(
                    f"compression variant {variant.suffix}: method grid cannot re-encode "
                    f"{table.file.name} exactly: {len(found)} tensors are llama.cpp K-quants "
                    f"({', '.join(kinds)}), e.g. {listed}; their block scales (an integer times "
                    "the super-block's fp16 scale) do not fit one fp16 scale per block. Grids "
                    f"it holds exactly: Q4_0, Q4_1, Q5_0, Q8_0 ({', '.join(K_QUANTS)} refused); "
                    "choose another method (int8, lut, gptq) for this source"
                )

    def search_features(self, space: Any) -> list[FeatureUse]:
        fix = "set target: macOS15 (or iOS18) or drop grid"
        return [(("search", "methods"), Feature.BLOCKWISE_INT4, fix)]

    def search_candidates(self, space: Any, widths: list[int]) -> list[Scheme]:
        """One candidate: its width is each weight's own."""
        return [Scheme(self.name, 0, "per-block", space.grid_block)]

    def search_label(self, scheme: Scheme) -> str:
        return self.name  # one candidate: the width is each weight's own

    def fits(self, site: WeightSite, scheme: Scheme) -> bool:
        """Blocks must divide its inputs (whether it lies on a grid is known from its values)."""
        return not scheme.group_size or site.elements // site.shape[0] % scheme.group_size == 0

    def stored_bytes(self, site: WeightSite, scheme: Scheme) -> int:
        """Packed integers and an fp16 scale (and offset) per block."""
        assert scheme.group_size is not None  # a grid scheme is per block
        per_block = 2 if scheme.symmetric else 4
        payload = (site.elements * scheme.bits + 7) // 8
        return payload + site.elements // scheme.group_size * per_block

    def search_values(self, c: Scheme, sites: list[WeightSite], data: SearchData) -> SiteValues:
        """Only the sites on a grid, each with its own grid's scheme."""
        from converter.compression.grid_fit import find_grid

        assert c.group_size is not None
        out: SiteValues = {}
        for s in sites:
            found = find_grid(data.fp16[s.name].astype(np.float32), c.group_size)
            if found is not None:
                grid, integers = found
                scheme = _scheme(grid, c.group_size)
                out[s.name] = (scheme, integers.decode().astype(np.float16))
        return out

    def describe(self, scheme: Scheme) -> str:
        kind = "symmetric" if scheme.symmetric else "affine"
        return f"int{scheme.bits} {kind} grid, blocks of {scheme.group_size} inputs"

    def ct_config(self, scheme: Scheme) -> Any:
        return scheme  # written by prepare(): the source's own integers

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        offset = " and an fp16 offset" if not scheme.symmetric else ""
        return (
            f"the weight's own int{scheme.bits} grid (found: every value within 2**-9 of its "
            f"block's largest |value|), an fp16 scale{offset} per {scheme.group_size} inputs "
            "fitted by least squares; no rounding beyond fp16's"
        )

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        return mlmodel  # prepare() already holds the constexpr ops


METHOD = GridMethod()
