"""Compressed variants of an encoder artifact on tiny perturbed BERTs, through the conversion
pipeline: gated on the cosine of the task output (and argmax for a classifier) at torch and MIL
level, one artifact per variant; a failing variant blocks only itself (exit code 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from encoder_models import hf_model, random_sequences, tiny_config
from tiny_models import one_torch_thread

from converter.checkpoints.loading import load_checkpoint
from converter.compression.encoder_variants import prepare_encoder_held_out
from converter.compression.variant_steps import VariantResult
from converter.pipeline.hashing import mlpackage_content_hash
from converter.pipeline.manifest import Manifest
from converter.pipeline.run import convert
from converter.recipe import EncoderOptions, Recipe, RecipeError, load_recipe
from converter.tasks.encoder import rewrite_encoder
from parity.fixtures import pad_id

BATCH, LENGTH = 2, 16
VARIANTS = [
    {"suffix": "int8", "method": "int8", "granularity": "per-channel",
     "gates": {"min_cosine": 0.999}},
    {"suffix": "lut8", "method": "lut", "bits": 8, "gates": {"min_cosine": 0.999}},
    # a 2-bit palette cannot keep every sentence within 1e-4 of the original: must fail, alone
    {"suffix": "lut2-strict", "method": "lut", "bits": 2, "gates": {"min_cosine": 0.9999}},
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def _recipe(
    root: Path, task: str, variants: list[dict[str, Any]], name: str = "tb", labels: int = 3,
    **extra: Any,
) -> Path:  # fmt: skip
    model = hf_model(tiny_config("bert", num_labels=labels), task == "text-classification")
    model.save_pretrained(root / name)
    doc = {
        "name": name,
        "task": task,
        "source": {"kind": "hf-dir", "path": str(root / name)},
        "shapes": {"batch": BATCH, "sequence_length": LENGTH},
        "fixtures": {
            "token_ids": random_sequences(7, (5, 16, 9), first=1),
            "padded_variants": False,
        },
        "encoder": {"partition": "single"},
        "compression": {
            "held_out": random_sequences(11, (12, 7, 16), first=1),
            "variants": variants,
            **extra,
        },
    }
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def _variants(recipe: Recipe, out: Path) -> list[VariantResult]:
    """The encoder conversion with its compression section: the fp16 artifact, then each
    variant (`emit_encoder_variants`); exit code 1 when a variant fails."""
    result = convert(recipe, out)
    assert result.passed and result.exit_code == (
        0 if all(v.passed for v in result.variants) else 1
    )
    return result.variants


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[VariantResult], Path]:
    root = tmp_path_factory.mktemp("enc")
    recipe = load_recipe(_recipe(root, "sentence-similarity", VARIANTS))
    return _variants(recipe, root / "out"), root / "out"


def _gates(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    report = json.loads((directory / "parity.json").read_text())
    return {(g["name"], g["implementation"]): g for g in report["gates"]}


def test_int8_and_lut8_pass_their_cosine_gates_at_torch_and_mil_level(
    run: tuple[list[VariantResult], Path],
) -> None:
    results, out = run
    assert [(r.suffix, r.passed) for r in results] == [
        ("int8", True), ("lut8", True), ("lut2-strict", False)
    ]  # fmt: skip
    for suffix in ("int8", "lut8"):
        gates = _gates(out / f"tb-{suffix}")
        for level in ("torch-fp16", "mil-fp16"):
            g = gates[("min_cosine", level)]
            assert g["threshold"] == 0.999 and 0.999 <= g["value"] < 1.0 and g["passed"]
        # compression is in the weights only: the program equals the uncompressed one
        # holding the same decoded weights, and both decoders of the weights agree
        assert gates[("mil_fp32_layer_rel_error", "mil-fp32")]["value"] <= 1e-5
        assert gates[("weights_decoded_alike", "mil-fp32")]["value"] == 0
        text = (out / f"tb-{suffix}" / "parity.txt").read_text()
        assert "held_out[2]" in text and "storage ratios" in text
        # PSNR of each sentence's output beside the cosine, both levels, both baselines
        report = json.loads((out / f"tb-{suffix}" / "parity.json").read_text())
        assert report["held_out"]["source"] == "the recipe's own texts"
        for level in report["levels"]:
            for against in ("against_original", "against_fp16_artifact"):
                psnr = level[against]["psnr_db"]
                assert psnr["count"] == report["held_out"]["sentences"]
                assert 20 < psnr["min_db"] <= psnr["median_db"]
        assert "PSNR dB" in text


def test_a_failing_variant_blocks_only_itself(run: tuple[list[VariantResult], Path]) -> None:
    _, out = run
    assert (out / "tb" / "manifest.json").is_file()
    assert not (out / "tb-lut2-strict").exists()
    gates = _gates(out / "tb-lut2-strict.failed")
    failing = {key for key, g in gates.items() if not g["passed"]}
    assert failing == {("min_cosine", "torch-fp16"), ("min_cosine", "mil-fp16")}
    assert gates[("min_cosine", "mil-fp16")]["value"] < 0.99


def test_variant_manifest_records_every_projection(run: tuple[list[VariantResult], Path]) -> None:
    _, out = run
    directory = out / "tb-lut8"
    manifest = Manifest.model_validate_json((directory / "manifest.json").read_text())
    assert manifest.name == "tb-lut8" and manifest.encoder is not None
    assert manifest.package.content_sha256 == mlpackage_content_hash(
        directory / manifest.package.file
    )
    assert manifest.compression is not None
    records = manifest.compression["weights"]
    # 3 layers x (qkv, o, up, down) palettized; their biases (conv inputs too) stay fp16,
    # below min_weight_elements
    lut = [r for r in records if r["method"] == "lut"]
    kept = [r for r in records if r["method"] == "fp16"]
    assert len(lut) == 12 and len(kept) == 12 and len(records) == 24
    assert all(r["weight"].endswith(".weight") for r in lut)
    assert {r["op"] for r in lut} == {"constexpr_lut_to_dense"}
    assert all(r["weight"].endswith(".bias") and "min_weight_elements" in r["kept_reason"]
               for r in kept)  # fmt: skip
    assert "embedding tables" in manifest.compression["not_compressed"]
    report = json.loads((directory / "parity.json").read_text())
    levels = {level["implementation"]: level for level in report["levels"]}
    assert set(levels) == {"torch-fp16", "mil-fp16"}
    assert len(levels["mil-fp16"]["against_original"]["cosine"]) == 3


def test_the_fp32_level_sees_weights_and_decoders_that_differ(
    run: tuple[list[VariantResult], Path],
) -> None:
    """The mil-fp32 level compares the variant program with the uncompressed one holding the
    evaluator's decoding of the variant's weights: without that substitution the two differ
    by the compression error; a decoded weight other than the program's is counted."""
    from parity.encoder_compression_gates import (
        mil_fp32_against_program,
        program_runner,
        with_constants,
    )
    from parity.mil import Evaluator, load_package
    from parity.result import OUTPUT, rel_error
    from parity.variant import evaluator_weights

    _, out = run
    program = load_package(out / "tb-int8" / "tb-int8.mlpackage")
    fp16_program = load_package(out / "tb" / "tb.mlpackage")
    recipe = load_recipe(out.parent / "tb.yaml")
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    module = rewrite_encoder(recipe, ckpt, recipe.encoder or EncoderOptions()).module
    held_out = prepare_encoder_held_out(
        [[1, 5, 6, 7]], None, ckpt.model, module, pad_id(ckpt.tokenizer, ckpt.config)
    )
    (batch,) = held_out.batches
    names = [n for n, _ in module.named_parameters() if n.startswith("layers.")]
    names = [n for n in names if n.endswith(("qkv.weight", "o.weight", "up.weight", "down.weight"))]
    fp16 = {n: module.get_parameter(n).detach().half().numpy() for n in names}
    variant = Evaluator(program, "fp32")
    weights, mismatched = evaluator_weights(variant, fp16)
    assert len(weights) == 12 and len(mismatched) == 12  # fp16 values are not what int8 decodes to
    decoded = {n: v.astype(np.float16) for n, v in weights.items()}
    assert evaluator_weights(variant, decoded)[1] == []
    got = program_runner(variant, module)(batch)[1][OUTPUT].double()
    plain = program_runner(Evaluator(fp16_program, "fp32"), module)(batch)[1][OUTPUT].double()
    assert rel_error(got, plain) > 1e-4  # the compression error itself
    same = with_constants(Evaluator(fp16_program, "fp32"), weights)
    assert rel_error(got, program_runner(same, module)(batch)[1][OUTPUT].double()) == 0.0
    assert mil_fp32_against_program(program, fp16_program, module, decoded, held_out.batches) == (
        0.0,
        0,
    )
    assert mil_fp32_against_program(program, fp16_program, module, fp16, held_out.batches)[1] == 12


