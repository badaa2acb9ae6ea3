"""Calibrated methods end to end on a tiny perturbed Llama: GPTQ (int4, int8) and sensitive
k-means (lut4 per tensor and per grouped channel) through coremltools' implementations,
calibrated on the calibration text only; the program stores exactly the values they computed
(decoded weights equal the torch result bit for bit) at nominal bits + 5 % at most.

One conversion (fp16 artifact + four variants) shared by every test in this file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import Result
from tiny_models import (
    convert_tiny_llama,
    one_torch_thread,
)

COMPRESSION = """\
target: macOS15
compression:
  held_out: [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41, 42, 43, 44, 45]]
  calibration:
    - [60, 61, 62, 63, 64, 65, 66, 67]
    - [80, 81, 82, 83, 84, 85, 86]
    - [3, 9, 27, 81, 50, 33, 11, 99, 12, 13, 14]
    - [100, 90, 80, 70, 60, 50, 40, 30, 20]
  variants:
    - suffix: gptq4
      method: gptq
      bits: 4
      granularity: per-channel
      gates: {min_top1_agreement: 0.25, max_mean_kl: 0.5}
    - suffix: gptq8
      method: gptq
      bits: 8
      granularity: per-channel
      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.01}
    - suffix: skm4
      method: skm
      bits: 4
      gates: {min_top1_agreement: 0.25, max_mean_kl: 0.5}
    - suffix: skm4g8
      method: skm
      bits: 4
      granularity: per-grouped-channel
      group_size: 8
      gates: {min_top1_agreement: 0.25, max_mean_kl: 0.5}
    - suffix: across
      method: mixed
      search:
        bits: [16, 8, 4]
        methods: [lut, skm, gptq]
        group_sizes: [8]
        budget: {min_top1_agreement: 0.9, max_mean_kl: 0.02}
      gates: {min_top1_agreement: 0.8, max_mean_kl: 0.05}
"""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    return convert_tiny_llama(tmp_path_factory.mktemp("calibrated"), COMPRESSION)


def _report(out: Path, suffix: str) -> dict[str, Any]:
    directory = out / f"tiny-{suffix}"
    if not directory.is_dir():
        directory = out / f"tiny-{suffix}.failed"
    doc: dict[str, Any] = json.loads((directory / "manifest.json").read_text())
    return doc


@pytest.mark.parametrize(
    ("suffix", "bits", "op"),
    [
        ("gptq4", 4, "constexpr_blockwise_shift_scale"),
        ("gptq8", 8, "constexpr_blockwise_shift_scale"),
        ("skm4", 4, "constexpr_lut_to_dense"),
        ("skm4g8", 4, "constexpr_lut_to_dense"),
    ],
)
def test_calibrated_variants_store_their_values_at_nominal_bits(
    run: tuple[Result, Path], suffix: str, bits: int, op: str
) -> None:
    result, out = run
    assert result.exit_code == 0, result.output
    manifest = _report(out, suffix)
    records = [r for r in manifest["compression"]["weights"] if r["method"] != "fp16"]
    assert len(records) == 12
    for r in records:
        assert r["op"] == op
        out_channels, inputs = r["shape"][:2]
        groups = out_channels // 8 if suffix.endswith("g8") else 1
        extra = (
            16 / inputs
            if suffix.startswith("gptq")
            else groups * 2**bits * 16 / (out_channels * inputs)
        )  # a row scale, or the palettes
        assert r["bits_per_weight"] <= (bits + extra) * 1.05, r
        assert r["bits_per_weight"] >= bits


def test_the_search_chooses_across_methods_and_the_program_confirms_it(
    run: tuple[Result, Path],
) -> None:
    """method: mixed over lut / skm / gptq x 8 / 4 bits x per tensor / groups of 8: every
    candidate is measured per weight, the explored plans and frontier are reported, and the
    emitted program holds each weight as its chosen method stores it, judged at MIL level."""
    result, out = run
    assert result.exit_code == 0, result.output
    manifest = _report(out, "across")
    search = manifest["compression"]["search"]
    labels = {"fp16", "lut8", "lut8g8", "lut4", "lut4g8", "skm8", "skm8g8", "skm4", "skm4g8",
              "gptq8", "gptq4"}  # fmt: skip
    assert set(search["search_space"]["candidates"]) == labels
    table = search["sensitivity"]["table"]
    assert len(table) == 12
    # the down projection (64 rows) takes every candidate; all measured
    assert set(table["layers.0.mlp.down.weight"]) == labels
    assert len(search["explored"]) >= len(labels) and search["frontier"]
    chosen = search["chosen"]["bits"]
    records = {r["weight"]: r for r in manifest["compression"]["weights"]}
    from test_compress_pipeline import _tag

    for weight, tag in chosen.items():
        assert _tag(records[weight]) == tag
    report = json.loads((next(out.glob("tiny-across*")) / "parity.json").read_text())
    assert {lv["implementation"] for lv in report["levels"]} >= {"torch-fp16", "mil-fp16"}


# ---- the methods' values, on a tiny BC1L module and a one-conv program ----------------------


@pytest.fixture(scope="module")
def tiny() -> Any:
    from tiny_models import PAD_ID, build_tiny

    from converter.compression.sites import WeightSite

    t = build_tiny()
    sites = [
        WeightSite(n, n.replace(".", "_"), tuple(p.shape), "float16")
        for n, p in t.module.named_parameters()
        if n.startswith("layers.") and p.ndim == 4
    ]
    return t, sites, PAD_ID


def _layer_error(t: Any, name: str, weight: np.ndarray, pad_id: int) -> float:
    """Squared output error of ``name``'s conv on its calibration inputs with ``weight``."""
    import torch

    from converter.compression.calibrate import calibration, captured_inputs, fp16_copy, logits

    work = fp16_copy(t.module)
    cal = calibration(work, t.fixtures[:4], t.embed_table, pad_id)
    conv = dict(work.named_modules())[name.rpartition(".")[0]]
    seen: list[Any] = []
    with torch.no_grad(), captured_inputs({name: conv}, cal.starts, lambda *a: seen.append(a)):
        logits(work, cal)
    x, y = seen[0][1], seen[0][2]
    w = torch.from_numpy(weight.astype(np.float32))
    return float(((torch.nn.functional.conv2d(x, w) - y) ** 2).sum())


