"""Atomic publishing of an artifact directory ``OUT/<name>/``.

Crash guarantee: the directory ``OUT/<name>`` is at all times either the previous complete
artifact or the new complete artifact, never a mixture or a partial one. An artifact is
built in a staging directory inside ``OUT`` (same filesystem, so renames are atomic),
fsynced, and then moved into place with a single rename:

* no previous artifact: ``renameat2(RENAME_NOREPLACE)`` (plain ``os.rename`` if the kernel
  or filesystem lacks it), so a concurrently created artifact is never overwritten;
* replacing (``force``): ``renameat2(RENAME_EXCHANGE)`` swaps old and new in one step, and the
  old content, now at the staging path, is deleted afterwards.

Fallback when ``RENAME_EXCHANGE`` is unavailable (non-Linux, old kernel, filesystem refusing
with EINVAL): the old directory is renamed to ``.anec-old-<name>-<pid>-<hex>``, the new one
renamed into place, the old one deleted. Between the two renames the name is briefly
ABSENT, but it never names a partial artifact; if the process dies in that window,
``clean_leftovers`` renames the old artifact back.

Leftovers of a killed process (``.anec-staging-*``, ``.anec-old-*``, ``.anec-tmp-*``) carry
the owner's pid and are removed by ``clean_leftovers`` once that process is gone.

The filesystem primitives (renameat2, fsync, atomic single-file writes) are in
``converter.pipeline.fsops``; this module is the staging protocol, signal handling and clean-up.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType

from converter.errors import InputError
from converter.pipeline import fsops

# Re-exported: the single-file writers have always been imported from here.
from converter.pipeline.fsops import TMP_PREFIX as TMP_PREFIX
from converter.pipeline.fsops import write_bytes_atomic as write_bytes_atomic
from converter.pipeline.fsops import write_json_atomic as write_json_atomic
from converter.pipeline.fsops import write_text_atomic as write_text_atomic

log = logging.getLogger(__name__)

STAGING_PREFIX = ".anec-staging-"
OLD_PREFIX = ".anec-old-"
FAILED_SUFFIX = ".failed"

_LEFTOVER_RE = re.compile(r"^\.anec-(staging|old|tmp)-(.+)-(\d+)-([0-9a-f]+)$")
# Keeps `.anec-staging-<name>-<pid>-<hex>` under the usual 255-byte filename limit.
_MAX_NAME_BYTES = 200
# Errors in the `with` block that mean "this output location is unusable", reported as
# InputError (exit 2) instead of a traceback.
_ENV_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}
)


# --------------------------------------------------------------------------- signals


class Interrupted(BaseException):
    """Raised in the main thread when a signal handled by ``signals_as_interrupts`` arrives.

    A BaseException like KeyboardInterrupt, so ``except Exception`` does not swallow it and
    ``with`` blocks still clean up. ``exit_code`` follows the shell convention 128 + signum.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


