"""Splitting a cached decoder's layers into packages by a weight budget
(`converter.tasks.kv_chunks`), and the recipe key that sets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.coreml.targets import package_budget_bytes
from converter.errors import InputError
from converter.recipe import RecipeError, load_recipe
from converter.tasks.kv_chunks import (
    WeightBytes,
    split_layers,
    weight_bytes,
)


def ranges(w: WeightBytes, budget: int) -> list[tuple[int, int]]:
    return [c.layers for c in split_layers(w, budget)]


def test_everything_that_fits_is_one_chunk_exactly_at_the_budget() -> None:
    w = WeightBytes((10, 10, 10), head=5, embed=0)
    assert ranges(w, 35) == [(0, 3)]  # exact fit
    (only,) = split_layers(w, 35)
    assert only.weight_bytes == 35 and only.first and only.last
    assert ranges(w, 34) == [(0, 2), (2, 3)]  # one byte less: two chunks


def test_the_head_goes_with_the_last_layer_and_the_embedding_with_the_first() -> None:
    w = WeightBytes((10, 10, 10, 10), head=15, embed=12)
    chunks = split_layers(w, 32)
    assert [c.layers for c in chunks] == [(0, 1), (1, 3), (3, 4)]
    assert [c.weight_bytes for c in chunks] == [22, 20, 25]
    assert all(c.weight_bytes <= 32 for c in chunks)
    assert [c.first for c in chunks] == [True, False, False]
    assert [c.last for c in chunks] == [False, False, True]


def test_the_split_is_balanced_with_the_fewest_chunks() -> None:
    # Greedy from the end alone would give (0, 1), (1, 6): 10 and 50 bytes; balanced: 30 / 30.
    w = WeightBytes((10,) * 6, head=0, embed=0)
    assert ranges(w, 50) == [(0, 3), (3, 6)]


def test_one_layer_above_the_budget_is_an_error_naming_it() -> None:
    w = WeightBytes((10, 40, 10), head=5, embed=0)
    with pytest.raises(InputError) as info:
        split_layers(w, 30)
    message = str(info.value)
    assert "layer 1: 40 bytes" in message and "cache.package_budget_mb (30 bytes)" in message


def test_the_head_alone_above_the_budget_is_an_error_naming_it() -> None:
    w = WeightBytes((10, 10), head=31, embed=0)
    with pytest.raises(InputError, match="the LM head and final norm: 31 bytes .* exceed"):
        split_layers(w, 30)


def test_the_last_layer_with_the_head_above_the_budget_is_named() -> None:
    w = WeightBytes((10, 25), head=10, embed=0)
    with pytest.raises(InputError, match="layer 1: 25 bytes .*LM head and final norm 10: 35"):
        split_layers(w, 30)


def test_layer_zero_with_an_embedding_table_inside_the_program_is_named() -> None:
    w = WeightBytes((10, 10), head=0, embed=25)
    with pytest.raises(InputError, match="layer 0: 10 bytes .*embedding table 25"):
        split_layers(w, 30)


@pytest.mark.parametrize("budget", [0, -5])
def test_a_budget_that_is_not_positive_is_an_error(budget: int) -> None:
    with pytest.raises(InputError, match="cache.package_budget_mb: expected a positive"):
        split_layers(WeightBytes((1,), 0, 0), budget)


def test_weight_bytes_counts_names_in_the_storage_dtype() -> None:
    named = [
        ("embed.weight", 100), ("layers.0.attn.qkv.weight", 8), ("layers.1.mlp.down.weight", 6),
        ("final_norm.weight", 2), ("lm_head.0.weight", 50),
    ]  # fmt: skip
    w = weight_bytes(named, 2, "float16", embed_in_program=False)
    assert w == WeightBytes((16, 12), head=104, embed=0)
    assert weight_bytes(named, 2, "float32", embed_in_program=True).embed == 400
    with pytest.raises(ValueError, match="weight rope.table: not a layer"):
        weight_bytes([("rope.table", 1)], 1, "float16", False)


def test_the_default_budget_follows_the_target_platform() -> None:
    assert package_budget_bytes(None, "iOS") == 1_000_000_000
    assert package_budget_bytes(None, "macOS") == 2_000_000_000
    assert package_budget_bytes(0.5, "macOS") == 500_000


RECIPE = """name: r
task: text-generation
source: {{kind: hf-dir, path: .}}
target: macOS15
fixtures: {{token_ids: [[1, 2, 3]]}}
{rest}
"""


@pytest.mark.parametrize(
    ("rest", "message"),
    [
        ("cache: {style: state, package_budget_mb: 0}", "package_budget_mb"),
        ("cache: {style: state, package_budget_mb: -1}", "greater than 0"),
        ("cache: {style: io, package_budget_mb: .inf}", "package_budget_mb"),
        ("cache: {package_budget_mb: 100}", "applies to a cached decoder"),
    ],
)
def test_budget_rules_name_the_field(tmp_path: Path, rest: str, message: str) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(RECIPE.format(rest=rest))
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert message in str(info.value) and "package_budget_mb" in str(info.value)


def test_a_budget_is_accepted_on_a_cached_decoder(tmp_path: Path) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(RECIPE.format(rest="cache: {style: io, package_budget_mb: 0.25}"))
    assert load_recipe(file).cache.package_budget_mb == 0.25  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def tiny_module():  # type: ignore[no-untyped-def]
    from tiny_models import build_tiny, one_torch_thread

    threads = one_torch_thread()
    next(threads)
    yield build_tiny("llama", "embeddings", batch=1).module
    next(threads, None)


def _split_run(module, compression: object, budget_mb: float | None):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    cache = SimpleNamespace(
        style="state",
        length=32,
        prefill=8,
        extend=4,
        package_budget_mb=budget_mb,
        layout="multifunction",
    )
    recipe = SimpleNamespace(precision="float16", target="iOS18", compression=compression)
    return SimpleNamespace(
        rewrite=SimpleNamespace(module=module), recipe=recipe, cache=cache, split=[], budget=0
    )


def test_the_split_step_builds_each_chunks_functions(tiny_module) -> None:  # type: ignore[no-untyped-def]
    from converter.tasks.text_generation_kv import split_packages

    run = _split_run(tiny_module, None, 0.12)
    split_packages(run, lambda: None)  # type: ignore[arg-type]
    assert [c.layers for c in run.split] == [(0, 1), (1, 2), (2, 3)]
    assert [c["decode"].layers() for c in run.chunks] == [
        [layer] for layer in run.rewrite.module.decoder_layers()
    ]
    assert run.budget == 120_000 and run.functions is run.chunks[0]
    one = _split_run(tiny_module, None, None)  # iOS default: 1000 MB, one chunk
    split_packages(one, lambda: None)  # type: ignore[arg-type]
    assert [c.layers for c in one.split] == [(0, 3)] and one.budget == 1_000_000_000
