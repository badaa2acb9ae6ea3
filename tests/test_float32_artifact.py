"""A float32 recipe ships what its gates ran: the host embedding table in float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_models import one_torch_thread, save_tiny_llama, write_tiny_recipe

from converter.pipeline.run import convert
from converter.recipe import load_recipe


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


def test_float32_decoder_ships_a_float32_embedding_table(tmp_path: Path) -> None:
    checkpoint = save_tiny_llama(tmp_path / "ckpt")  # tied embeddings: the table stays on the host
    recipe = write_tiny_recipe(tmp_path / "r.yaml", checkpoint, precision="float32")
    doc = yaml.safe_load(recipe.read_text())
    doc["io"]["dtype"] = "float32"
    recipe.write_text(yaml.safe_dump(doc))
    result = convert(load_recipe(recipe), tmp_path / "out")
    assert result.passed, [g for g in result.parity.gates if not g.passed]
    art = tmp_path / "out" / "tiny"
    table = np.load(art / "embeddings.npy")
    assert table.dtype == np.float32
    assert (art / "manifest.json").is_file()