def test_a_classifier_variant_is_gated_on_argmax_too(tmp_path: Path) -> None:
    variant = {"suffix": "int8", "method": "int8", "granularity": "per-channel",
               "gates": {"min_cosine": 0.99, "min_top1_agreement": 1.0}}  # fmt: skip
    recipe = load_recipe(_recipe(tmp_path, "text-classification", [variant], name="tc"))
    (result,) = _variants(recipe, tmp_path / "out")
    assert result.passed
    gates = _gates(result.directory)
    for level in ("torch-fp16", "mil-fp16"):
        assert gates[("min_top1_agreement", level)]["value"] == 1.0
        assert gates[("min_cosine", level)]["value"] >= 0.99


def test_a_one_score_variant_is_gated_on_its_sigmoid(tmp_path: Path) -> None:
    """A cross-encoder's one score: a cosine of one value is only its sign, so the score's
    magnitude is judged by max_abs_dprob on its sigmoid."""
    gates = {"min_cosine": 0.99, "min_top1_agreement": 0.5}
    variants = [
        {"suffix": "int8", "method": "int8", "granularity": "per-channel",
         "gates": {**gates, "max_abs_dprob": 0.02}},
        {"suffix": "lut2", "method": "lut", "bits": 2, "gates": {**gates, "max_abs_dprob": 1e-4}},
    ]  # fmt: skip
    recipe = load_recipe(_recipe(tmp_path, "text-classification", variants, "ce", labels=1))
    int8, lut2 = _variants(recipe, tmp_path / "out")
    assert int8.passed and not lut2.passed
    for level in ("torch-fp16", "mil-fp16"):
        kept = _gates(int8.directory)[("max_abs_dprob", level)]
        assert 0.0 < kept["value"] <= 0.02 and "sigmoid" in kept["detail"]
        moved = _gates(lut2.directory)[("max_abs_dprob", level)]
        assert not moved["passed"]


