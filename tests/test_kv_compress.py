"""Compressed variants of a cached decoder (``converter.compression.stateful``) on a tiny Llama:
each variant one stateful multifunction package whose functions hold byte-identical weights
stored once, gated by the compression gates and the cache's structural gates.

One conversion (fp16 kv artifact + two variants) shared by every test in this file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import Result
from tiny_models import (
    convert_tiny_llama,
    one_torch_thread,
)

from converter.compression.cached_programs import HOST_FILES, STRUCTURAL, WINDOW, differing
from converter.recipe import RecipeError, load_recipe

# decode_steps 16: a CI-sized recipe (the 64 steps run in test_kv_pipeline.py).
CACHE = "target: macOS15\ncache:\n  style: state\n  length: 64\n  prefill: 8\n  extend: 4\n"
CACHE += "  decode_steps: 16\n"
COMPRESSION = """\
compression:
  held_out: [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41, 42, 43, 44, 45]]
  calibration: [[60, 61, 62, 63, 64, 65, 66, 67], [80, 81, 82, 83, 84, 85, 86]]
  variants:
    - suffix: int8
      method: int8
      granularity: per-channel
      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.01}
    - suffix: lut4
      method: lut
      bits: 4
      granularity: per-grouped-channel
      group_size: 8
      gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}
    - suffix: mixed         # searched once on the window module, then applied to every function
      method: mixed
      search:
        bits: [16, 8, 4]
        budget: {min_top1_agreement: 0.9, max_mean_kl: 0.005}
      gates: {min_top1_agreement: 0.8, max_mean_kl: 0.05}
"""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    return convert_tiny_llama(tmp_path_factory.mktemp("kvcomp"), CACHE + COMPRESSION, "tkv")


def test_every_variant_is_published_with_the_structural_cache_gates(
    run: tuple[Result, Path],
) -> None:
    result, out = run
    assert result.exit_code == 0, result.output
    for suffix in ("int8", "lut4", "mixed"):
        directory = out / f"tkv-{suffix}"
        report = json.loads((directory / "parity.json").read_text())
        kv = {g["name"]: g for g in report["gates"] if g["level"] == "kv-cache"}
        # the fp32 cache level against the decoded weights, the structural fp16 gates
        fp32 = {"fp32_layer_rel_error", "fp32_logits_rel_error", "kv_fp32_max_abs_logit_error",
                "kv_fp32_extend_max_abs_diff", "kv_fp32_stale_max_abs_diff"}  # fmt: skip
        assert set(kv) == {*STRUCTURAL, "kv_weights_identical", *fp32}
        assert all(g["passed"] for g in kv.values())
        assert kv["kv_weights_identical"]["value"] == 0
        # every function per layer against the module holding the decoded weights
        per_layer = {g["name"]: g for g in report["gates"] if g["level"] == "mil-fp32"}
        assert set(per_layer) == {"layer_markers_present", "mil_fp32_layer_rel_error"}
        assert all(g["passed"] for g in per_layer.values()), per_layer
        quality = {(g["name"], g["implementation"]) for g in report["gates"]}
        assert ("min_top1_agreement", "mil-fp16") in quality
        assert ("max_mean_kl", "torch-fp16") in quality
        # the fp16 program's fidelity gates are measured and reported, not gated
        reported = {g["name"] for g in report["kv_cache"]["reported"]}
        assert reported == {"kv_max_abs_dprob", "kv_argmax_flips"}
        hosts = [h for h in HOST_FILES if (out / "tkv" / h).is_file()]
        assert "rope.npy" in hosts  # the host loop's RoPE tables
        for host in hosts:
            assert (directory / host).read_bytes() == (out / "tkv" / host).read_bytes()
        assert not list(out.glob(".anec-tmp-*"))  # the scratch folder is gone


@pytest.mark.parametrize("suffix", ["int8", "lut4"])
def test_the_combined_package_stores_the_compressed_weights_once(
    run: tuple[Result, Path], suffix: str
) -> None:
    from parity.mil import load_package

    _, out = run
    directory = out / f"tkv-{suffix}"
    package = directory / f"tkv-{suffix}.mlpackage"
    program = load_package(package)
    assert sorted(program.functions) == ["decode", "extend", "prefill"]
    # iOS 18 / macOS 15 opset: int8 is constexpr_blockwise_shift_scale, palettes
    # constexpr_lut_to_dense
    kind = "constexpr_blockwise_shift_scale" if suffix == "int8" else "constexpr_lut_to_dense"
    for function in program.functions.values():
        assert kind in {op.op_type for op in function.operations}
    manifest = json.loads((directory / "manifest.json").read_text())
    sizes = manifest["kv_cache"]["sizes"]
    single = sizes["single_function_weight_bytes"]
    assert sizes["multifunction_weight_bytes"] <= 1.05 * max(single.values())
    weights = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    assert weights.stat().st_size == sizes["multifunction_weight_bytes"]
    fp16 = json.loads((out / "tkv" / "manifest.json").read_text())["kv_cache"]["sizes"]
    assert sizes["multifunction_weight_bytes"] < fp16["multifunction_weight_bytes"]
    assert manifest["compression"]["derived_from"]["artifact"] == "tkv"
    # the report says what the NE would read per call, per function (a prediction): the
    # compressed bytes for per-channel int8 and palettes, which stay compressed
    stream = json.loads((directory / "parity.json").read_text())["ne_weight_stream"]
    section = stream[package.name]
    assert section["evidence"] == "predicted"
    assert set(section["functions"]) == {"decode", "extend", "prefill"}
    rule = "S-INT8" if suffix == "int8" else "S-LUT"
    for f in section["functions"].values():
        assert f["by_rule"][rule]["streamed"] == f["by_rule"][rule]["stored"] > 0
    assert "decode: read per call" in (directory / "parity.txt").read_text()


def test_the_same_plan_gives_identical_weight_bytes_in_every_function(
    run: tuple[Result, Path],
) -> None:
    from converter.compression.cached_programs import function_sites, payloads
    from converter.compression.records import weight_records
    from parity.mil import load_package

    _, out = run
    manifest = json.loads((out / "tkv-lut4" / "manifest.json").read_text())
    records = manifest["compression"]["weights"]
    planned = [r["weight"] for r in records if r["method"] == "lut"]
    assert planned  # the tiny model has weights big enough to compress
    program = load_package(out / "tkv-lut4" / "tkv-lut4.mlpackage")
    stored = {WINDOW: {r["weight"]: r["payload_sha256"] for r in records}}
    names = [r["weight"] for r in records]
    from converter.compression.schemes import variant_scheme
    from converter.recipe.compression_section import Variant

    variant = Variant.model_validate(manifest["compression"]["variant"])
    plan = {n: variant_scheme(variant) for n in planned}
    kept = {r["weight"]: r["kept_reason"] for r in records if r["method"] == "fp16"}
    # the sites (torch name -> constant) of the fp16 package: compressed constants are
    # constexpr ops named after them
    fp16 = load_package(out / "tkv" / "tkv.mlpackage")
    for name, function in program.functions.items():
        sites = function_sites(fp16.functions[name], names)
        assert {s.name for s in sites} == set(names)
        got, _ = weight_records(function, sites, plan, kept)
        stored[name] = payloads(got)
    assert set(stored) == {WINDOW, "prefill", "decode", "extend"}
    assert differing(stored) == []
    # the check has teeth: one function's payload changed is named
    stored["extend"] = dict(stored["extend"]) | {planned[0]: "0" * 64}
    assert differing(stored) == [f"{planned[0]} (extend)"]


RULES = """name: r
task: text-generation
source: {kind: hf-dir, path: .}
target: macOS15
fixtures: {token_ids: [[1, 2, 3]]}
cache: {style: state}
compression:
  held_out: [[1, 2, 3, 4]]
