"""Compressed variants end to end on a tiny perturbed Llama: one artifact per variant with its
own manifest records, size report and parity report; a failing variant blocks only itself.

One conversion (fp16 artifact + three variants) shared by every test in this file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import Result
from tiny_models import (
    INT8_COMPRESSION,
    convert_tiny_llama,
    one_torch_thread,
    run_anec,
)

from converter.pipeline.hashing import mlpackage_content_hash, sha256_file
from converter.pipeline.manifest import Manifest
from converter.recipe.compression_section import DEFAULT_KEEP_FP16
from graph_passes.logits_layout import join_logits

# The variants, appended to the tiny recipe (tiny_models.tiny_recipe).
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
      gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}
    - suffix: lut2-strict
      method: lut
      bits: 2
      # a 2-bit palette cannot keep KL below 1e-9: this variant must fail, alone
      gates: {min_top1_agreement: 0.5, max_mean_kl: 1.0e-9}
    - suffix: w8a8
      method: w8a8
      granularity: per-channel
      activations_keep_fp16: ["layers.0.mlp.down*"]
      gates: {min_top1_agreement: 0.8, max_mean_kl: 0.05}
    - suffix: w8a8-smooth
      method: w8a8
      granularity: per-channel
      smooth: true
      gates: {min_top1_agreement: 0.8, max_mean_kl: 0.05}
    - suffix: outliers
      method: outliers
      bits: 4
      outlier_columns: 2
      gates: {min_top1_agreement: 0.5, max_mean_kl: 0.5}
    - suffix: scaled
      method: scaled
      bits: 4
      # the tiny model's random rows share one range, so scaling buys nothing here (measured:
      # top-1 0.375 on 16 positions); the test is about the rewrite's exactness and bytes
      gates: {min_top1_agreement: 0.25, max_mean_kl: 0.5}
    - suffix: mixed
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
    return convert_tiny_llama(tmp_path_factory.mktemp("compress"), COMPRESSION)


def _manifest(directory: Path) -> Manifest:
    return Manifest.model_validate_json((directory / "manifest.json").read_text())


def test_a_failing_variant_exits_1_and_blocks_only_itself(run: tuple[Result, Path]) -> None:
    result, out = run
    assert result.exit_code == 1, result.output
    assert (out / "tiny" / "manifest.json").is_file()
    assert (out / "tiny-int8" / "manifest.json").is_file()
    assert (out / "tiny-lut4" / "manifest.json").is_file()
    assert not (out / "tiny-lut2-strict").exists()
    failed = out / "tiny-lut2-strict.failed"
    report = json.loads((failed / "parity.json").read_text())
    assert report["passed"] is False
    failing = {(g["name"], g["implementation"]) for g in report["gates"] if not g["passed"]}
    assert ("max_mean_kl", "torch-fp16") in failing and ("max_mean_kl", "mil-fp16") in failing


def test_anec_parity_refuses_a_compressed_variant_naming_why(
    run: tuple[Result, Path], tmp_path: Path
) -> None:
    _, out = run
    result = run_anec("parity", out / "tiny-int8", "--out", tmp_path / "re")
    assert result.exit_code == 2
    assert "tiny-int8: a compressed variant" in result.stderr
    assert not (tmp_path / "re").exists()


@pytest.mark.parametrize("suffix", ["int8", "lut4"])
def test_variant_manifest_records_every_weight_and_hashes_match(
    run: tuple[Result, Path], suffix: str
) -> None:
    _, out = run
    directory = out / f"tiny-{suffix}"
    manifest = _manifest(directory)
    assert manifest.name == f"tiny-{suffix}"
    assert manifest.package.content_sha256 == mlpackage_content_hash(
        directory / manifest.package.file
    )
    assert manifest.parity.sha256 == sha256_file(directory / "parity.json")
    assert manifest.compression is not None
    records = {r["weight"]: r for r in manifest.compression["weights"]}
    # 3 layers x (qkv, o, gate_up, down) + 3 LM-head chunks of 128 tokens
    assert len(records) == 15
    for name, record in records.items():
        if name.startswith("lm_head"):
            assert record["method"] == "fp16" and "lm_head*" in record["kept_reason"]
        else:
            assert record["method"] == ("int8" if suffix == "int8" else "lut")
            assert record["op"] == (
                "constexpr_affine_dequantize" if suffix == "int8" else "constexpr_lut_to_dense"
            )
    expected_bits = 8 if suffix == "int8" else 4
    size = manifest.compression["size"]
    # payload bits plus the tables / scales: slightly above the nominal width
    assert expected_bits < size["compressed_bits_per_weight"] < expected_bits + 1
    assert size["compressed_weights"] == 12 and size["kept_fp16_weights"] == 3


def test_lut4_records_rebuild_the_same_decoded_weights(run: tuple[Result, Path]) -> None:
    """The decoded-value hashes in the manifest match the program's weights decoded by the
    MIL evaluator's own kernel (a second, independent decoder)."""
    import hashlib

    from parity.mil import Evaluator, load_package

    _, out = run
    directory = out / "tiny-lut4"
    manifest = _manifest(directory)
    assert manifest.compression is not None
    evaluator = Evaluator(load_package(directory / "tiny-lut4.mlpackage"), "fp32")
    constants = evaluator._constants
    for record in manifest.compression["weights"]:
        if record["method"] != "lut":
            continue
        value = constants[record["const"] + "_palettized"].astype(np.float16)
        # Distinct values counted in float32: numpy 2.4.6 sorts float16 arrays wrongly on
        # this machine (np.unique of 16 distinct fp16 values returned 22), float32 correctly.
        assert len(np.unique(value.astype(np.float32))) <= 16
        assert hashlib.sha256(value.tobytes()).hexdigest() == record["decoded_sha256"]


