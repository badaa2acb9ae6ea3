"""`anec convert` for encoders end to end on tiny perturbed checkpoints saved to disk: the single
program and the partition (host embedding -> NE island -> tail), manifests and gates."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from encoder_models import cross_encoder_checkpoint, hf_model, random_sequences, tiny_config
from tiny_models import one_torch_thread

from converter.errors import InputError
from converter.pipeline.run import convert
from converter.recipe import load_recipe
from graph_passes.archs import adapt_encoder
from graph_passes.encoder import BC1LEncoder, EncoderIO
from graph_passes.partition import host_embedding
from parity.encoder_mil import output_runner
from parity.fixtures import build_fixtures, make_batches
from parity.result import OUTPUT

BATCH, LENGTH = 2, 16


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch, kw in (("modernbert", {"classifier_pooling": "mean"}), ("bert", {})):
        model = hf_model(tiny_config(arch, **kw), classify=True)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def write_recipe(tmp: Path, ckpt: Path, name: str, task: str, encoder: dict[str, Any]) -> Path:
    ids = random_sequences(7, (5, 16, 9), first=1)
    doc = {
        "name": name,
        "task": task,
        "source": {"kind": "hf-dir", "path": str(ckpt)},
        "shapes": {"batch": BATCH, "sequence_length": LENGTH},
        "fixtures": {"token_ids": ids, "padded_variants": False},
        "encoder": encoder,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def converted(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("art")
    for partition in ("single", "host-embedding"):
        recipe = load_recipe(
            write_recipe(
                tmp,
                checkpoints["modernbert"],
                f"mb-{partition}",
                "text-classification",
                {"partition": partition, "prenormalize_embeddings": partition != "single"},
            )
        )
        result = convert(recipe, tmp / "out")
        assert result.passed, [g for g in result.parity.gates if not g.passed]
    return tmp / "out"


def test_single_program_artifact(converted: Path) -> None:
    art = converted / "mb-single"
    manifest = json.loads((art / "manifest.json").read_text())
    assert (art / "mb-single.mlpackage").is_dir()
    assert [t["name"] for t in manifest["inputs"]] == ["input_ids", "key_mask"]
    assert manifest["outputs"][0]["name"] == "logits"
    assert manifest["outputs"][0]["shape"] == [BATCH, 3]
    assert manifest["pieces"] is None
    assert manifest["encoder"]["pooling"] == "mean"
    assert manifest["encoder"]["layer_windows"] == [None, 4, 4, None]
    assert manifest["rope_theta"] == [160000.0, 10000.0, 10000.0, 160000.0]
    parity = json.loads((art / "parity.json").read_text())
    names = {(g["name"], g["implementation"]) for g in parity["gates"]}
    assert ("fp16_argmax_agreement", "torch-fp16") in names and parity["passed"]


def test_partitioned_artifact_lists_pieces_order_and_boundary_bytes(converted: Path) -> None:
    art = converted / "mb-host-embedding"
    manifest = json.loads((art / "manifest.json").read_text())
    assert [p["name"] for p in manifest["pieces"]] == ["embedding", "island", "tail"]
    assert manifest["pieces"][0]["runs_on"] == "host"
    assert (art / "mb-host-embedding.island.mlpackage").is_dir()
    assert (art / "mb-host-embedding.tail.mlpackage").is_dir()
    d = 64
    bytes_by_edge = {(b["source"], b["target"]): b["bytes"] for b in manifest["boundaries"]}
    mask = BATCH * LENGTH * 2
    assert bytes_by_edge[("embedding (host)", "island")] == BATCH * LENGTH * d * 2 + mask
    assert bytes_by_edge[("island", "tail")] == BATCH * LENGTH * d * 2 + mask
    assert bytes_by_edge[("tail", "host")] == BATCH * 3 * 2
    table = np.load(art / "embeddings.npy")
    assert table.dtype == np.float16 and table.shape == (300, d)
    assert not (art / "embedding_norm_weight.npy").exists()  # pre-normalised: no host norm
    assert any("offline" in dev["what"] for dev in manifest["deviations"])
    parity = json.loads((art / "parity.json").read_text())
    partitioned = [g for g in parity["gates"] if g["implementation"] == "partitioned-fp16"]
    assert partitioned and all(g["passed"] for g in partitioned)
    # The table's own check: every row within fp16 rounding of the exact norm of its fp32 row
    # (one rounding: half an fp16 ulp of values below 8 is at most 2^-9).
    table = parity["prenormalized_table"]
    assert table["rows"] == 300
    assert 0 < table["max_abs_error_prenormalized_fp16"] <= 2.0**-9
    assert table["max_abs_error_host_norm_of_fp16_rows"] < 1e-2


REPORT_FILES = {
    "manifest.json",
    "parity.json",
    "parity.txt",
    "parity.html",
    "plan.json",
    "plan.txt",
}


@pytest.mark.parametrize("name", ["mb-single", "mb-host-embedding"])
def test_encoder_artifacts_carry_every_report_and_the_mil_levels(
    converted: Path, name: str
) -> None:
    """The same report files as a decoder artifact, and the MIL level run on the program: fp32
    per layer (layer markers) and the fp16 task output, both gated."""
    art = converted / name
    assert {p.name for p in art.iterdir()} >= REPORT_FILES
    parity = json.loads((art / "parity.json").read_text())
    by_level = {(g["name"], g["implementation"]): g for g in parity["gates"]}
    layers = by_level[("mil_fp32_layer_rel_error", "mil-fp32")]
    assert layers["passed"] and layers["value"] <= layers["threshold"]
    assert len(parity["mil_fp32_layer_rel_error"]) == 4  # one figure per layer
    assert by_level[("fp16_argmax_agreement", "mil-fp16")]["passed"]
    plan = json.loads((art / "plan.json").read_text())
    assert plan["evidence"] == "static"
    assert "<html" in (art / "parity.html").read_text().lower()


def test_island_to_tail_tensors_have_shape_dtype_and_layout(converted: Path) -> None:
    manifest = json.loads((converted / "mb-host-embedding" / "manifest.json").read_text())
    crossing = next(b for b in manifest["boundaries"] if b["source"] == "island")
    hidden = next(t for t in crossing["tensors"] if t["name"] == "hidden")
    assert hidden["shape"] == [1, 64, 1, BATCH * LENGTH] and hidden["dtype"] == "float16"
    assert "[1, channel, 1, slot]" in hidden["meaning"]


def test_an_encoder_program_the_evaluator_cannot_run_is_a_failed_gate(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a kernel for an op of the program, the MIL level fails: exit 1, nothing
    published (it used to be recorded as "not run" and published with exit 0)."""
    from parity.mil.registry import KERNELS

    monkeypatch.delitem(KERNELS, "softmax")
    path = write_recipe(tmp_path, checkpoints["modernbert"], "no-kernel", "text-classification", {})
    result = convert(load_recipe(path), tmp_path / "out")
    assert result.exit_code == 1 and result.failed_gate == "MIL-level"
    assert not (tmp_path / "out" / "no-kernel").exists()
    parity = json.loads((tmp_path / "out" / "no-kernel.failed" / "parity.json").read_text())
    failed = [g for g in parity["gates"] if not g["passed"]]
    assert failed and "softmax" in failed[0]["detail"]
    assert parity["implementations"]["mil-fp16"].startswith("failed: ")