"""


@pytest.mark.parametrize("suffix", ["int8", "lut4"])
def test_the_torch_draft_of_a_variant_holds_the_programs_weights(
    run: tuple[Result, Path], suffix: str
) -> None:
    # anec speculate's torch backend: the fp16 module with the variant's decoded weights
    # computes what the program computes (fp16 rounding apart), not what the fp16 module does.
    from converter.drafts.host_loop import Runtime, mil_backend, torch_backend

    _, out = run
    variant = Runtime.from_artifact(out / f"tkv-{suffix}")
    module, program = torch_backend(variant)(), mil_backend(variant)()
    plain = torch_backend(Runtime.from_artifact(out / "tkv"))()
    prompt = [20, 21, 22, 23, 24, 25]
    mine, theirs, unquantized = (s.prefill("prefill", prompt) for s in (module, program, plain))
    for token in (5, 6, 7):
        mine = np.vstack([mine, module.call("decode", [token])[:, -1]])
        theirs = np.vstack([theirs, program.call("decode", [token])[:, -1]])
        unquantized = np.vstack([unquantized, plain.call("decode", [token])[:, -1]])
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()
    assert np.abs(mine - theirs).max() < np.abs(unquantized - theirs).max() / 3


@pytest.mark.parametrize("method", ["w8a8", "outliers", "scaled"])
def test_methods_that_add_ops_stay_refused_for_a_cached_decoder(
    tmp_path: Path, method: str
) -> None:
    variant = {
        "w8a8": "{suffix: a, method: w8a8, granularity: per-channel, "
        "gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}",
        "outliers": "{suffix: a, method: outliers, bits: 4, outlier_columns: 2, "
        "gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}",
        "scaled": "{suffix: a, method: scaled, bits: 4, "
        "gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}",
    }[method]
    file = tmp_path / "r.yaml"
    calibration = "  calibration: [[5, 6, 7, 8]]\n" if method == "w8a8" else ""
    file.write_text(RULES + calibration + f"  variants:\n    - {variant}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    text = str(info.value)
    assert "compression.variants[0].method" in text or "variants.0.method" in text
    assert f"{method} variants of a cached decoder are not implemented" in text


@pytest.mark.parametrize("searched", ["gptq", "skm", "grid"])
def test_a_cached_decoder_s_mixed_search_is_palettes_only(tmp_path: Path, searched: str) -> None:
    """skm / gptq / grid values are written into the window program before the plan is
    applied, and the cached functions receive only the plan: such a search is refused."""
    file = tmp_path / "r.yaml"
    file.write_text(
        RULES + "  calibration: [[5, 6, 7, 8]]\n  variants:\n    - {suffix: a, method: mixed, "
        f"search: {{methods: [lut, {searched}], bits: [16, 8, 4], "
        "budget: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}, "
        "gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert "compression.variants[0].search.methods: a cached decoder's mixed search" in str(
        info.value
    )


def test_int8_and_lut_variants_of_a_cached_decoder_validate(tmp_path: Path) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(
        RULES + "  variants:\n    - {suffix: a, method: int8, granularity: per-channel, "
        "gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}}\n"
    )
    assert load_recipe(file).compression is not None