def test_parity_reports_both_levels_against_both_baselines(run: tuple[Result, Path]) -> None:
    _, out = run
    report = json.loads((out / "tiny-int8" / "parity.json").read_text())
    assert report["passed"] is True
    levels = {level["implementation"]: level for level in report["levels"]}
    assert set(levels) == {"torch-fp16", "mil-fp16"}
    # every real position of both held-out sequences, at both levels (MIL: the all-positions
    # program, one evaluation per sequence)
    assert levels["torch-fp16"]["against_original"]["positions"] == 16
    assert levels["mil-fp16"]["against_original"]["positions"] == 16
    assert levels["mil-fp16"]["against_fp16_artifact"]["positions"] == 16
    assert report["held_out"] == {
        "source": "the recipe's own texts", "texts": 2, "positions": 16,
        "mil": "every position (all-positions program)",
    }  # fmt: skip
    # the logit PSNR beside top-1 and KL, at both levels, against both baselines
    for level in levels.values():
        for against in ("against_original", "against_fp16_artifact"):
            psnr = level[against]["psnr_db"]
            assert psnr["count"] == 16 and 20 < psnr["min_db"] <= psnr["median_db"]
    assert "PSNR dB" in (out / "tiny-int8" / "parity.txt").read_text()
    gates = {(g["name"], g["implementation"]): g for g in report["gates"]}
    assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
    assert "storage ratios" in (out / "tiny-int8" / "parity.txt").read_text()
    # one decode-error row per compressed weight, worst first, and the table in the text
    rows = report["weight_errors"]
    assert len(rows) == 12 and all(0 < r["rel_error"] < 0.05 for r in rows)
    assert [r["rel_error"] for r in rows] == sorted((r["rel_error"] for r in rows), reverse=True)
    assert "peak kept" in (out / "tiny-int8" / "parity.txt").read_text()
    # the HTML report too, as every artifact's: its levels against both baselines, its gates
    html = (out / "tiny-int8" / "parity.html").read_text()
    assert "<title>anec parity report: tiny-int8</title>" in html
    assert "against the fp16 artifact" in html and "mil-fp16" in html
    assert "min_top1_agreement" in html and "argmax_agreement " in html


