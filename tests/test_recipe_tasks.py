"""The recipe as a union on ``task``: a key the task does not read is an error at validation
time, with its line, the key and the task; nothing validates and is then refused or ignored."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest

from converter.recipe import RecipeError, load_recipe

WriteFile = Callable[[str, str], Path]

# Lines 1-4; a case's own text starts on line 5.
HEAD = """\
name: r
task: {task}
source: {{kind: hf-dir, path: model}}
fixtures: {{token_ids: [[101, 2023, 102]]}}
"""

ENCODER_VARIANT = (
    "compression:\n"  # 5
    "  held_out: [[7, 8, 9]]\n"  # 6
    "{extra}"
    "  variants:\n"
    "    - suffix: a\n"
    "      method: int8\n"
    "      granularity: per-channel\n"
    "      gates: {{min_cosine: 0.99{gate}}}\n"
)
DECODER_VARIANT = ENCODER_VARIANT.replace(
    "min_cosine: 0.99", "min_top1_agreement: 0.9, max_mean_kl: 0.1"
)

# (task, text from line 5, line, dotted key)
MISPLACED = [
    ("feature-extraction", "io:\n  logits: last\n", 6, "io.logits"),
    ("sentence-similarity", "io:\n  inputs: embeddings\n", 6, "io.inputs"),
    ("text-classification", "io:\n  dtype: float16\n  lm_head_chunk: 4096\n", 7,
     "io.lm_head_chunk"),
    ("text-generation", "encoder:\n  partition: single\n", 5, "encoder"),
    ("text-generation", "encoder: {pooling: max}\n", 5, "encoder"),
    ("sentence-similarity", "gates:\n  fp16_argmax_agreement: 1.0\n", 6,
     "gates.fp16_argmax_agreement"),
    ("feature-extraction", "gates:\n  fp16_max_abs_dprob: 0.02\n", 6, "gates.fp16_max_abs_dprob"),
    ("sentence-similarity", "gates:\n  fp32_logits_rel_error: 1.0e-4\n", 6,
     "gates.fp32_logits_rel_error"),
    ("text-classification", "encoder:\n  pooling: mean\n", 6, "encoder.pooling"),
    ("feature-extraction", "encoder:\n  normalize: true\n", 6, "encoder.normalize"),
    ("text-classification", "gates:\n  fp32_min_cosine: 0.9999\n", 6, "gates.fp32_min_cosine"),
    ("text-classification", "gates:\n  fp16_min_cosine: 0.999\n", 6, "gates.fp16_min_cosine"),
    ("text-generation", "gates:\n  fp16_min_cosine: 0.999\n", 6, "gates.fp16_min_cosine"),
    ("sentence-similarity", ENCODER_VARIANT.format(extra="  mil_positions: 2\n", gate=""), 7,
     "compression.mil_positions"),
    ("text-generation", DECODER_VARIANT.format(extra="", gate=", min_cosine: 0.99"), 11,
     "compression.variants[0].gates.min_cosine"),
    ("feature-extraction", ENCODER_VARIANT.format(extra="", gate=", max_mean_kl: 0.1"), 11,
     "compression.variants[0].gates.max_mean_kl"),
    ("sentence-similarity", ENCODER_VARIANT.format(extra="", gate=", min_top1_agreement: 0.9"),
     11, "compression.variants[0].gates.min_top1_agreement"),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _issues(write_file: WriteFile, text: str) -> list[str]:
    write_file("x.yaml", text)
    with pytest.raises(RecipeError) as info:
        load_recipe("x.yaml")
    assert info.value.exit_code == 2
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("task", "text", "line", "key"),
    MISPLACED,
    ids=[f"{case[0]}-{case[3]}" for case in MISPLACED],
)
def test_a_key_the_task_does_not_read_is_refused_with_its_line(
    write_file: WriteFile, task: str, text: str, line: int, key: str
) -> None:
    issues = _issues(write_file, HEAD.format(task=task) + text)
    wanted = f"x.yaml:{line}: {key}: does not apply to task {task}"
    assert [i for i in issues if i.startswith(wanted)], issues
    # One issue per misplaced key: not also "unknown key", nor one per key beneath it.
    assert len(issues) == 1, issues
    assert issues[0].endswith("; remove it")


def test_the_same_keys_validate_for_the_tasks_that_read_them(write_file: WriteFile) -> None:
    cases = [
        ("text-generation", "io:\n  logits: last\n  inputs: embeddings\n  lm_head_chunk: 4096\n"),
        ("text-generation", "gates: {fp16_argmax_agreement: 1.0, fp16_max_abs_dprob: 0.02}\n"),
        ("text-generation", DECODER_VARIANT.format(extra="  mil_positions: 2\n", gate="")),
        ("text-classification",
         "gates: {fp16_argmax_agreement: 1.0, fp32_logits_rel_error: 1.0e-4}\n"),
        ("text-classification",
         "encoder: {partition: host-embedding, prenormalize_embeddings: true}\n"),
        ("sentence-similarity",
         "encoder: {pooling: mean, normalize: true}\ngates: {fp32_min_cosine: 0.9999}\n"),
        ("feature-extraction", "gates: {fp16_min_cosine: 0.999}\n"),
        ("feature-extraction", "gates: {fp32_logits_rel_error: 1.0e-4}\n"),
        ("sentence-similarity", ENCODER_VARIANT.format(extra="", gate="")),
        ("text-classification",
         ENCODER_VARIANT.format(extra="", gate=", min_top1_agreement: 1.0")),
    ]  # fmt: skip
    for i, (task, text) in enumerate(cases):
        recipe = load_recipe(write_file(f"ok{i}.yaml", HEAD.format(task=task) + text))
        assert recipe.task == task


@pytest.mark.parametrize(
    "gates",
    [
        "mil_fp32_layer_rel_error: 1.0e-5",
        "plan_min_ne_flop_share: 0.99",
        "plan_max_ne_segments: 1",
        "fp32_layer_rel_error: 1.0e-4",
    ],
)
@pytest.mark.parametrize(
    "task", ["feature-extraction", "sentence-similarity", "text-classification"]
)
def test_gates_the_unified_pipeline_reads_stay_valid_for_encoders(
    write_file: WriteFile, gates: str, task: str
) -> None:
    """The one pipeline gives encoders the MIL fp32 per-layer level and the plan gates."""
    text = HEAD.format(task=task) + f"gates:\n  {gates}\n"
    assert load_recipe(write_file("x.yaml", text)).task == task


# ---- what was refused at convert time is refused at validation


@pytest.mark.parametrize(
    ("task", "text", "expected"),
    [
        ("text-generation", "attention: heads-batched\n",
         "x.yaml:5: attention: heads-batched is not implemented; the implemented form is "
         "per-head"),
        ("feature-extraction", "attention: heads-batched\n",
         "x.yaml:5: attention: heads-batched is not implemented"),
        ("sentence-similarity", "encoder:\n  normalize: false\n",
         "x.yaml:6: encoder.normalize: false is not implemented; the implemented sentence "
         "embedding is the mean over real tokens, L2-normalised"),
        ("text-classification", "encoder:\n  prenormalize_embeddings: true\n",
         "x.yaml:6: encoder.prenormalize_embeddings: needs partition: host-embedding"),
        ("sentence-similarity", "shapes:\n  batch: 3\n  sequence_length: 8192\n",
         "x.yaml:5: shapes: batch 3 x sequence_length 8192 = 24576 exceeds the Neural Engine's "
         "per-axis limit 16384"),
        ("feature-extraction",
         ENCODER_VARIANT.format(extra="", gate="") + "encoder:\n  partition: host-embedding\n",
         "x.yaml:5: compression: variants of a partitioned encoder"),
    ],
    ids=["heads-batched", "heads-batched-encoder", "normalize-false", "prenormalize-single",
         "folded-batch", "variants-of-a-partition"],
)  # fmt: skip
def test_refused_at_validation_not_at_convert_time(
    write_file: WriteFile, task: str, text: str, expected: str
) -> None:
    issues = _issues(write_file, HEAD.format(task=task) + text)
    assert [i for i in issues if i.startswith(expected)], issues


def test_a_decoder_does_not_fold_its_batch(write_file: WriteFile) -> None:
    text = HEAD.format(task="text-generation") + "shapes:\n  batch: 3\n  sequence_length: 8192\n"
    assert load_recipe(write_file("x.yaml", text)).shapes.batch == 3


# ---- reporting


def test_misplaced_keys_are_reported_with_every_other_mistake(write_file: WriteFile) -> None:
    text = HEAD.format(task="sentence-similarity").replace("name: r", "name: a/b")
    text += "shapes:\n  batch: 0\nio:\n  logits: all\ngates:\n  fp16_max_abs_dprob: 0.02\n"
    issues = _issues(write_file, text)
    fields = [re.match(r"x\.yaml:(\d+): ([^:]+):", i).groups() for i in issues]  # type: ignore[union-attr]
    assert fields == [
        ("1", "name"),
        ("6", "shapes.batch"),
        ("8", "io.logits"),
        ("10", "gates.fp16_max_abs_dprob"),
    ]


def test_an_unknown_task_still_checks_the_common_keys(write_file: WriteFile) -> None:
    text = HEAD.format(task="chat") + "shapes: {batch: 0}\nio: {logits: last}\n"
    issues = _issues(write_file, text)
    assert issues[0].startswith("x.yaml:2: task: expected one of text-generation")
    assert issues[1].startswith("x.yaml:5: shapes.batch: expected an integer from 1 to 64")
    assert len(issues) == 2  # io is checked once the task is known


def test_an_unknown_key_still_suggests_the_task_schema_key(write_file: WriteFile) -> None:
    issues = _issues(
        write_file, HEAD.format(task="feature-extraction") + "encoder: {partiton: single}\n"
    )
    assert issues == ["x.yaml:5: encoder.partiton: unknown key; did you mean 'partition'?"]


# ---- the schema classes


def test_the_union_types_and_direct_validation() -> None:
    from pydantic import ValidationError

    from converter.recipe import DecoderRecipe, EncoderRecipe, validate_recipe

    base: dict[str, Any] = {
        "name": "r",
        "source": {"kind": "hf-dir", "path": "m"},
        "fixtures": {"token_ids": [[1, 2]]},
    }
    assert isinstance(validate_recipe({**base, "task": "text-generation"}), DecoderRecipe)
    encoder = validate_recipe({**base, "task": "text-classification"})
    assert isinstance(encoder, EncoderRecipe) and encoder.encoder.partition == "single"
    misplaced = {**base, "task": "sentence-similarity", "gates": {"fp16_argmax_agreement": 1.0}}
    with pytest.raises(ValidationError, match="does not apply to task sentence-similarity"):
        validate_recipe(misplaced)
    with pytest.raises(ValidationError, match="task"):
        validate_recipe({**base, "task": "chat"})


def test_every_task_key_is_a_field_of_each_task_that_reads_it() -> None:
    """The table and the schemas agree: a row names a key its tasks' schema has."""
    from pydantic import BaseModel

    from converter.recipe import TASK_KEYS, TASKS, recipe_model
    from converter.recipe.task_keys import EACH

    def field(model: Any, path: tuple[str, ...]) -> bool:
        for part in path:
            while get_origin(model) is not None and not (
                isinstance(model, type) and issubclass(model, BaseModel)
            ):
                args = [a for a in get_args(model) if a is not type(None)]
                model = args[0]
            if part == EACH:
                continue
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return False
            if part not in model.model_fields:
                return False
            model = model.model_fields[part].annotation
        return True

    assert {recipe_model(t) for t in TASKS} == {
        recipe_model("text-generation"),
        recipe_model("feature-extraction"),
        recipe_model("decision"),
    }
    for key in TASK_KEYS:
        assert key.tasks and set(key.tasks) <= set(TASKS), key
        for task in key.tasks:
            assert field(recipe_model(task), key.path), (key.name, task)


