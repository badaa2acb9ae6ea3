"""The packaged SmolLM2 converted end to end: artifact files, manifest, parity, the MIL program.

Slow tier: one real conversion (about a minute) shared by every test in this file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from converter.pipeline.hashing import mlpackage_content_hash, sha256_file
from converter.pipeline.manifest import Manifest

pytestmark = pytest.mark.slow

D, L, LAYERS = 576, 64, 30


@pytest.fixture(scope="module")
def manifest(smollm2_artifact: Path) -> Manifest:
    return Manifest.model_validate_json((smollm2_artifact / "manifest.json").read_text())


@pytest.fixture(scope="module")
def program_ops(smollm2_artifact: Path) -> list[Any]:
    from parity.mil.program import load_package

    program = load_package(smollm2_artifact / "smollm2-135m-draft.mlpackage")
    return [op for op in program.functions["main"].operations if op.op_type != "const"]


def test_artifact_holds_package_manifest_tokenizer_embeddings_and_report(
    smollm2_artifact: Path,
) -> None:
    names = {p.name for p in smollm2_artifact.iterdir()}
    assert {
        "smollm2-135m-draft.mlpackage",
        "manifest.json",
        "parity.json",
        "tokenizer.json",
        "embeddings.npy",
    } <= names
    assert not list(smollm2_artifact.parent.glob(".anec-*")), "staging leftovers"


def test_manifest_hashes_match_the_files(smollm2_artifact: Path, manifest: Manifest) -> None:
    package = smollm2_artifact / manifest.package.file
    assert manifest.package.content_sha256 == mlpackage_content_hash(package)
    for entry in (manifest.tokenizer, manifest.embeddings, manifest.parity):
        assert entry is not None
        assert entry.sha256 == sha256_file(smollm2_artifact / entry.file)


def test_manifest_states_the_io_contract(manifest: Manifest) -> None:
    assert [(t.name, t.shape, t.dtype) for t in manifest.inputs] == [
        ("inputs_embeds", [1, L, D], "float16"),
        ("key_mask", [1, L], "float16"),
    ]
    assert [t.name for t in manifest.outputs] == ["logits_0", "logits_1", "logits_2"]
    assert manifest.lm_head_chunks == [16384, 16384, 16384]
    assert manifest.rope_theta == [100000.0] * LAYERS
    assert manifest.embeddings is not None and manifest.embeddings.shape == [49152, D]
    assert "de-quantized" in manifest.checkpoint["note"]
    assert manifest.checkpoint["license"]
    prescaled = [d for d in manifest.deviations if "divided by" in d.what]
    assert prescaled, "SmolLM2's residual stream needs prescaled norms in fp16"


def test_parity_report_meets_the_gates(smollm2_artifact: Path) -> None:
    report = json.loads((smollm2_artifact / "parity.json").read_text())
    assert report["passed"] is True
    assert len(report["layers"]) == LAYERS
    assert all(row["fp32_rel_error"] <= 1e-4 for row in report["layers"])
    # The emitted program's fp16 gates (tests/test_mil_smollm2.py has the rest); the torch
    # fp16 level ran on demand only, and no fp16 gate failed
    gates = {g["name"]: g for g in report["gates"] if g["implementation"] == "mil-fp16"}
    assert gates["fp16_argmax_agreement"]["value"] == 1.0
    assert gates["fp16_max_abs_dprob"]["value"] <= 0.02
    assert gates["finite_outputs"]["passed"]
    assert not any(g["implementation"] == "torch-fp16" for g in report["gates"])
    fp16 = next(r for r in report["conversion"]["runs"] if r["implementation"] == "mil-fp16")
    slices = Counter(p["slice"] for p in fp16["positions"])
    assert slices["padded"] and slices["full-window"]
    # The sink at the first position: |h| above 20k somewhere, and still inside fp16.
    assert 2e4 < max(row["fp32_max_abs"] for row in report["layers"]) < 65504


def _dtype(var: Any) -> str:
    from coremltools.converters.mil.mil import types

    return str(types.builtin_to_string(var.dtype))


def test_every_projection_is_a_conv_with_constant_weights(program_ops: list[Any]) -> None:
    counts = Counter(op.op_type for op in program_ops)
    assert counts["linear"] == 0 and counts["matmul"] == 0
    convs = [op for op in program_ops if op.op_type == "conv"]
    # qkv, o, gate_up, down per layer, plus three LM-head chunks.
    assert len(convs) == 4 * LAYERS + 3
    assert all(op.weight.op.op_type == "const" for op in convs)


def test_every_attention_softmax_is_on_the_key_axis(program_ops: list[Any]) -> None:
    softmaxes = [op for op in program_ops if op.op_type == "softmax"]
    assert len(softmaxes) == 9 * LAYERS  # per head
    for op in softmaxes:
        # score[b, key, 0, query]: the key axis is 1.
        assert op.x.shape == (1, L, 1, L)
        assert int(op.axis.val) in (1, -3)


def test_no_fp32_op_and_no_rank_above_4(program_ops: list[Any]) -> None:
    for op in program_ops:
        for out in op.outputs:
            assert _dtype(out) == "fp16", f"{op.op_type} {op.name} outputs {_dtype(out)}"
            assert len(out.shape) <= 4, f"{op.op_type} {op.name} has rank {len(out.shape)}"


def test_no_layout_transpose_of_the_residual_stream(program_ops: list[Any]) -> None:
    transposes = [op for op in program_ops if op.op_type == "transpose"]
    residual = (1, D, 1, L)
    for op in transposes:
        if op.x.shape == (1, L, D):  # the entry: embedding rows -> channels
            continue
        assert op.x.shape != residual and op.outputs[0].shape != residual
    entry = [op for op in transposes if op.x.shape == (1, L, D)]
    assert len(entry) == 1