def test_default_keep_patterns_cover_norms_embeddings_and_head() -> None:
    assert {"*norm*", "embed*", "lm_head*"} == set(DEFAULT_KEEP_FP16)


def test_mixed_search_reports_its_frontier_and_emits_a_plan_within_budget(
    run: tuple[Result, Path],
) -> None:
    _, out = run
    manifest = _manifest(out / "tiny-mixed")
    assert manifest.compression is not None
    search = manifest.compression["search"]
    assert search["chosen"]["meets_budget"] is True
    assert len(search["sensitivity"]["table"]) == 12
    explored = search["explored"]
    assert explored and search["frontier"]
    # the frontier is Pareto: bytes up, KL strictly down
    frontier = search["frontier"]
    assert all(
        a["weight_bytes"] < b["weight_bytes"] for a, b in zip(frontier, frontier[1:], strict=False)
    )
    assert all(a["mean_kl"] > b["mean_kl"] for a, b in zip(frontier, frontier[1:], strict=False))
    # nothing explored that meets the budget is smaller than the chosen plan
    meeting = [p["weight_bytes"] for p in explored if p["meets_budget"]]
    assert search["chosen"]["weight_bytes"] == min(meeting)
    # the emitted program holds exactly the chosen candidates ("fp16", "lut8", ...)
    tags = {r["weight"]: _tag(r) for r in manifest.compression["weights"]}
    for name, tag in search["chosen"]["bits"].items():
        assert tags[name] == tag


def _tag(record: dict[str, object]) -> str:
    """A weight record as a search candidate label: fp16, lut8, skm4g8, gptq4."""
    if record["method"] == "fp16":
        return "fp16"
    group = f"g{record['group_size']}" if record["group_size"] else ""
    return f"{record['method']}{record['bits']}{group}"


def test_w8a8_quantizes_projection_inputs_and_torch_matches_the_program(
    run: tuple[Result, Path],
) -> None:
    _, out = run
    directory = out / "tiny-w8a8"
    manifest = _manifest(directory)
    assert manifest.compression is not None
    activations = manifest.compression["activations"]
    quantized = activations["quantized_inputs"]
    # the inputs of the 12 compressed projections but the one the recipe keeps, not the LM head
    assert len(quantized) == 11
    assert activations["kept_fp16_inputs"] == ["layers.0.mlp.down.weight"]
    assert "layers.0.mlp.down.weight" not in {q["weight"] for q in quantized}
    text = (directory / "parity.txt").read_text()
    assert "Activation inputs: 11 int8 (the widest below), 1 kept fp16" in text
    assert all(q["scale"] and q["rmax"] > q["rmin"] for q in quantized)
    assert "residual stream" in activations["kept_fp16"]
    assert "A17 Pro / M4" in activations["pays_on"]
    assert manifest.package.live_ops.get("quantize") == 11
    assert manifest.package.live_ops.get("dequantize") == 11
    report = json.loads((directory / "parity.json").read_text())
    gates = {(g["name"], g["implementation"]): g for g in report["gates"]}
    # each int8 quantizer of the program is the torch fake-quantizer, bit for bit
    assert gates[("activation_quantizers_alike", "mil-fp32")]["value"] == 0
    assert ("mil_fp32_layer_rel_error", "mil-fp32") not in gates  # reported: codes flip
    assert report["passed"] is True