def test_gptq_beats_rounding_to_nearest_on_its_calibration_inputs(tiny: Any) -> None:
    """GPTQ's integers are not round-to-nearest on the same grid (the mutant a stub would be):
    on the conv's calibration inputs its output error is lower, for a first-layer weight whose
    inputs no earlier rounding changed."""
    from converter.compression.methods.gptq import decode, gptq_weights

    t, sites, pad_id = tiny
    name = "layers.0.mlp.down.weight"
    site = next(s for s in sites if s.name == name)
    ints, scales = gptq_weights(t.module, [site], {name: 4}, t.fixtures[:4], t.embed_table, pad_id)
    q, s = ints[name], scales[name]
    assert q.min() >= -8 and q.max() <= 7
    w16 = t.module.get_parameter(name).detach().half().float().numpy()
    nearest = np.clip(np.rint(w16 / s.astype(np.float32)[:, None, None, None]), -8, 7)
    assert (nearest != q).mean() > 0.01  # GPTQ moved integers
    gptq_err = _layer_error(t, name, decode(q, s), pad_id)
    rtn_err = _layer_error(t, name, decode(nearest.astype(np.int8), s), pad_id)
    assert gptq_err < 0.9 * rtn_err


def test_skm_weights_use_the_calibration_sensitivity(tiny: Any) -> None:
    """SKM's palette differs from plain k-means of the same weight (the Fisher weights move
    the centroids) and holds at most 16 values per group of 8 rows."""
    from converter.compression.methods.base import Scheme
    from converter.compression.methods.skm import skm_weights
    from converter.compression.search import palette

    t, sites, pad_id = tiny
    name = "layers.1.mlp.gate_up.weight"
    site = next(s for s in sites if s.name == name)
    scheme = Scheme("skm", 4, "per-grouped-channel", 8)
    got = skm_weights(t.module, [site], {name: scheme}, t.fixtures[:4], t.embed_table, pad_id)
    w = got[name]
    for g in range(0, w.shape[0], 8):
        assert np.unique(w[g : g + 8].view(np.uint16)).size <= 16
    plain = palette(t.module.get_parameter(name).detach().half().numpy(), 4)
    assert not np.array_equal(w, plain)