_critical_depth = 0
_pending_signal: int | None = None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _pending_signal
    if _critical_depth > 0:
        # Inside a rename sequence or cleanup: finish it first, raise when it ends.
        _pending_signal = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_as_interrupts(
    signals: Iterable[signal.Signals] = (signal.SIGTERM,),
) -> Iterator[None]:
    """While active, turn the given signals (default SIGTERM) into ``Interrupted``.

    This lets ``with stage_artifact(...)`` cleanup run when a CI runner terminates the job.
    Previous handlers are restored on exit. Outside the main thread Python cannot install
    handlers, so this is then a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _critical() -> Iterator[None]:
    """Defer ``Interrupted`` until the enclosed (short) section has finished."""
    global _critical_depth, _pending_signal
    # Handlers run only in the main thread, so only the main thread may defer them.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _critical_depth += 1
    try:
        yield
    finally:
        _critical_depth -= 1
        if _critical_depth == 0 and _pending_signal is not None:
            signum, _pending_signal = _pending_signal, None
            raise Interrupted(signum)


def validate_artifact_name(name: str) -> None:
    """Raise InputError unless ``name`` is a plain, single path component.

    Callers validate names too; this is defense in depth so nothing outside ``out_dir``
    is ever created, replaced or deleted.
    """
    if not isinstance(name, str) or not name:
        raise InputError("artifact name must be a non-empty string")
    separators = {"/", "\\", "\0", os.sep, os.altsep or "/"}
    if any(c in name for c in separators):
        raise InputError(f"artifact name {name!r} must not contain path separators or NUL")
    if ".." in name or name == ".":
        raise InputError(f"artifact name {name!r} must not contain '..' or be '.'")
    if name.startswith(".anec-"):
        raise InputError(f"artifact name {name!r} must not start with '.anec-' (reserved)")
    if len(os.fsencode(name)) > _MAX_NAME_BYTES:
        raise InputError(f"artifact name {name!r} is longer than {_MAX_NAME_BYTES} bytes")


# --------------------------------------------------------------------------- staging


class ArtifactStage:
    """A staging directory that becomes ``out_dir/name`` on ``commit()``, atomically.

    Use as a context manager (see ``stage_artifact``). On an exception in the block
    (including KeyboardInterrupt and ``Interrupted``) or leaving it without ``commit()``,
    the staging directory is removed and any previous artifact is left untouched. OSErrors
    such as ENOSPC or EACCES raised in the block are re-raised as InputError naming the path.
    ``path`` must not be used after ``commit()`` or ``keep_as_failed()``.
    """

    def __init__(self, out_dir: str | os.PathLike[str], name: str, force: bool = False) -> None:
        validate_artifact_name(name)
        self.out_dir = Path(out_dir)
        self.name = name
        self.force = force
        self.final_path = self.out_dir / name
        self._stage: Path | None = None
        self._state = "new"  # new -> open -> committed | kept | closed
        # (moved-aside old dir, its name) while a fallback swap has the name absent.
        self._aside: tuple[Path, Path] | None = None

    @property
    def path(self) -> Path:
        """The staging directory to write the artifact's files into."""
        if self._stage is None:
            raise RuntimeError("ArtifactStage.path is only available inside the `with` block")
        return self._stage

    @property
    def committed(self) -> bool:
        """True once the artifact has been published under its final name."""
        return self._state == "committed"

    def __enter__(self) -> ArtifactStage:
        if self._state != "new":
            raise RuntimeError("an ArtifactStage can be entered only once")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(
                f"output directory {self.out_dir} cannot be created: {fsops.os_reason(e)}"
            ) from e
        # Checked up front so no conversion work is wasted; checked again at commit.
        self._check_not_exists()
        stage = fsops.unique_sibling(self.out_dir, STAGING_PREFIX, self.name)
        # Critical: a signal between mkdir and recording the stage would orphan it.
        try:
            with _critical():
                try:
                    os.mkdir(stage, 0o777)  # honours the umask, unlike mkdtemp's 0o700
                except OSError as e:
                    raise InputError(
                        f"output directory {self.out_dir} is not writable: {fsops.os_reason(e)}"
                    ) from e
                self._stage = stage
                self._state = "open"
        except BaseException as e:
            # A signal deferred over the mkdir is raised as the section ends, still inside
            # __enter__, where the with statement calls no __exit__: clean up here.
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "open":
            self._state = "closed"
            if exc is None:
                log.warning("artifact %s was staged but not committed; discarded", self.name)
        with _critical():
            self._restore_aside()
            # After commit/keep this holds nothing, or the old content displaced by a swap.
            if self._stage is not None and os.path.lexists(self._stage):
                fsops.remove_path(self._stage)
        if isinstance(exc, OSError) and exc.errno in _ENV_ERRNOS:
            where = exc.filename if exc.filename is not None else self._stage
            raise InputError(
                f"could not build artifact {self.final_path}: {where}: {fsops.os_reason(exc)}"
            ) from exc

    def _check_not_exists(self) -> None:
        if not self.force and os.path.lexists(self.final_path):
            raise InputError(f"{self.final_path} already exists; pass --force to replace it")

    def _require_open(self, action: str) -> Path:
        if self._state != "open" or self._stage is None:
            raise RuntimeError(f"cannot {action}: stage is {self._state}, not open")
        return self._stage

    def _restore_aside(self) -> None:
        """Undo a half-done fallback swap so the previous content is back under its name."""
        if self._aside is None:
            return
        (aside, target), self._aside = self._aside, None
        if os.path.lexists(aside) and not os.path.lexists(target):
            try:
                os.rename(aside, target)
            except OSError as e:
                log.warning("could not restore %s to %s: %s", aside, target, fsops.os_reason(e))

    def _install(self, src: Path, dst: Path, replace: bool) -> Path | None:
        """Move ``src`` to ``dst`` atomically; return where displaced old content now is."""
        try:
            fsops.rename_noreplace(src, dst)
            return None
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not replace:
                raise InputError(f"{dst} already exists; pass --force to replace it") from e
        try:
            fsops.rename_exchange(src, dst)
            return src
        except OSError as e:
            if e.errno not in fsops.UNSUPPORTED_ERRNOS:
                raise
            log.debug("RENAME_EXCHANGE unavailable (%s); using rename-aside", fsops.os_reason(e))
        # Fallback: `dst` is absent between these two renames; see the module docstring.
        aside = fsops.unique_sibling(self.out_dir, OLD_PREFIX, dst.name)
        os.rename(dst, aside)
        self._aside = (aside, dst)
        os.rename(src, dst)
        self._aside = None
        return aside

    def commit(self) -> Path:
        """Publish the staged directory as ``out_dir/name`` and return that path.

        Replaces an existing artifact only if ``force`` was given; otherwise, if one
        appeared meanwhile, raises InputError. Files are fsynced before the rename.
        """
        stage = self._require_open("commit")
        try:
            fsops.fsync_tree(stage)
            with _critical():
                displaced = self._install(stage, self.final_path, replace=self.force)
                self._state = "committed"
        except OSError as e:
            raise InputError(f"cannot publish {self.final_path}: {fsops.os_reason(e)}") from e
        try:
            fsops.fsync_dir(self.out_dir)  # makes the rename itself durable
        except OSError as e:
            # Already published; the rename stays atomic, only its durability is unconfirmed.
            log.warning("could not fsync %s: %s", self.out_dir, fsops.os_reason(e))
        # Deleting the old artifact may take a while; a crash here leaves only a leftover.
        if displaced is not None:
            fsops.remove_path(displaced)
        return self.final_path

    def keep_as_failed(self) -> Path:
        """Move the staged directory to ``out_dir/<name>.failed`` instead of publishing it.

        Used when a parity gate fails, so its reports stay available for debugging while
        nothing appears under the final name. An older ``.failed`` directory is replaced.
        Not fsynced: it is a debugging aid, not an artifact. Returns the new path.
        """
        stage = self._require_open("keep as failed")
        failed = self.out_dir / (self.name + FAILED_SUFFIX)
        try:
            with _critical():
                displaced = self._install(stage, failed, replace=True)
                self._state = "kept"
        except OSError as e:
            raise InputError(
                f"cannot move failed artifact to {failed}: {fsops.os_reason(e)}"
            ) from e
        if displaced is not None:
            fsops.remove_path(displaced)
        return failed


