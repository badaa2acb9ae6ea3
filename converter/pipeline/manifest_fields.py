"""The parts of ``manifest.json`` that the decoder and encoder pipelines fill the same way.

The recipe's identity, the tensor contract, the package entry, the hashed files written
beside the package (tables, tokenizer), the parity report and the provenance (checkpoint,
recipe, tool versions). Each pipeline adds its own fields (layout, deviations, ...).
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converter.checkpoints.loading import Checkpoint, tokenizer_json
from converter.coreml.program import TensorIO
from converter.pipeline.fsops import FileWriter, write_atomic
from converter.pipeline.hashing import hash_entries, mlpackage_content_files, sha256_file
from converter.pipeline.manifest import FileEntry, PackageEntry, TensorEntry
from converter.pipeline.publish import write_text_atomic
from converter.recipe import Recipe, ResolvedSource, recipe_to_dict

_NPY_BLOCK = 64 << 20  # bytes of rows cast and written at a time


def tools() -> dict[str, str]:
    """The Python version and the versions of the packages a conversion depends on."""
    versions = {"python": platform.python_version()}
    for dist in ("anec", "coremltools", "torch", "transformers", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def write_npy(
    path: Path, array: np.ndarray, meaning: str, dtype: type[np.generic] | None = None
) -> FileEntry:
    """Write ``array`` (cast to ``dtype``, if given) to ``path`` as ``.npy`` (no pickle),
    atomically; returns its entry. The bytes are ``np.save``'s, written a block of rows at a
    time: ``np.save`` into memory held a whole cast copy, the in-memory file and its bytes
    (Gemma 3's peak fell from 3.59 to 3.36 GiB without them)."""
    out = np.dtype(dtype if dtype is not None else array.dtype)
    header = {"descr": np.lib.format.dtype_to_descr(out), "fortran_order": False,
              "shape": array.shape}  # fmt: skip

    def write(f: FileWriter) -> None:
        np.lib.format.write_array_header_1_0(f, header)
        if array.ndim == 0 or len(array) == 0:
            f.write(np.ascontiguousarray(array, dtype=out).tobytes())
            return
        rows = max(1, _NPY_BLOCK // (out.itemsize * max(1, array[0].size)))
        for start in range(0, len(array), rows):
            f.write(np.ascontiguousarray(array[start : start + rows], dtype=out).tobytes())

    written = write_atomic(path, write)
    return FileEntry(
        file=written.name,
        sha256=sha256_file(written),
        dtype=str(out),
        shape=list(array.shape),
        meaning=meaning,
    )


def write_tokenizer(directory: Path, tokenizer: Any, meaning: str) -> FileEntry | None:
    """Write ``directory/tokenizer.json``; None when there is no tokenizer or no fast backend."""
    text = tokenizer_json(tokenizer) if tokenizer is not None else None
    if text is None:
        return None
    path = write_text_atomic(directory / "tokenizer.json", text)
    return FileEntry(file=path.name, sha256=sha256_file(path), meaning=meaning)


def package_entry(path: Path, ops: Mapping[str, int]) -> PackageEntry:
    """The entry of one saved ``.mlpackage``: content hashes and live op counts."""
    files = mlpackage_content_files(path)  # each file read once: the whole hash is of these
    return PackageEntry(
        file=path.name,
        content_sha256=hash_entries(files),
        files=files,
        function="main",
        live_ops=dict(sorted(ops.items())),
    )


def common_fields(
    recipe: Recipe,
    source: ResolvedSource,
    ckpt: Checkpoint,
    inputs: list[TensorIO],
    outputs: list[TensorIO],
    package: Path,
    ops: Mapping[str, int],
    tokenizer: FileEntry | None,
    parity_path: Path,
) -> dict[str, Any]:
    """The `Manifest` fields every pipeline fills the same way, as keyword arguments."""

    def entry(t: TensorIO) -> TensorEntry:
        return TensorEntry(name=t.name, shape=list(t.shape), dtype=t.dtype, meaning=t.meaning)

    return {
        "name": recipe.name,
        "task": recipe.task,
        "target": recipe.target,
        "precision": recipe.precision,
        "inputs": [entry(t) for t in inputs],
        "outputs": [entry(t) for t in outputs],
        "package": package_entry(package, ops),
        "tokenizer": tokenizer,
        "parity": FileEntry(file=parity_path.name, sha256=sha256_file(parity_path)),
        "checkpoint": {
            "source": {
                "kind": source.kind,
                "directory": str(source.directory),
                "gguf_file": source.gguf_file,
            },
            "sha256": ckpt.sha256,
            "license": ckpt.license,
            "note": ckpt.note,
        },
        "recipe": {
            **recipe_to_dict(recipe),
            "sha256": sha256_file(recipe.source_file) if recipe.source_file else None,
        },
        "tools": tools(),
    }