def test_the_all_positions_program_holds_the_same_weights_and_scores_every_position(
    run: tuple[Result, Path],
) -> None:
    """The MIL level's all-positions copy: the emitted lut4 program with its last-position
    slice removed. Its constants are byte-identical, and position p gives the logits the
    emitted program gives for the window ending at p (left-padded, as the engine runs it)."""
    from graph_passes.masks import MASKED
    from parity.compression_gates import all_positions
    from parity.mil import Evaluator, load_package

    _, out = run
    package = out / "tiny-lut4" / "tiny-lut4.mlpackage"
    emitted, every = load_package(package), load_package(package)

    def constants(program: object) -> dict[str, bytes]:
        ops = program.functions["main"].operations  # type: ignore[attr-defined]
        return {
            v.name: np.asarray(v.val).tobytes()
            for op in ops
            if op.op_type == "const" or op.op_type.startswith("constexpr_")
            for v in (op.outputs if op.op_type == "const" else op.inputs.values())
            if v.val is not None
        }

    before = constants(every)
    assert all_positions(every) == 16
    assert constants(every) == before
    assert all_positions(every) == 16  # already all positions: nothing left to cut
    last, full = Evaluator(emitted, "fp32"), Evaluator(every, "fp32")
    (x_name, (_, x_shape)), (mask_name, _) = last.inputs.items()
    assert x_shape is not None and x_shape[:2] == (1, 16)  # host-side embedding rows (1, L, D)
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    mask = np.zeros((1, 16), np.float32)
    got = join_logits(full.run({x_name: x, mask_name: mask}).outputs)  # (1, n, V)
    assert got.shape[1] == 16
    for p in (15, 9, 3):
        shift = 15 - p  # the window ending at p, left-padded to 16 slots
        x_p = np.concatenate([np.zeros((1, shift, x_shape[2]), np.float32), x[:, : p + 1]], 1)
        mask_p = np.where(np.arange(16) < shift, MASKED, 0.0)[None].astype(np.float32)
        want = last.run({x_name: x_p, mask_name: mask_p}).outputs
        want_p = join_logits(want)[0, -1]
        # the last slot: the same computation; earlier ones move RoPE slots and padding, so
        # only rounding differs (a position off by one differs by the logits' own scale, ~1)
        tolerance = 1e-5 if p == 15 else 2e-3
        np.testing.assert_allclose(got[0, p], want_p, rtol=0, atol=tolerance)


def test_outliers_keep_their_columns_exact_and_count_every_byte(run: tuple[Result, Path]) -> None:
    """method: outliers - lut4 plus each weight's 2 largest-|w| input columns exact through a
    second fp16 conv: the program holds one gather + conv + add per weight, the records count
    the residual columns and indices (stored <= nominal + 5 %), and the program in fp32
    computes the same function as torch with the hook (without it the fp32 gate fails)."""
    from parity.mil import load_package

    _, out = run
    directory = out / "tiny-outliers"
    report = json.loads((directory / "parity.json").read_text())
    assert report["passed"] is True, report["gates"]
    gates = {(g["name"], g["implementation"]): g for g in report["gates"]}
    assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
    manifest = _manifest(directory)
    assert manifest.compression is not None
    records = [r for r in manifest.compression["weights"] if r["method"] == "lut"]
    lut4 = {r["weight"]: r for r in _manifest(out / "tiny-lut4").compression["weights"]}  # type: ignore[index]
    columns = manifest.compression["outliers"]["columns"]
    assert len(records) == 12 and set(columns) == {r["weight"] for r in records}
    for r in records:
        out_channels, inputs = r["shape"][:2]
        extra = out_channels * 2 * 2 + 2 * 4  # (O x 2) fp16 residual + 2 int32 indices
        assert r["stored_bytes"] == lut4[r["weight"]]["stored_bytes"] + extra
        nominal = 4 + 2 * 16 / inputs  # 4-bit indices + 2 exact fp16 columns per row
        assert r["bits_per_weight"] <= nominal * 1.05
    ops = manifest.package.live_ops
    assert ops.get("gather", 0) >= 12 and ops["add"] >= 12
    program = load_package(directory / "tiny-outliers.mlpackage")
    names = {op.name for op in program.functions["main"].operations}
    assert sum(n.endswith("_outlier_conv") for n in names) == 12