def stage_artifact(
    out_dir: str | os.PathLike[str], name: str, force: bool = False
) -> ArtifactStage:
    """Return an ``ArtifactStage`` for ``out_dir/name``; use it in a ``with`` statement.

    Example::

        with stage_artifact(out, "model", force=args.force) as stage:
            build_into(stage.path)
            stage.commit()
    """
    return ArtifactStage(out_dir, name, force=force)


# --------------------------------------------------------------------------- leftovers


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else (EPERM): treat as alive
    return True


def clean_leftovers(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove staging, moved-aside and temp entries left in ``out_dir`` by dead processes.

    Only entries whose embedded pid is not alive are touched, so a concurrent conversion
    into the same directory is safe (on one host: pids are not checked across machines).
    A ``.anec-old-<name>-*`` directory whose ``<name>`` is absent is the previous artifact
    of a fallback swap interrupted mid-way: it is renamed back rather than deleted.
    Returns the paths removed (restored ones are logged, not returned).
    """
    root = Path(out_dir)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise InputError(f"cannot list output directory {root}: {fsops.os_reason(e)}") from e
    removed: list[Path] = []
    for entry in names:
        match = _LEFTOVER_RE.match(entry)
        if match is None or _pid_alive(int(match.group(3))):
            continue
        kind, target_name = match.group(1), match.group(2)
        path = root / entry
        if kind == "old":
            target = root / target_name
            if target_name not in (".", "..") and not os.path.lexists(target):
                try:
                    os.rename(path, target)
                    log.warning("restored interrupted replacement: %s -> %s", path, target)
                    continue
                except OSError as e:
                    # Never delete what may be the only copy of the previous artifact.
                    log.warning("could not restore %s: %s", path, fsops.os_reason(e))
                    continue
        if fsops.remove_path(path):
            removed.append(path)
    return removed
