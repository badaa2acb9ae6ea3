"""Filesystem primitives for atomic publishing: renameat2, fsync, atomic single-file writes.

``converter.pipeline.publish`` builds its crash guarantee on these: ``rename_exchange`` swaps two
directories in one step, ``rename_noreplace`` never overwrites, ``fsync_tree`` flushes a
staged artifact before it is renamed into place, and ``write_*_atomic`` replace one file so
readers see the old or the complete new one. Leftover-style names (``unique_sibling``) carry
the owner's pid so ``publish.clean_leftovers`` can remove them once that process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import platform
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from converter.errors import InputError

log = logging.getLogger(__name__)

TMP_PREFIX = ".anec-tmp-"

# renameat2 errors meaning "not supported here", as opposed to a real failure.
UNSUPPORTED_ERRNOS = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}


# --------------------------------------------------------------------------- renameat2


@functools.cache
def renameat2_func() -> Callable[[bytes, bytes, int], int] | None:
    """Return a ``renameat2(old, new, flags)`` caller, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    func = getattr(libc, "renameat2", None)  # glibc >= 2.28; musl >= 1.2.2
    if func is not None:
        func.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_uint,
        ]
        func.restype = ctypes.c_int
        return lambda old, new, flags: int(func(_AT_FDCWD, old, _AT_FDCWD, new, flags))
    return syscall_renameat2(libc, platform.machine())


def syscall_renameat2(libc: ctypes.CDLL, machine: str) -> Callable[[bytes, bytes, int], int] | None:
    """renameat2 through ``syscall(2)``, for a libc (glibc < 2.28) without the wrapper."""
    number = _SYS_RENAMEAT2.get(machine.lower())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long
    # syscall() is variadic: pass full-width longs so every register is well defined.
    return lambda old, new, flags: int(
        syscall(
            ctypes.c_long(number),
            ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(old),
            ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(new),
            ctypes.c_long(flags),
        )
    )


def renameat2(old: Path, new: Path, flags: int) -> None:
    func = renameat2_func()
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(old), None, str(new))
    if func(os.fsencode(old), os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(old), None, str(new))


def rename_exchange(a: Path, b: Path) -> None:
    """Atomically swap ``a`` and ``b`` (both must exist)."""
    renameat2(a, b, RENAME_EXCHANGE)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, raising FileExistsError if ``dst`` exists."""
    try:
        renameat2(src, dst, RENAME_NOREPLACE)
        return
    except OSError as e:
        if e.errno not in UNSUPPORTED_ERRNOS:
            raise
    # Fallback: check-then-rename has a tiny race, and os.rename would replace an empty dir.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


# --------------------------------------------------------------------------- fs helpers


def unique_sibling(directory: Path, prefix: str, name: str) -> Path:
    """A fresh leftover-style name ``<prefix><name>-<pid>-<hex>`` in ``directory``."""
    return directory / f"{prefix}{name}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems refuse fsync on directories; the data is then as safe as it gets.
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` so a rename never exposes lost data."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def remove_path(path: Path) -> bool:
    """Best-effort removal of a file, symlink or directory tree; True if it is gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("could not remove %s: %s", path, e.strerror or e)
        return False
    return True


def os_reason(e: OSError) -> str:
    return e.strerror or str(e)


# --------------------------------------------------------------------------- single files


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see ``write_atomic``)."""
    return write_atomic(path, lambda f: f.write(data))


class FileWriter:
    """The open temp file ``write_atomic`` gives its writer: ``write`` writes all of ``data``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        return len(data)


def write_atomic(path: str | os.PathLike[str], write: Callable[[FileWriter], object]) -> Path:
    """Write ``path`` atomically through ``write``, given the open file: temp file in the same
    directory, fsync, replace.

    Readers see either the old file or the complete new one. Any OSError (ENOSPC, EACCES,
    ...) becomes an InputError naming the path, and the temp file is removed.
    """
    target = Path(path)
    # Truncated so long report names still give a valid temp filename.
    tmp = unique_sibling(target.parent, TMP_PREFIX, target.name[:100])
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            write(FileWriter(fd))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise InputError(f"cannot write {target}: {os_reason(e)}") from e
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def write_text_atomic(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see ``write_bytes_atomic``)."""
    return write_bytes_atomic(path, text.encode(encoding))


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> Path:
    """Write ``obj`` as JSON (sorted keys, trailing newline) to ``path`` atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n"
    return write_text_atomic(path, text)