def test_w8a8_smoothing_folds_are_recorded_and_exact(run: tuple[Result, Path]) -> None:
    """smooth: true - every quantized input's scales (powers of two) folded into what produces
    it: MLP down inputs into the up rows, o inputs into the value rows (one scale per kv head
    channel for the query heads sharing it), q/k/v and gate/up inputs into the norm gains.
    Recorded per projection, and the folded fp16 program and the folded torch module compute
    what the unfolded ones compute, bit for bit (the folds move no rounding)."""
    import coremltools as ct
    import torch

    from converter.checkpoints.loading import load_checkpoint
    from converter.compression.sites import weight_sites
    from converter.compression.smooth import (
        folded_constants,
        replace_constants,
        scale_tensors,
        smooth,
    )
    from converter.recipe import load_recipe
    from converter.tasks.text_generation import rewrite_decoder
    from parity.mil import Evaluator, load_package

    _, out = run
    directory = out / "tiny-w8a8-smooth"
    report = json.loads((directory / "parity.json").read_text())
    assert report["passed"] is True, report["gates"]
    section = report["smoothing"]
    assert section["alpha"] == 0.5 and section["not_folded"] == {}
    kinds: dict[str, list[str]] = {}
    for fold in section["folds"]:
        kinds.setdefault(fold["kind"], []).append(fold["projection"])
    layers = range(3)
    assert kinds["mlp-down"] == [f"layers.{i}.mlp.down.weight" for i in layers]
    assert kinds["attention-o"] == [f"layers.{i}.attention.o.weight" for i in layers]
    assert sorted(kinds["norm"]) == sorted(
        f"layers.{i}.{p}.weight" for i in layers for p in ("attention.qkv", "mlp.gate_up")
    )
    down = next(f for f in section["folds"] if f["kind"] == "mlp-down")
    assert down["divided"] == ["layers.0.mlp.gate_up.weight"]
    assert "power of two" in down["why_exact"]
    assert "smoothing (alpha 0.5): 12 folds" in (directory / "parity.txt").read_text()
    gates = {(g["name"], g["implementation"]): g for g in report["gates"]}
    assert gates[("activation_quantizers_alike", "mil-fp32")]["value"] == 0
    assert gates[("weights_decoded_alike", "mil-fp32")]["value"] == 0

    recipe = load_recipe(out.parent / "tiny.yaml")
    module = rewrite_decoder(recipe, load_checkpoint(recipe.resolve_source(), recipe.task)).module
    package = out / "tiny" / "tiny.mlpackage"
    program = load_package(package)
    function = program.functions["main"]
    sites = weight_sites(function, [n for n, _ in module.named_parameters()])
    evaluator = Evaluator(program, "fp16")
    (x_name, (_, x_shape)), (mask_name, _) = evaluator.inputs.items()
    rng = np.random.default_rng(1)
    feeds = [
        {x_name: rng.standard_normal(x_shape).astype(np.float32) * 3, mask_name: np.zeros((1, 16))}
        for _ in range(2)
    ]
    projections = [s for s in sites if s.name.startswith("layers.")]
    smoothing = smooth(function, module, sites, projections, evaluator, feeds)
    assert {f.kind for f in smoothing.folds} == {"mlp-down", "attention-o", "norm"}
    assert all((f.scales != 1).any() for f in smoothing.folds)
    o = next(f for f in smoothing.folds if f.kind == "attention-o")
    # query heads 0 and 1 read kv head 0: their 16 channels share one scale each
    np.testing.assert_array_equal(o.scales[:16], o.scales[16:32])

    model = ct.models.MLModel(str(package), skip_model_load=True)
    folded = replace_constants(model, folded_constants(function, smoothing.folds))
    other = Evaluator(folded._mil_program, "fp16")
    for feed in feeds:
        a = evaluator.run(feed).outputs
        b = other.run(feed).outputs
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])

    x = torch.from_numpy(feeds[0][x_name]).float()
    mask = torch.zeros(x.shape[0], x_shape[-1])
    before = [t.clone() for t in module(x, mask)]
    state = {k: v.clone() for k, v in module.state_dict().items()}
    scale_tensors(module, smoothing.folds, set())
    after = module(x, mask)
    scale_tensors(module, smoothing.folds, set(), inverse=True)
    for a_, b_ in zip(before, after, strict=True):
        torch.testing.assert_close(b_, a_, rtol=0, atol=0)
    for k, v in module.state_dict().items():
        assert torch.equal(v, state[k]), k