def test_encoder_variant_rules_name_the_field(tmp_path: Path) -> None:
    no_argmax = {"suffix": "int8", "method": "int8", "granularity": "per-channel",
                 "gates": {"min_cosine": 0.99}}  # fmt: skip
    with pytest.raises(RecipeError) as e:
        load_recipe(_recipe(tmp_path, "text-classification", [no_argmax], name="a"))
    assert "needs min_top1_agreement" in str(e.value)
    w8a8 = {"suffix": "w", "method": "w8a8", "granularity": "per-channel",
            "gates": {"min_cosine": 0.99}}  # fmt: skip
    with pytest.raises(RecipeError) as e:
        load_recipe(
            _recipe(tmp_path, "sentence-similarity", [w8a8], name="b", calibration=[[1, 9, 8]])
        )
    assert "w8a8 is implemented for text-generation only" in str(e.value)


def test_emit_refuses_a_method_the_task_lacks(tmp_path: Path) -> None:
    """Programmatic callers get the schema's rule too, before anything is built."""
    from converter.compression.emit import emit
    from converter.compression.encoder_variants import EncoderSubject
    from converter.errors import InputError
    from converter.recipe.compression_section import Compression

    compression = Compression.model_validate(
        {
            "held_out": [[1, 2, 3]],
            "calibration": [[1, 4, 5]],
            "variants": [
                {
                    "suffix": "w",
                    "method": "w8a8",
                    "granularity": "per-channel",
                    "gates": {"min_cosine": 0.99},
                }  # fmt: skip
            ],
        }
    )
    subject = EncoderSubject(None, None, 1e-5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"variants\[0\]\.method: w8a8 is implemented for"):
        emit(compression, "tb", tmp_path, subject, tmp_path)