def test_manifest_recipes_read_back(write_file: WriteFile) -> None:
    """`anec parity` rebuilds the recipe from the manifest: every shipped recipe round-trips,
    and a manifest written before the union (every key, with defaults) still reads."""
    from converter.recipe import recipe_from_dict, recipe_to_dict, shipped_recipes

    for path in shipped_recipes():
        recipe = load_recipe(path)
        again = recipe_from_dict(recipe_to_dict(recipe))
        assert again.model_dump() == recipe.model_dump(), path.name
    old = {
        "recipe_file": None,
        "name": "m",
        "task": "text-classification",
        "source": {"kind": "hf-dir", "path": "m", "package": None, "file": None},
        "fixtures": {"prompts": [], "token_ids": [[1, 2]], "padded_variants": True},
        "io": {"dtype": "float16"},
        "gates": {"fp16_argmax_agreement": 1.0, "fp16_max_abs_dprob": 0.02},
        "encoder": {"partition": "single", "pooling": "mean", "normalize": True,
                    "fp32_min_cosine": 0.99999, "fp16_min_cosine": 0.9995},
        "compression": None,
    }  # fmt: skip
    assert recipe_from_dict(old).task == "text-classification"


def test_the_recipes_doc_lists_every_task_key() -> None:
    from converter.recipe import TASK_KEYS

    root = Path(__file__).resolve().parents[1]
    readme = (root / "docs" / "recipes.md").read_text(encoding="utf-8")
    for key in TASK_KEYS:
        row = f"| `{key.name}` | {', '.join(key.tasks)} |"
        assert row in readme, row


@pytest.mark.parametrize("task", ["text-generation", "decision"])
def test_text_pairs_are_refused_where_no_encoder_reads_them(
    write_file: WriteFile, task: str
) -> None:
    text = HEAD.format(task=task).replace("{token_ids:", "{pairs: [[a, b]], token_ids:")
    issues = _issues(write_file, text)
    assert [i for i in issues if f"fixtures.pairs: does not apply to task {task}" in i], issues


def test_a_text_pair_needs_two_non_empty_texts(write_file: WriteFile) -> None:
    head = HEAD.format(task="text-classification")
    issues = _issues(write_file, head.replace("{token_ids:", "{pairs: [[query, ' ']], token_ids:"))
    assert issues == ["x.yaml:4: fixtures.pairs[0][1]: expected a non-empty text"], issues
    issues = _issues(write_file, head.replace("{token_ids:", "{pairs: [[query]], token_ids:"))
    assert [i for i in issues if i.startswith("x.yaml:4: fixtures.pairs[0]")], issues
    write_file("x.yaml", head.replace("{token_ids:", "{pairs: [[query, passage]], token_ids:"))
    assert load_recipe("x.yaml").fixtures.pairs == [("query", "passage")]
