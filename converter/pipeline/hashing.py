"""Content hashes for files, directory trees and Core ML packages.

All hashes are lowercase hex SHA-256. Tree hashes cover each file's relative POSIX path
and content, so a renamed or moved file changes the hash; empty directories do not count.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from converter.errors import InputError

_CHUNK = 1 << 20
# Bumped if the tree hash encoding ever changes, so old and new hashes never collide.
_TREE_HASH_TAG = b"anec-tree-hash-v1\n"
MLPACKAGE_MANIFEST = "Manifest.json"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the SHA-256 of a file's content, read in chunks so large weights fit in memory."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as e:
        raise InputError(f"cannot hash {path}: {e.strerror or e}") from e
    return digest.hexdigest()


def tree_files(
    path: str | os.PathLike[str], exclude: Callable[[Path], bool] | None = None
) -> dict[str, str]:
    """Map each file under directory ``path`` (relative POSIX path) to its SHA-256.

    ``exclude`` receives paths relative to ``path`` (files and directories); returning True
    skips the file or prunes the whole directory. Symlinks to files are hashed by the
    content they point at; symlinked directories are refused rather than silently skipped
    or followed into loops. The result is ordered by path bytes.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"cannot hash {root}: not a directory")
    found: dict[str, str] = {}

    def onerror(e: OSError) -> None:
        raise InputError(f"cannot hash {root}: {e.filename}: {e.strerror or e}") from e

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
        here = Path(dirpath)
        kept_dirs = []
        for d in dirnames:
            rel = (here / d).relative_to(root)
            if exclude is not None and exclude(rel):
                continue
            if (here / d).is_symlink():
                raise InputError(f"cannot hash {root}: {rel.as_posix()} is a symlinked directory")
            kept_dirs.append(d)
        dirnames[:] = kept_dirs  # prune excluded directories from the walk
        for f in filenames:
            rel = (here / f).relative_to(root)
            if exclude is not None and exclude(rel):
                continue
            found[rel.as_posix()] = sha256_file(here / f)
    # Byte order, not locale or filesystem order, so every machine gets the same hash.
    return dict(sorted(found.items(), key=lambda kv: os.fsencode(kv[0])))


def hash_entries(entries: dict[str, str]) -> str:
    """Combine ``relative path -> sha256`` entries into one deterministic hash."""
    digest = hashlib.sha256(_TREE_HASH_TAG)
    for rel in sorted(entries, key=os.fsencode):
        # NUL and newline cannot be confused with path or hex characters: unambiguous encoding.
        digest.update(os.fsencode(rel) + b"\0" + entries[rel].encode("ascii") + b"\n")
    return digest.hexdigest()


def tree_hash(path: str | os.PathLike[str], exclude: Callable[[Path], bool] | None = None) -> str:
    """Return a deterministic hash over the files of a directory tree.

    It covers the sorted relative POSIX paths and each file's SHA-256; see ``tree_files``
    for how ``exclude`` and symlinks are handled.
    """
    return hash_entries(tree_files(path, exclude))


def _is_top_manifest(rel: Path) -> bool:
    return rel == Path(MLPACKAGE_MANIFEST)


def mlpackage_content_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """Map each content file of an ``.mlpackage`` (relative path) to its SHA-256.

    The top-level ``Manifest.json`` is excluded: coremltools writes fresh UUIDs into it on
    every save, so it differs between two conversions of the same recipe while
    ``Data/.../model.mlmodel`` and the weight files are identical.
    """
    root = Path(path)
    if not (root / MLPACKAGE_MANIFEST).is_file():
        raise InputError(f"{root} is not an .mlpackage: it has no {MLPACKAGE_MANIFEST}")
    return tree_files(root, exclude=_is_top_manifest)


def mlpackage_content_hash(path: str | os.PathLike[str]) -> str:
    """Return the hash of an ``.mlpackage``'s content, ignoring its top-level Manifest.json."""
    return hash_entries(mlpackage_content_files(path))