def reranker_recipe(root: Path) -> Path:
    """A tiny cross-encoder (`cross_encoder_checkpoint`) with pair fixtures and an int8
    variant judged on four held-out pairs of corpus sentences."""
    from encoder_models import cross_encoder_checkpoint

    ckpt = cross_encoder_checkpoint(root / "ce")
    variant = {
        "suffix": "int8",
        "method": "int8",
        "granularity": "per-channel",
        "gates": {"min_cosine": 0.99, "min_top1_agreement": 0.5, "max_abs_dprob": 0.05},
    }
    doc = {
        "name": "ce", "task": "text-classification",
        "source": {"kind": "hf-dir", "path": str(ckpt)},
        "shapes": {"batch": BATCH, "sequence_length": 64},
        "fixtures": {"pairs": [["how do bees make honey", "nectar hive"]],
                     "padded_variants": False},
        "encoder": {"partition": "single"},
        "compression": {"held_out": {"corpus": "pydoc_data", "sentences": 4, "pairs": True},
                        "variants": [variant]},
    }  # fmt: skip
    (root / "ce.yaml").write_text(json.dumps(doc))  # JSON is YAML
    return root / "ce.yaml"


def test_a_cross_encoder_variant_is_judged_on_held_out_text_pairs(tmp_path: Path) -> None:
    """``held_out: {corpus, sentences, pairs: true}``: consecutive sentences as text pairs,
    with their segment ids in the reference and in both the variant's torch and MIL runs."""
    from converter.compression.corpus import slice_fixtures
    from converter.recipe.compression_section import Corpus

    (result,) = _variants(load_recipe(reranker_recipe(tmp_path)), tmp_path / "out")
    ckpt = tmp_path / "ce"
    assert result.passed, [(k, g["value"]) for k, g in _gates(result.directory).items()
                           if not g["passed"]]  # fmt: skip
    report = json.loads((result.directory / "parity.json").read_text())
    assert report["held_out"]["source"].endswith("consecutive sentences as text pairs")
    assert report["held_out"]["sentences"] == 4
    gates = _gates(result.directory)
    for level in ("torch-fp16", "mil-fp16"):
        # The checkpoint's row 1 moves a pair's score by tenths (`cross_encoder_checkpoint`).
        assert 0.0 < gates[("max_abs_dprob", level)]["value"] <= 0.05
    # The slice itself: four pairs, each with its second segment marked.
    from transformers import AutoTokenizer

    corpus = Corpus(corpus="pydoc_data", sentences=4, pairs=True)
    fixtures, _ = slice_fixtures(corpus, "held_out", AutoTokenizer.from_pretrained(ckpt), 64,
                                 300, False, 2)  # fmt: skip
    assert [f.name for f in fixtures] == [f"held_out[{i}]" for i in range(4)]
    assert all(f.token_types and f.token_types[-1] == 1 for f in fixtures)
