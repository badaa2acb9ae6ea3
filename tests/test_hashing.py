"""Tests for converter.pipeline.hashing: file, tree and .mlpackage content hashes."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from converter.errors import InputError
from converter.pipeline.hashing import (
    mlpackage_content_files,
    mlpackage_content_hash,
    sha256_file,
    tree_hash,
)


def _make_mlpackage(root: Path, weights: bytes = b"\x01\x02weights") -> Path:
    """A minimal .mlpackage layout with a Manifest.json carrying fresh UUIDs, as coremltools."""
    pkg = root / "model.mlpackage"
    data = pkg / "Data" / "com.apple.CoreML"
    (data / "weights").mkdir(parents=True)
    (data / "model.mlmodel").write_bytes(b"spec-bytes")
    (data / "weights" / "weight.bin").write_bytes(weights)
    manifest = {
        "fileFormatVersion": "1.0.0",
        "itemInfoEntries": {str(uuid.uuid4()): {"path": "com.apple.CoreML/model.mlmodel"}},
        "rootModelIdentifier": str(uuid.uuid4()),
    }
    (pkg / "Manifest.json").write_text(json.dumps(manifest))
    return pkg


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    data = bytes(range(256)) * 5000  # spans several read chunks
    f.write_bytes(data)
    assert sha256_file(f) == hashlib.sha256(data).hexdigest()


def test_sha256_file_missing_is_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nope.bin"):
        sha256_file(tmp_path / "nope.bin")


def test_same_content_same_hash(tmp_path: Path) -> None:
    a = _make_mlpackage(tmp_path / "a")
    b = _make_mlpackage(tmp_path / "b")
    assert tree_hash(a / "Data") == tree_hash(b / "Data")
    assert mlpackage_content_hash(a) == mlpackage_content_hash(b)


def test_manifest_differences_ignored(tmp_path: Path) -> None:
    a = _make_mlpackage(tmp_path / "a")
    b = _make_mlpackage(tmp_path / "b")
    # Fresh UUIDs per save: the manifests differ, so the plain tree hash differs...
    assert (a / "Manifest.json").read_bytes() != (b / "Manifest.json").read_bytes()
    assert tree_hash(a) != tree_hash(b)
    # ...but the content hash does not.
    assert mlpackage_content_hash(a) == mlpackage_content_hash(b)
    files = mlpackage_content_files(a)
    assert "Manifest.json" not in files
    assert set(files) == {
        "Data/com.apple.CoreML/model.mlmodel",
        "Data/com.apple.CoreML/weights/weight.bin",
    }
    assert files["Data/com.apple.CoreML/model.mlmodel"] == sha256_file(
        a / "Data/com.apple.CoreML/model.mlmodel"
    )


def test_nested_manifest_is_not_excluded(tmp_path: Path) -> None:
    a = _make_mlpackage(tmp_path / "a")
    b = _make_mlpackage(tmp_path / "b")
    (a / "Data" / "Manifest.json").write_text("1")
    (b / "Data" / "Manifest.json").write_text("2")
    assert mlpackage_content_hash(a) != mlpackage_content_hash(b)


def test_changed_weight_changes_hash(tmp_path: Path) -> None:
    a = _make_mlpackage(tmp_path / "a")
    b = _make_mlpackage(tmp_path / "b", weights=b"\x01\x02weightz")
    assert mlpackage_content_hash(a) != mlpackage_content_hash(b)
    assert tree_hash(a / "Data") != tree_hash(b / "Data")


def test_renamed_file_changes_tree_hash(tmp_path: Path) -> None:
    a = _make_mlpackage(tmp_path / "a")
    before = tree_hash(a)
    content_before = mlpackage_content_hash(a)
    weights = a / "Data/com.apple.CoreML/weights"
    (weights / "weight.bin").rename(weights / "weight2.bin")
    assert tree_hash(a) != before
    assert mlpackage_content_hash(a) != content_before


def test_tree_hash_exclude_and_empty_dirs(tmp_path: Path) -> None:
    (tmp_path / "t" / "keep").mkdir(parents=True)
    (tmp_path / "t" / "keep" / "f").write_text("x")
    base = tree_hash(tmp_path / "t")
    (tmp_path / "t" / "empty").mkdir()
    assert tree_hash(tmp_path / "t") == base  # empty directories do not count
    (tmp_path / "t" / "skip").mkdir()
    (tmp_path / "t" / "skip" / "g").write_text("y")
    assert tree_hash(tmp_path / "t") != base
    assert tree_hash(tmp_path / "t", exclude=lambda rel: rel == Path("skip")) == base


def test_not_a_package_or_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not an .mlpackage"):
        mlpackage_content_hash(tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        tree_hash(tmp_path / "f")
