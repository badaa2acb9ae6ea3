"""Bad input to `convert` fails before any work, names the field and leaves no output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from converter.errors import InputError
from converter.pipeline.run import convert
from converter.recipe import load_recipe

RECIPE = """\
name: tiny
task: text-generation
source:
  kind: gguf
  path: {path}
attention: {attention}
fixtures:
  token_ids: [[1, 2, 3]]
"""


def test_unimplemented_attention_form_is_refused_before_any_output(
    write_file: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """Refused when the recipe is validated (`anec recipes validate` too), not by convert."""
    path = write_file("r.yaml", RECIPE.format(path="missing.gguf", attention="heads-batched"))
    with pytest.raises(InputError, match=r"r\.yaml:\d+: attention: heads-batched is not impl"):
        load_recipe(path)


def test_missing_checkpoint_names_the_field_and_publishes_nothing(
    write_file: Callable[[str, str], Path], tmp_path: Path
) -> None:
    recipe = load_recipe(
        write_file("r.yaml", RECIPE.format(path="missing.gguf", attention="per-head"))
    )
    out = tmp_path / "out"
    with pytest.raises(InputError, match="source.path"):
        convert(recipe, out_dir=out)
    assert not out.exists() or list(out.iterdir()) == []