def test_a_float32_recipe_ships_float32_host_tables(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The host tables are what the fp32 gates fed: float32, not rounded to fp16."""
    path = write_recipe(
        tmp_path,
        checkpoints["modernbert"],
        "mb-fp32",
        "text-classification",
        {"partition": "host-embedding", "prenormalize_embeddings": True},
    )
    doc = json.loads(path.read_text())
    doc |= {"precision": "float32", "io": {"dtype": "float32"}}
    path.write_text(json.dumps(doc))
    result = convert(load_recipe(path), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    table = np.load(tmp_path / "out" / "mb-fp32" / "embeddings.npy")
    assert table.dtype == np.float32


def test_partitioned_run_matches_the_single_program(
    converted: Path, checkpoints: dict[str, Path]
) -> None:
    """host embedding -> island package -> tail package, each run by the MIL evaluator, against
    the single package on the same batches."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(checkpoints["modernbert"])
    canonical = adapt_encoder(model.config, model.state_dict())
    module = BC1LEncoder(canonical, EncoderIO(BATCH, LENGTH, "token-ids", "logits"))
    single = output_runner(
        {"main": converted / "mb-single" / "mb-single.mlpackage"}, module, None, "float16"
    )
    art = converted / "mb-host-embedding"
    host = host_embedding(canonical, LENGTH, prenormalize=True)
    parts = output_runner(
        {
            "island": art / "mb-host-embedding.island.mlpackage",
            "tail": art / "mb-host-embedding.tail.mlpackage",
        },
        module,
        host,
        "float16",
    )
    fixtures = build_fixtures(
        [], random_sequences(3, (4, 16, 11, 7), first=1), None, 16, 300, False
    )
    for batch in make_batches(fixtures, BATCH, LENGTH, 0, right=True):
        a, b = single(batch)[1][OUTPUT], parts(batch)[1][OUTPUT]
        assert torch.isfinite(b).all()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max()) < 0.05