def program_parameter_names(function: object) -> list[tuple[str, str]]:
    """(torch-style name, const) of every ``*_weight_to_fp16`` constant: ``layers_0_mlp_down
    _weight_to_fp16`` -> ``layers.0.mlp.down.weight``."""
    out = []
    for op in function.operations:  # type: ignore[attr-defined]
        name = op.outputs[0].name if op.outputs else ""
        if op.op_type == "const" and name.endswith("_weight_to_fp16"):
            stem = name[: -len("_to_fp16")]
            parts = stem.split("_")
            torch_name = ".".join(parts[:-1]).replace("gate.up", "gate_up") + ".weight"
            out.append((torch_name, name))
    return out


def test_scaled_rows_are_an_exact_rewrite_with_every_byte_counted(
    run: tuple[Result, Path],
) -> None:
    """method: scaled - each row divided by a power of two, palettized (lut4), multiplied back
    after the conv: the program holds one mul per weight, records count the scales (stored <=
    4 bits + 5 % with them), and the program in fp32 computes what torch computes with the
    same decoded rows and the scales applied by a hook (without it the fp32 gate fails)."""
    _, out = run
    directory = out / "tiny-scaled"
    report = json.loads((directory / "parity.json").read_text())
    assert report["passed"] is True, report["gates"]
    gates = {(g["name"], g["implementation"]): g for g in report["gates"]}
    assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
    manifest = _manifest(directory)
    assert manifest.compression is not None
    records = [r for r in manifest.compression["weights"] if r["method"] == "lut"]
    lut4 = {r["weight"]: r for r in _manifest(out / "tiny-lut4").compression["weights"]}  # type: ignore[index]
    assert len(records) == 12
    for r in records:
        assert r["stored_bytes"] == lut4[r["weight"]]["stored_bytes"] + r["shape"][0] * 2
        inputs = r["shape"][1]
        nominal = 4 + 16 / inputs  # 4-bit indices + one fp16 scale per row
        assert r["bits_per_weight"] <= nominal * 1.05
    scales = manifest.compression["row_scales"]
    assert scales["log2_min"] < 0  # the tiny weights' rows are scaled up (max |w| < 1)
    assert manifest.package.live_ops["mul"] >= 12


def test_the_variant_fp32_level_compares_each_layer(
    run: tuple[Result, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mil-fp32 holds a variant's program to its decoded weights per layer, not only on the
    logits: the shared conversion's int8 variant passes, every layer compared; a baseline
    whose layer 1 holds other weights than the program's is worst there, and the gate names
    that layer."""
    import torch

    import parity.compression_gates as compression_gates

    _, out = run
    report = json.loads((out / "tiny-int8" / "parity.json").read_text())
    (fp32,) = [g for g in report["gates"] if g["name"] == "mil_fp32_layer_rel_error"]
    assert fp32["passed"] and fp32["where"].split(", ")[-1].startswith(("layer ", "logits"))
    copy = compression_gates.float64_program_copy

    def altered(*args: object, **kwargs: object) -> torch.nn.Module:
        baseline = copy(*args, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            baseline.get_parameter("layers.1.mlp.down.weight").mul_(1.01)
        return baseline

    monkeypatch.setattr(compression_gates, "float64_program_copy", altered)
    result, again = convert_tiny_llama(tmp_path, INT8_COMPRESSION)
    assert result.exit_code == 1, result.output
    report = json.loads((again / "tiny-int8.failed" / "parity.json").read_text())
    (fp32,) = [g for g in report["gates"] if g["name"] == "mil_fp32_layer_rel_error"]
    assert not fp32["passed"] and fp32["where"].endswith(", layer 1"), fp32
