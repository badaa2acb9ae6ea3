"""The recipe's compression section: every rule reported at its field, target features from
the target table, and the selection of weights by pattern."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.compression.schemes import Scheme, split_sites, variant_scheme
from converter.compression.sites import WeightSite, keep_reason
from converter.recipe import RecipeError, load_recipe

BASE = """\
name: tiny
task: text-generation
source: {{kind: hf-dir, path: .}}
target: {target}
fixtures:
  prompts: ["hello there"]
compression:
  held_out: ["a held-out text"]
{calibration}  variants:
{variants}
"""
GATES = "      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.1}\n"
CALIBRATION = '  calibration: ["a calibration text"]\n'


def _text(variants: str, target: str = "macOS14", calibration: bool | None = None) -> str:
    """BASE with ``variants``; calibration text by default only where a variant reads it."""
    if calibration is None:
        calibration = "method: w8a8" in variants or "method: mixed" in variants
    text = CALIBRATION if calibration else ""
    return BASE.format(target=target, variants=variants, calibration=text)


def _load(tmp_path: Path, variants: str, target: str = "macOS14", extra: str = "") -> object:
    path = tmp_path / "r.yaml"
    path.write_text(_text(variants, target) + extra, encoding="utf-8")
    return load_recipe(path)


def _errors(tmp_path: Path, variants: str, target: str = "macOS14") -> str:
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, variants, target)
    return str(e.value)


def test_uniform_variants_validate(tmp_path: Path) -> None:
    recipe = _load(tmp_path, "    - suffix: lut4\n      method: lut\n      bits: 4\n" + GATES)
    assert recipe.compression.variants[0].bits == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("bits: 5", "a lut variant needs bits from 1, 2, 3, 4, 6, 8"),
        ("bits: 4\n      granularity: per-channel", "palettes are per-tensor or per-grouped"),
        ("bits: 4\n      granularity: per-grouped-channel", "required for per-grouped-channel"),
        ("bits: 4\n      group_size: 8", "only for per-grouped-channel"),
        ("bits: 4\n      symmetric: false", "only int8 and w8a8 weights have a zero point"),
        ("bits: 4\n      activations_keep_fp16: ['*down*']", "only for method: w8a8"),
    ],
)
def test_lut_rules_name_the_field(tmp_path: Path, variant: str, message: str) -> None:
    text = f"    - suffix: v\n      method: lut\n      {variant}\n" + GATES
    assert message in _errors(tmp_path, text)


def test_int8_must_be_per_channel(tmp_path: Path) -> None:
    text = "    - suffix: v\n      method: int8\n" + GATES
    assert "int8 weights are per-channel" in _errors(tmp_path, text)


def test_grouped_and_3bit_palettes_need_macos15(tmp_path: Path) -> None:
    grouped = (
        "    - suffix: g\n      method: lut\n      bits: 4\n"
        "      granularity: per-grouped-channel\n      group_size: 16\n" + GATES
    )
    three = "    - suffix: t\n      method: lut\n      bits: 3\n" + GATES
    errors = _errors(tmp_path, grouped + three)
    assert "compression.variants[0].granularity: grouped-channel palettes need iOS18 / macOS15" in (
        errors
    )
    assert "compression.variants[1].bits: 3-bit palettes need iOS18 / macOS15" in errors
    assert "set target: macOS15" in errors
    recipe = _load(tmp_path, grouped + three, target="macOS15")
    assert len(recipe.compression.variants) == 2  # type: ignore[attr-defined]


def test_w8a8_needs_ios17_activation_ops(tmp_path: Path) -> None:
    text = "    - suffix: a\n      method: w8a8\n      granularity: per-channel\n" + GATES
    errors = _errors(tmp_path, text, target="macOS13")
    assert "int8 activation quantize/dequantize ops need iOS17 / macOS14" in errors


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ("smooth_alpha: 0.8", "smooth_alpha: only with smooth: true"),
        ("smooth: true\n      smooth_alpha: 0", "greater than 0.0 and at most 1.0, got 0"),
        ("smooth: true\n      smooth_alpha: 1.5", "greater than 0.0 and at most 1.0, got 1.5"),
    ],
)
def test_smooth_alpha_needs_smooth_and_a_share(tmp_path: Path, fields: str, message: str) -> None:
    text = f"    - suffix: a\n      method: w8a8\n      granularity: per-channel\n      {fields}\n"
    assert message in _errors(tmp_path, text + GATES)
    ok = "    - suffix: a\n      method: w8a8\n      granularity: per-channel\n"
    recipe = _load(tmp_path, ok + "      smooth: true\n      smooth_alpha: 0.8\n" + GATES)
    assert recipe.compression.variants[0].smooth_alpha == 0.8  # type: ignore[attr-defined]
    lut = "    - suffix: v\n      method: lut\n      bits: 4\n      smooth_alpha: 0.8\n"
    assert "only for method: w8a8" in _errors(tmp_path, lut + GATES)


def test_duplicate_suffix_missing_gates_and_overlaps(tmp_path: Path) -> None:
    text = (
        "    - {suffix: a, method: lut, bits: 4, gates: {min_top1_agreement: 0.9}}\n"
        "    - {suffix: a, method: lut, bits: 8, gates: {min_top1_agreement: 0.9, "
        "max_mean_kl: 0.1}}\n"
    )
    errors = _errors(tmp_path, text)
    assert "compression.variants[1].suffix: duplicate (first: variants[0])" in errors
    missing = "    - {suffix: a, method: lut, bits: 4, gates: {min_top1_agreement: 0.9}}\n"
    assert "needs min_top1_agreement and max_mean_kl" in _errors(tmp_path, missing)
    path = tmp_path / "o.yaml"
    overlap = _text("    - {suffix: b, method: lut, bits: 4, "
                    "gates: {min_top1_agreement: 0.9, max_mean_kl: 0.1}}\n")  # fmt: skip
    path.write_text(overlap.replace('["a held-out text"]', '["hello there"]'), encoding="utf-8")
    with pytest.raises(RecipeError, match="shares 1 text"):
        load_recipe(path)


def test_mixed_needs_search_and_calibration(tmp_path: Path) -> None:
    assert "a mixed variant needs a search section" in _errors(
        tmp_path, "    - suffix: m\n      method: mixed\n" + GATES
    )
    path = tmp_path / "c.yaml"
    w8a8 = "    - suffix: a\n      method: w8a8\n      granularity: per-channel\n" + GATES
    path.write_text(_text(w8a8, calibration=False), encoding="utf-8")
    with pytest.raises(RecipeError, match=r"c\.yaml:\d+: compression\.calibration: required by"):
        load_recipe(path)


def test_a_search_over_grids_needs_macos15_and_grid_block_needs_grid(tmp_path: Path) -> None:
    def mixed(search: str) -> str:
        return (
            "    - suffix: m\n      method: mixed\n      search:\n"
            f"        {search}\n        budget: {{min_top1_agreement: 0.9, max_mean_kl: 0.1}}\n"
            + GATES
        )

    grid = mixed("methods: [grid, lut]\n        grid_block: 16")
    assert "search.methods: block-wise int4 weights need iOS18 / macOS15" in _errors(tmp_path, grid)
    recipe = _load(tmp_path, grid, target="macOS15")
    assert recipe.compression.variants[0].search.grid_block == 16  # type: ignore[attr-defined]
    errors = _errors(tmp_path, mixed("grid_block: 16"), target="macOS15")
    assert "search.grid_block: only when grid is in methods" in errors


def test_calibration_without_a_variant_that_reads_it_is_refused(tmp_path: Path) -> None:
    """Calibration text feeds the calibrated methods only; with lut / int8 variants alone it
    would validate and then be ignored."""
    path = tmp_path / "r.yaml"
    lut = "    - suffix: l\n      method: lut\n      bits: 4\n" + GATES
    path.write_text(_text(lut, calibration=True), encoding="utf-8")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value) == (
        f"{path}:9: compression.calibration: used by w8a8, mixed, gptq and skm variants only "
        "and no variant here is one; remove it"
    )


def _site(name: str, elements: int = 4096) -> WeightSite:
    return WeightSite(name, name.replace(".", "_") + "_to_fp16", (elements, 1, 1, 1), "float16")


def test_keep_patterns_and_size_floor_select_weights() -> None:
    sites = [
        _site("layers.0.mlp.down.weight"),
        _site("lm_head.0.weight"),
        _site("layers.0.input_norm.weight"),
        _site("layers.0.attention.o.weight", 100),
    ]
    chosen, kept = split_sites(sites, ["*norm*", "lm_head*"], 2048)
    assert [s.name for s in chosen] == ["layers.0.mlp.down.weight"]
    assert kept["lm_head.0.weight"] == "keep_fp16 pattern 'lm_head*'"
    assert "min_weight_elements" in kept["layers.0.attention.o.weight"]
    assert keep_reason(sites[0], [], 2048) is None


def test_schemes_describe_what_the_program_holds(tmp_path: Path) -> None:
    recipe = _load(
        tmp_path,
        "    - {suffix: a, method: int8, granularity: per-channel, symmetric: false, "
        "gates: {min_top1_agreement: 0.9, max_mean_kl: 0.1}}\n",
    )
    scheme = variant_scheme(recipe.compression.variants[0])  # type: ignore[attr-defined]
    assert scheme == Scheme("int8", 8, "per-channel", None, False)
    assert scheme.describe() == "int8 per-channel asymmetric"
    assert Scheme("lut", 4, "per-grouped-channel", 16).describe() == (
        "lut4 k-means per-grouped-channel (groups of 16 output channels)"
    )