def _one_conv_model(weight: np.ndarray) -> Any:
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    shape = (1, weight.shape[1], 1, 4)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)], opset_version=ct.target.iOS18)
    def prog(x: Any) -> Any:
        w = mb.const(val=weight.astype(np.float16), name="w_to_fp16")
        return mb.conv(x=mb.cast(x=x, dtype="fp16"), weight=w, name="y")

    return ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16, skip_model_load=True,
    )  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_integers_are_stored_as_computed(bits: int) -> None:
    """write_integers: the program decodes to the integers times the fp16 scales, bit for bit,
    with int{bits} data."""
    from converter.compression.integer_weights import write_integers
    from converter.compression.methods.gptq import decode, row_integers
    from converter.compression.records import decoded_weight

    rng = np.random.default_rng(0)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = rng.integers(lo, hi, size=(48, 64, 1, 1)).astype(np.int8)
    s = (rng.random(48) * 0.01 + 1e-3).astype(np.float16)
    model = write_integers(
        _one_conv_model(np.zeros(q.shape)), {"w_to_fp16": row_integers(q, s, bits)}
    )
    function = model._mil_program.functions["main"]
    (op,) = [o for o in function.operations if o.op_type.startswith("constexpr_")]
    from coremltools.converters.mil.mil import types

    assert types.builtin_to_string(op.data.dtype) == f"int{bits}"
    np.testing.assert_array_equal(
        decoded_weight(function, "w_to_fp16"), decode(q, s).astype(np.float16)
    )


def test_skm_tables_store_the_values_exactly() -> None:
    """The skm storage keeps each group's distinct fp16 values as its table (no second
    clustering) at 4-bit indices, even where numpy's float16 unique miscounts."""
    from converter.compression.methods.base import Scheme
    from converter.compression.methods.skm import METHOD as SKM
    from converter.compression.records import decoded_weight

    rng = np.random.default_rng(1)
    tables = rng.standard_normal((6, 16)).astype(np.float16) * 0.1
    w = np.stack([tables[g // 8][rng.integers(0, 16, 64)] for g in range(48)])
    w = w.reshape(48, 64, 1, 1)
    scheme = Scheme("skm", 4, "per-grouped-channel", 8)
    model = SKM.apply(_one_conv_model(w), {"w_to_fp16": SKM.ct_config(scheme)})
    function = model._mil_program.functions["main"]
    np.testing.assert_array_equal(decoded_weight(function, "w_to_fp16"), w)
    (op,) = [o for o in function.operations if o.op_type == "constexpr_lut_to_dense"]
    from coremltools.converters.mil.mil import types

    assert types.builtin_to_string(op.indices.dtype) == "uint4"


def test_skm_sensitivity_equals_coremltools_own(tiny: Any) -> None:
    """`fisher_sensitivity` (gradients of the compressed weights only, no copies of the
    model) gives coremltools' ``SKMPalettizer.compute_sensitivity`` values for them."""
    import torch
    from coremltools.optimize.torch.palettization import SKMPalettizer, SKMPalettizerConfig

    from converter.compression.calibrate import calibration, fp16_copy, next_token_loss
    from converter.compression.methods.base import quiet_progress
    from converter.compression.methods.skm import fisher_sensitivity

    t, _, pad_id = tiny
    names = ["layers.0.attention.qkv.weight", "layers.1.mlp.down.weight"]
    work = fp16_copy(t.module)
    items = [calibration(work, [f], t.embed_table, pad_id) for f in t.fixtures[:3]]
    ours = fisher_sensitivity(work, names, items, next_token_loss)
    assert all(not p.requires_grad and p.grad is None for p in work.parameters())

    theirs_model = fp16_copy(t.module)
    for name, p in theirs_model.named_parameters():
        p.requires_grad_(name in names)
    with quiet_progress():
        theirs = SKMPalettizer(theirs_model, SKMPalettizerConfig()).compute_sensitivity(
            items, next_token_loss
        )
    assert sorted(theirs) == sorted(names)
    for name in names:
        assert ours[name].shape == theirs[name].shape
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=0)
        assert float(ours[name].max()) == 1.0
