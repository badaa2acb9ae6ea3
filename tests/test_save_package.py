"""`converter.coreml.program.save_package` moves the package ``ct.convert`` wrote instead of copying
it, and the saved package is the one ``MLModel.save`` writes (canonicalized): the same spec,
with the metadata coremltools sets after the conversion, and the same weights."""

from __future__ import annotations

from pathlib import Path

import coremltools as ct
import torch

from converter.coreml.program import (
    SPEC_FILE,
    TensorIO,
    canonicalize_spec,
    save_package,
    to_mlprogram,
)
from converter.coreml.program import trace as trace_module
from converter.pipeline.hashing import mlpackage_content_hash


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


def _converted() -> ct.models.MLModel:
    ins = [TensorIO("x", (1, 8, 1, 4), "float16", "input")]
    outs = [TensorIO("y", (1, 4, 1, 4), "float16", "output")]
    traced = trace_module(_Tiny(), ins)
    return to_mlprogram(traced, ins, outs, ct.target.macOS14, "float16")


def test_the_package_is_moved_and_is_what_save_writes(tmp_path: Path) -> None:
    mlmodel = _converted()
    written = Path(mlmodel.package_path)
    assert mlmodel.is_temp_package and written.is_dir()
    moved = save_package(mlmodel, tmp_path / "moved.mlpackage")
    assert not written.exists()  # moved, not copied
    assert Path(mlmodel.package_path) == moved and not mlmodel.is_temp_package

    # The reference: MLModel.save (a copy of the package plus the model's own spec).
    saved = tmp_path / "saved.mlpackage"
    mlmodel.save(str(saved))
    canonicalize_spec(saved)
    assert (moved / SPEC_FILE).read_bytes() == (saved / SPEC_FILE).read_bytes()
    assert mlpackage_content_hash(moved) == mlpackage_content_hash(saved)
    metadata = ct.models.MLModel(str(moved), skip_model_load=True).user_defined_metadata
    assert "com.github.apple.coremltools.version" in metadata


def test_a_package_already_saved_is_copied(tmp_path: Path) -> None:
    mlmodel = _converted()
    first = save_package(mlmodel, tmp_path / "first.mlpackage")
    second = save_package(mlmodel, tmp_path / "second.mlpackage")
    assert first.is_dir() and second.is_dir()
    assert mlpackage_content_hash(first) == mlpackage_content_hash(second)
