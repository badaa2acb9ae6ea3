"""GPTQ for encoders, on tiny perturbed BERTs: calibrated on the recipe's calibration sentences
(never the held-out ones), layer by layer over the program's own right-padded, folded batches
(real slots only), stored as the integers and scales it computed, judged as every encoder
variant is (torch and MIL level against the original and the fp16 artifact).

One conversion (fp16 artifact + three gptq variants) shared by the pipeline tests here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from encoder_models import PAD_ID, build_encoder, random_sequences, tiny_config
from test_compress_encoder import _recipe
from tiny_models import one_torch_thread

from converter.compression.sites import WeightSite
from converter.compression.variant_steps import VariantResult
from converter.pipeline.run import convert
from converter.recipe import RecipeError, load_recipe
from parity.fixtures import Fixture

CALIBRATION = random_sequences(23, (16, 9, 12, 14, 7), first=1)
VARIANTS = [
    {"suffix": "gptq4", "method": "gptq", "bits": 4, "granularity": "per-channel",
     "gates": {"min_cosine": 0.99}},
    {"suffix": "gptq8", "method": "gptq", "bits": 8, "granularity": "per-channel",
     "gates": {"min_cosine": 0.999}},
    {"suffix": "gptq4b32", "method": "gptq", "bits": 4, "granularity": "per-block",
     "group_size": 32, "gates": {"min_cosine": 0.99}},
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[VariantResult], Path]:
    root = tmp_path_factory.mktemp("encgptq")
    path = _recipe(root, "sentence-similarity", VARIANTS, calibration=CALIBRATION)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc | {"target": "macOS15"}))  # int4 constexprs
    result = convert(load_recipe(path), root / "out")
    assert result.passed and result.exit_code == 0
    return result.variants, root / "out"


def _gates(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    report = json.loads((directory / "parity.json").read_text())
    return {(g["name"], g["implementation"]): g for g in report["gates"]}


@pytest.mark.parametrize(("suffix", "bits", "block"), [("gptq4", 4, None), ("gptq8", 8, None),
                                                       ("gptq4b32", 4, 32)])  # fmt: skip
def test_encoder_gptq_variants_store_integers_at_nominal_bits(
    run: tuple[list[VariantResult], Path], suffix: str, bits: int, block: int | None
) -> None:
    results, out = run
    assert {r.suffix: r.passed for r in results} == {v["suffix"]: True for v in VARIANTS}
    directory = out / f"tb-{suffix}"
    manifest = json.loads((directory / "manifest.json").read_text())
    records = [r for r in manifest["compression"]["weights"] if r["method"] != "fp16"]
    assert len(records) == 12  # 3 layers x (qkv, o, up, down)
    for r in records:
        assert r["method"] == "gptq" and r["op"] == "constexpr_blockwise_shift_scale"
        inputs = r["shape"][1]
        scales = 16 / (block or inputs)  # an fp16 scale a row or a block
        assert bits <= r["bits_per_weight"] <= (bits + scales) * 1.05, r
    gates = _gates(directory)
    # both decoders of the stored integers agree, and the program is the uncompressed one
    # holding those weights; judged at torch and MIL level as every encoder variant
    assert gates[("weights_decoded_alike", "mil-fp32")]["value"] == 0
    assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
    for level in ("torch-fp16", "mil-fp16"):
        assert gates[("min_cosine", level)]["passed"]
    report = json.loads((directory / "parity.json").read_text())
    assert report["held_out"]["sentences"] == 3  # the held-out sentences, not the calibration
    assert {lv["implementation"] for lv in report["levels"]} == {"torch-fp16", "mil-fp16"}


def test_the_program_holds_integers_of_the_nominal_width(
    run: tuple[list[VariantResult], Path],
) -> None:
    from coremltools.converters.mil.mil import types

    from parity.mil import load_package

    _, out = run
    for suffix, dtype in (("gptq4", "int4"), ("gptq8", "int8"), ("gptq4b32", "int4")):
        program = load_package(out / f"tb-{suffix}" / f"tb-{suffix}.mlpackage")
        ops = [
            op for op in program.functions["main"].operations
            if op.op_type == "constexpr_blockwise_shift_scale"
        ]  # fmt: skip
        assert len(ops) == 12
        assert {types.builtin_to_string(op.data.dtype) for op in ops} == {dtype}
        blocks = {op.scale.shape[1] * 32 == op.data.shape[1] for op in ops}
        assert blocks == {suffix.endswith("b32")}


# ---- the calibration pass itself, on a tiny BC1L encoder ---------------------------------


@pytest.fixture(scope="module")
def tiny() -> Any:
    return build_encoder(tiny_config("bert"), "sentence-embedding")


def _calibration() -> list[Fixture]:
    return [Fixture(f"calibration[{i}]", tuple(s), "padded") for i, s in enumerate(CALIBRATION)]


def _site(module: Any, name: str) -> WeightSite:
    shape = tuple(module.get_parameter(name).shape)
    return WeightSite(name, name.replace(".", "_") + "_to_fp16", shape, "float16")


def test_encoder_stages_see_real_slots_only(tiny: Any) -> None:
    """Five sentences in batches of three: the second batch's filler row (a repeat of its
    first sentence) and every padded slot are left out of what GPTQ sees."""
    from converter.compression.calibrate import captured, encoder_stages, owners

    stages = encoder_stages(tiny.module, _calibration(), PAD_ID)
    assert len(stages.inputs) == 2 and stages.layers == 3
    name = "layers.0.attention.qkv.weight"
    conv = owners(stages.module, [_site(stages.module, name)])[name]
    seen: list[int] = []
    for b, x in enumerate(stages.inputs):
        with captured({name: conv}, stages.columns[b], lambda n, x, y: seen.append(x.shape[3])):
            stages.run(0, x, b)
    assert seen == [16 + 9 + 12, 14 + 7]


def _layer_error(tiny: Any, name: str, weight: np.ndarray) -> float:
    """Squared output error of a first-layer conv on its calibration inputs with ``weight``."""
    import torch

    from converter.compression.calibrate import captured, encoder_stages, owners

    stages = encoder_stages(tiny.module, _calibration(), PAD_ID)
    conv = owners(stages.module, [_site(stages.module, name)])[name]
    w = torch.from_numpy(weight.astype(np.float32))
    error = 0.0

    def sink(_: str, x: Any, y: Any) -> None:
        nonlocal error
        error += float(((torch.nn.functional.conv2d(x, w, conv.bias) - y) ** 2).sum())

    with torch.no_grad():
        for b, x in enumerate(stages.inputs):
            with captured({name: conv}, stages.columns[b], sink):
                stages.run(0, x, b)
    return error


@pytest.mark.parametrize("block", [None, 32])
def test_encoder_gptq_beats_rounding_to_nearest_on_its_calibration_inputs(
    tiny: Any, block: int | None
) -> None:
    """GPTQ's integers are not round-to-nearest on the same grid (the mutant a stub would be):
    on the conv's calibration inputs its output error is lower."""
    from converter.compression.calibrate import encoder_stages
    from converter.compression.methods.gptq import decode, sequential_gptq

    name = "layers.0.mlp.down.weight"
    site = _site(tiny.module, name)
    stages = encoder_stages(tiny.module, _calibration(), PAD_ID)
    ints, scales = sequential_gptq(stages, [site], {name: 4}, block)
    q, s = ints[name], scales[name]
    assert q.min() >= -8 and q.max() <= 7
    assert s.shape == ((q.shape[0],) if block is None else (q.shape[0], q.shape[1] // block))
    w16 = tiny.module.get_parameter(name).detach().half().float().numpy()
    per = np.repeat(s.astype(np.float32).reshape(q.shape[0], -1), block or q.shape[1], axis=1)
    nearest = np.clip(np.rint(w16 / per[:, :, None, None]), -8, 7).astype(np.int8)
    assert (nearest != q).mean() > 0.01  # GPTQ moved integers
    gptq_err = _layer_error(tiny, name, decode(q, s))
    rtn_err = _layer_error(tiny, name, decode(nearest, s))
    assert gptq_err < 0.9 * rtn_err


def test_a_classifier_head_is_rounded_last_on_its_pooled_inputs() -> None:
    """text-classification: the tail's dense projection is the last stage; its inputs are one
    pooled column per real sentence (the filler row left out)."""
    from converter.compression.calibrate import captured, encoder_stages, owners
    from converter.compression.methods.gptq import sequential_gptq

    t = build_encoder(tiny_config("bert"), "logits")
    name, up = "tail.dense.weight", "layers.2.mlp.up.weight"
    stages = encoder_stages(t.module, _calibration(), PAD_ID)
    assert stages.stage_of(name) == stages.layers == 3
    conv = owners(stages.module, [_site(stages.module, name)])[name]
    before = conv.weight.detach().clone()
    sites = [_site(t.module, name), _site(t.module, up)]
    ints, _ = sequential_gptq(stages, sites, {name: 8, up: 8})
    assert set(ints) == {name, up}
    assert not np.array_equal(conv.weight.detach().numpy(), before.numpy())  # rounded in place
    seen: list[int] = []
    h = list(stages.inputs)
    for i in range(stages.layers):
        h = [stages.run(i, x, b) for b, x in enumerate(h)]
    for b, x in enumerate(h):
        with captured({name: conv}, stages.columns[b], lambda n, x, y: seen.append(x.shape[3])):
            stages.run(stages.layers, x, b)
    assert seen == [3, 2]


# ---- recipe rules ----------------------------------------------------------------------


def test_encoder_calibration_without_a_variant_that_reads_it_is_refused(tmp_path: Path) -> None:
    lut = [{"suffix": "lut8", "method": "lut", "bits": 8, "gates": {"min_cosine": 0.999}}]
    path = _recipe(tmp_path, "sentence-similarity", lut, calibration=CALIBRATION)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "compression.calibration: used by w8a8, mixed, gptq and skm variants only" in str(
        e.value
    )


def test_encoder_calibration_shared_with_held_out_is_refused(tmp_path: Path) -> None:
    """Literal sentences (token ids here) shared with the held-out list, and a sentence of the
    corpus's held-out part given as calibration, are refused; the corpus's two parts are
    disjoint by construction."""
    from converter.compression.corpus import part_sentences
    from converter.recipe.compression_section import Compression

    gptq = [VARIANTS[1]]
    held_out = random_sequences(11, (12, 7, 16), first=1)  # what _recipe writes
    path = _recipe(tmp_path, "sentence-similarity", gptq, calibration=[*CALIBRATION, held_out[1]])
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "compression.calibration: shares 1 text(s) with held_out; keep them apart" in str(
        e.value
    )
    corpus = {"corpus": "pydoc_data", "sentences": 10}
    sentence = part_sentences("held_out")[3]
    with pytest.raises(ValueError, match="shares 1 text"):
        Compression.model_validate(
            {"held_out": corpus, "calibration": ["A sentence of its own.", sentence],
             "variants": gptq}
        )  # fmt: skip
    both = Compression.model_validate({"held_out": corpus, "calibration": corpus, "variants": gptq})
    assert not set(part_sentences("held_out")) & set(part_sentences("calibration"))
    assert both.calibration == both.held_out  # same request, different parts of the corpus


def test_a_block_that_does_not_divide_a_weights_inputs_is_refused_by_name() -> None:
    from types import SimpleNamespace

    from converter.compression.methods.base import Scheme
    from converter.compression.methods.gptq import METHOD
    from converter.errors import InputError

    site = WeightSite("layers.0.mlp.down.weight", "w_to_fp16", (64, 48, 1, 1), "float16")
    ctx: Any = SimpleNamespace(sites=[site])
    variant: Any = SimpleNamespace(suffix="b32", granularity="per-block", group_size=32)
    plan = {site.name: Scheme("gptq", 4, "per-block", 32)}
    with pytest.raises(InputError, match=r"b32: group_size 32 does not divide the inputs of "
                       r"layers\.0\.mlp\.down\.weight"):  # fmt: skip
        METHOD.prepare(ctx, variant, None, plan)