def test_a_post_norm_island_compares_its_last_layer_at_its_output(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """BERT has no final norm: its island returns the last layer's output itself, which the
    program names ``hidden``. The fp32 level compares that layer there, not as a lost marker."""
    path = write_recipe(tmp_path, checkpoints["bert"], "bert-island", "sentence-similarity",
                        {"partition": "host-embedding"})  # fmt: skip
    result = convert(load_recipe(path), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    parity = json.loads((tmp_path / "out" / "bert-island" / "parity.json").read_text())
    errors = parity["mil_fp32_layer_rel_error"]
    assert len(errors) == tiny_config("bert").num_hidden_layers
    assert all(0.0 < e <= 1e-5 for e in errors)  # the last too: compared, at the output


def test_a_cross_encoder_converts_and_is_gated_on_its_score(tmp_path: Path) -> None:
    """A reranker's head (one label): the MIL level judges the score's sign and sigmoid."""
    hf_model(tiny_config("bert", num_labels=1), classify=True).save_pretrained(tmp_path / "ce")
    path = write_recipe(tmp_path, tmp_path / "ce", "ce", "text-classification",
                        {"partition": "single"})  # fmt: skip
    result = convert(load_recipe(path), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    manifest = json.loads((tmp_path / "out" / "ce" / "manifest.json").read_text())
    assert manifest["outputs"][0]["shape"] == [BATCH, 1]
    assert "sigmoid" in manifest["outputs"][0]["meaning"]
    parity = json.loads((tmp_path / "out" / "ce" / "parity.json").read_text())
    mil = {g["name"]: g for g in parity["gates"] if g["implementation"] == "mil-fp16"}
    assert "sign" in mil["fp16_argmax_agreement"]["detail"]
    assert "sigmoid" in mil["fp16_max_abs_dprob"]["detail"]


@pytest.mark.parametrize("partition", ["single", "host-embedding"])
def test_a_cross_encoder_is_checked_on_text_pairs(tmp_path: Path, partition: str) -> None:
    """``fixtures.pairs``: query and passage tokenized as one input with segment ids, which the
    reference, the torch levels and the emitted program (or the host embedding feeding the
    island) all receive; the program fed all-zero segment ids (a runtime dropping
    token_type_ids) fails the MIL fp16 gates."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from parity.encoder_gates import check_encoder, run_encoder_reference
    from parity.result import Thresholds

    ckpt = cross_encoder_checkpoint(tmp_path / "ce")
    pairs = [("how do bees make honey", "nectar hive"), ("capital of france", "paris city"),
             ("what is a compiler", "honey")]  # fmt: skip
    path = write_recipe(tmp_path, ckpt, "ce", "text-classification", {"partition": partition})
    doc = json.loads(path.read_text())
    doc["fixtures"] = {"pairs": pairs, "padded_variants": False}
    path.write_text(json.dumps(doc))
    result = convert(load_recipe(path), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    art = tmp_path / "out" / "ce"
    parity = json.loads((art / "parity.json").read_text())
    assert [r["name"] for r in parity["encoder_fixtures"]] == ["pair[0]", "pair[1]", "pair[2]"]

    model = AutoModelForSequenceClassification.from_pretrained(ckpt).eval()
    canonical = adapt_encoder(model.config, model.state_dict())
    module = BC1LEncoder(canonical, EncoderIO(BATCH, LENGTH, "token-ids", "logits"))
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    fixtures = build_fixtures([], [], tokenizer, LENGTH, 300, False, pairs, 2)
    refs = {f.name: run_encoder_reference(model, f, "logits") for f in fixtures}
    if partition == "single":
        manifest = json.loads((art / "manifest.json").read_text())
        types = next(t for t in manifest["inputs"] if t["name"] == "token_type_ids")
        assert "text pair" in types["meaning"]
        program = output_runner({"main": art / "ce.mlpackage"}, module, None, "float16")
        from converter.evidence.recheck import recheck

        again = recheck(art, tmp_path / "again")  # anec parity: the pairs from recipe.yaml
        assert again.exit_code == 0
        assert again.document["encoder_fixtures"] == parity["encoder_fixtures"]
    else:
        pieces = {p: art / f"ce.{p}.mlpackage" for p in ("island", "tail")}
        host = host_embedding(canonical, LENGTH, prenormalize=False)
        program = output_runner(pieces, module, host, "float16")
    thresholds = Thresholds(**load_recipe(path).gates.parity_thresholds())
    for segments, passes in ((True, True), (False, False)):
        batches = make_batches(fixtures, BATCH, LENGTH, 0, right=True)
        if not segments:
            batches = [dataclasses.replace(b, token_type_ids=None) for b in batches]
        report, _ = check_encoder(module, batches, refs, thresholds, {"mil-fp16": program},
                                  torch_levels=False)  # fmt: skip
        mil = [g for g in report.gates if g.implementation == "mil-fp16"]
        values = [(g.name, g.value, g.threshold) for g in mil]
        assert mil and all(g.passed for g in mil) == passes, values


def test_bert_refuses_a_prenormalised_table(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            checkpoints["bert"],
            "bert-pre",
            "text-classification",
            {"partition": "host-embedding", "prenormalize_embeddings": True},
        )
    )
    with pytest.raises(InputError, match="word \\+ position \\+ type"):
        convert(recipe, tmp_path / "out")


def test_encoder_section_is_refused_for_text_generation(tmp_path: Path) -> None:
    from converter.recipe import RecipeError

    path = tmp_path / "r.yaml"
    path.write_text(
        "name: x\ntask: text-generation\nsource: {kind: hf-dir, path: .}\n"
        "fixtures: {token_ids: [[1, 2]]}\nencoder: {partition: single}\n"
    )
    with pytest.raises(RecipeError, match="encoder"):
        load_recipe(path)


def test_anec_parity_rechecks_an_encoder_artifact(converted: Path, tmp_path: Path) -> None:
    """The re-check runs the encoder's own steps on the published pieces: the same gates as
    the conversion, every one passing again, the artifact untouched."""
    from converter.evidence.recheck import recheck

    art = converted / "mb-host-embedding"
    before = (art / "parity.json").read_bytes()
    result = recheck(art, tmp_path / "again")
    assert result.exit_code == 0
    published = json.loads(before)["gates"]
    key = ("name", "implementation")
    again = {tuple(g[k] for k in key): g for g in result.document["gates"]}
    # The re-check's own gate: it ran exactly the published gates (converter/evidence/recheck.py).
    assert again.pop(("same_gate_set", "recheck"))["passed"]
    assert sorted(again) == sorted(tuple(g[k] for k in key) for g in published)
    assert (art / "parity.json").read_bytes() == before


@pytest.mark.usefixtures("stand_in_evidence")
def test_device_check_gates_each_partitioned_piece_on_core_ml(converted: Path) -> None:
    """anec device-check of an encoder against a stand-in of Core ML (tests/coreml_standin.py):
    the host embedding, then the island and tail packages, gated as the MIL level gates."""
    from coreml_standin import StandInLoader, stand_in_adapters

    from converter.device.dispatch import device_check

    evidence = device_check(converted / "mb-host-embedding", ["CPU_ONLY"],
                            stand_in_adapters(StandInLoader()))  # fmt: skip
    assert evidence.passed
    (unit,) = evidence.units
    assert sorted(unit.functions) == ["island", "tail"]
    names = {(g.name, g.implementation) for g in unit.gates}
    assert ("fp16_argmax_agreement", "coreml-cpu-only") in names
    assert {g.name for g in evidence.program} == {g.name for g in unit.gates}

    def tilt(function: str, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v + np.arange(v.shape[-1]) * 0.5 for k, v in outputs.items()}

    drifted = device_check(converted / "mb-single", ["ALL"],
                           stand_in_adapters(StandInLoader(tilt)), memory=False)  # fmt: skip
    failed = [g for g in drifted.units[0].gates if not g.passed]
    assert failed and all(drifted.units[0].attribution(g).startswith("device:") for g in failed)
