"""Tests for converter.pipeline.publish: atomic artifact staging, replacement, cleanup and
signals.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from converter.errors import InputError
from converter.pipeline import fsops
from converter.pipeline.publish import (
    Interrupted,
    clean_leftovers,
    signals_as_interrupts,
    stage_artifact,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def snapshot(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under root."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_old(out: Path, name: str = "m") -> dict[str, bytes]:
    old = out / name
    (old / "Data").mkdir(parents=True)
    (old / "Data" / "old_weight.bin").write_bytes(b"old" * 100)
    (old / "report.json").write_text('{"old": true}')
    return snapshot(old)


def write_new(stage_path: Path) -> dict[str, bytes]:
    (stage_path / "Data").mkdir()
    (stage_path / "Data" / "new_weight.bin").write_bytes(b"new" * 100)
    (stage_path / "report.json").write_text('{"new": true}')
    return snapshot(stage_path)


def entries(out: Path) -> list[str]:
    return sorted(os.listdir(out))


def dead_pid() -> int:
    """A pid that belonged to a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------- publishing


def test_new_artifact_appears_only_after_commit(tmp_path: Path) -> None:
    out = tmp_path / "out" / "nested"  # created on demand
    with stage_artifact(out, "m") as stage:
        assert stage.path.parent == out
        assert stage.path.name.startswith(f".anec-staging-m-{os.getpid()}-")
        new = write_new(stage.path)
        assert not (out / "m").exists()
        final = stage.commit()
        assert stage.committed
    assert final == out / "m"
    assert snapshot(final) == new
    assert entries(out) == ["m"]


def test_published_dir_honours_umask(tmp_path: Path) -> None:
    with stage_artifact(tmp_path, "m") as stage:
        stage.commit()
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o777 & ~mask


def test_exception_in_block_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="boom"), stage_artifact(tmp_path, "m") as stage:
        write_new(stage.path)
        raise ValueError("boom")
    assert entries(tmp_path) == []


def test_keyboard_interrupt_in_block_keeps_old(tmp_path: Path) -> None:
    old = make_old(tmp_path)
    with pytest.raises(KeyboardInterrupt), stage_artifact(tmp_path, "m", force=True) as stage:
        write_new(stage.path)
        raise KeyboardInterrupt
    assert snapshot(tmp_path / "m") == old
    assert entries(tmp_path) == ["m"]


def test_return_without_commit_discards(tmp_path: Path) -> None:
    with stage_artifact(tmp_path, "m") as stage:
        write_new(stage.path)
    assert entries(tmp_path) == []
    assert not stage.committed


def test_existing_without_force_fails_before_building(tmp_path: Path) -> None:
    old = make_old(tmp_path)
    built = False
    with (
        pytest.raises(InputError, match=r"already exists.*--force") as info,
        stage_artifact(tmp_path, "m"),
    ):
        built = True
    assert str(tmp_path / "m") in str(info.value)
    assert not built
    assert snapshot(tmp_path / "m") == old
    assert entries(tmp_path) == ["m"]


def test_existing_appearing_during_build_fails_at_commit(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--force"), stage_artifact(tmp_path, "m") as stage:
        write_new(stage.path)
        other = make_old(tmp_path)  # a concurrent run published meanwhile
        stage.commit()
    assert snapshot(tmp_path / "m") == other
    assert entries(tmp_path) == ["m"]


def test_force_replaces_completely_only_at_commit(tmp_path: Path) -> None:
    old = make_old(tmp_path)
    with stage_artifact(tmp_path, "m", force=True) as stage:
        new = write_new(stage.path)
        assert snapshot(tmp_path / "m") == old  # untouched until commit
        stage.commit()
    after = snapshot(tmp_path / "m")
    assert after == new
    assert not (set(old) - {"report.json"}) & set(after)  # no old-only file survives
    assert "Data/old_weight.bin" not in after
    assert entries(tmp_path) == ["m"]


def test_force_uses_exchange_when_available(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "fa").write_text("a")
    (b / "fb").write_text("b")
    try:
        fsops.rename_exchange(a, b)
    except OSError as e:
        if e.errno in fsops.UNSUPPORTED_ERRNOS:
            pytest.skip(f"RENAME_EXCHANGE unsupported here: {e}")
        raise
    assert (a / "fb").exists() and (b / "fa").exists()


def test_exchange_via_raw_syscall(tmp_path: Path) -> None:
    """The syscall(2) route used when libc has no renameat2 wrapper."""
    import ctypes
    import platform

    func = fsops.syscall_renameat2(ctypes.CDLL(None, use_errno=True), platform.machine())
    if func is None or not sys.platform.startswith("linux"):
        pytest.skip("no known renameat2 syscall number for this platform")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "fa").write_text("a")
    rc = func(os.fsencode(a), os.fsencode(b), fsops.RENAME_EXCHANGE)
    if rc != 0 and ctypes.get_errno() in fsops.UNSUPPORTED_ERRNOS:
        pytest.skip("RENAME_EXCHANGE unsupported here")
    assert rc == 0
    assert (b / "fa").exists() and not (a / "fa").exists()
    # NOREPLACE onto an existing directory must fail with EEXIST.
    assert func(os.fsencode(a), os.fsencode(b), fsops.RENAME_NOREPLACE) != 0
    assert ctypes.get_errno() == errno.EEXIST


def test_exchange_fallback_when_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Path, Path]] = []

    def refuse(a: Path, b: Path) -> None:
        calls.append((a, b))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fsops, "rename_exchange", refuse)
    old = make_old(tmp_path)
    with stage_artifact(tmp_path, "m", force=True) as stage:
        new = write_new(stage.path)
        stage.commit()
    assert calls, "the exchange must be attempted first"
    assert snapshot(tmp_path / "m") == new != old
    assert entries(tmp_path) == ["m"]  # no .anec-old-* left


def test_fallback_failure_restores_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the second rename of the fallback fails, the old artifact is put back."""

    def refuse(a: Path, b: Path) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    real_rename = os.rename

    def rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if Path(src).name.startswith(".anec-staging-"):
            raise OSError(errno.EIO, "Input/output error", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(fsops, "rename_exchange", refuse)
    old = make_old(tmp_path)
    with (
        pytest.raises(InputError, match="Input/output error"),
        stage_artifact(tmp_path, "m", force=True) as stage,
    ):
        write_new(stage.path)
        monkeypatch.setattr(os, "rename", rename)
        stage.commit()
    monkeypatch.setattr(os, "rename", real_rename)
    assert snapshot(tmp_path / "m") == old
    assert entries(tmp_path) == ["m"]


def test_noreplace_fallback_without_renameat2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsops, "renameat2_func", lambda: None)
    with stage_artifact(tmp_path, "m") as stage:
        new = write_new(stage.path)
        stage.commit()
    assert snapshot(tmp_path / "m") == new
    old = snapshot(tmp_path / "m")
    with pytest.raises(InputError, match="--force"), stage_artifact(tmp_path, "m"):
        pass
    with stage_artifact(tmp_path, "m", force=True) as stage:
        (stage.path / "x").write_text("x")
        stage.commit()
    assert snapshot(tmp_path / "m") == {"x": b"x"} != old
    assert entries(tmp_path) == ["m"]


def test_keep_as_failed(tmp_path: Path) -> None:
    old = make_old(tmp_path)
    (tmp_path / "m.failed").mkdir()
    (tmp_path / "m.failed" / "stale.txt").write_text("older failure")
    with (
        pytest.raises(RuntimeError, match="gate"),
        stage_artifact(tmp_path, "m", force=True) as stage,
    ):
        new = write_new(stage.path)
        kept = stage.keep_as_failed()
        raise RuntimeError("gate failed")
    assert kept == tmp_path / "m.failed"
    assert snapshot(kept) == new  # older .failed replaced, not merged
    assert snapshot(tmp_path / "m") == old  # nothing published
    assert entries(tmp_path) == ["m", "m.failed"]


def test_commit_twice_is_an_error(tmp_path: Path) -> None:
    with stage_artifact(tmp_path, "m") as stage:
        stage.commit()
        with pytest.raises(RuntimeError):
            stage.commit()
        with pytest.raises(RuntimeError):
            stage.keep_as_failed()


@pytest.mark.parametrize("name", ["", "a/b", "../x", "..", ".", "a\\b", "x\0y", ".anec-old-x"])
def test_bad_names_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError):
        stage_artifact(tmp_path / "out", name)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- OS errors


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_out_dir_not_creatable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def mkdir(path: str | os.PathLike[str], mode: int = 0o777, **kw: object) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = tmp_path / "out"
    with pytest.raises(InputError) as info, stage_artifact(out, "m"):
        pytest.fail("block must not run")
    assert str(out) in str(info.value)
    assert os.strerror(code) in str(info.value)


def test_out_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(InputError, match="out"), stage_artifact(tmp_path / "out", "m"):
        pass


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_write_helper_failure_in_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 1000:
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    old = make_old(tmp_path)
    with (
        pytest.raises(InputError) as info,
        stage_artifact(tmp_path, "m", force=True) as stage,
    ):
        write_bytes_atomic(stage.path / "small.bin", b"ok")
        monkeypatch.setattr(os, "write", write)
        write_bytes_atomic(stage.path / "weight.bin", b"\0" * 5000)
        stage.commit()
    assert "weight.bin" in str(info.value)
    assert os.strerror(code) in str(info.value)
    assert snapshot(tmp_path / "m") == old
    assert entries(tmp_path) == ["m"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_raw_oserror_in_block_becomes_input_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Code writing with plain open() (e.g. a model saver) gets the same treatment."""
    import builtins

    real_open = builtins.open

    def fake_open(file: object, mode: str = "r", *args: object, **kw: object) -> object:
        if "w" in mode:
            raise OSError(code, os.strerror(code), str(file))
        return real_open(file, mode, *args, **kw)  # type: ignore[call-overload]

    with pytest.raises(InputError) as info, stage_artifact(tmp_path, "m") as stage:
        monkeypatch.setattr(builtins, "open", fake_open)
        with open(stage.path / "model.mlmodel", "wb") as f:
            f.write(b"x")
    monkeypatch.setattr(builtins, "open", real_open)
    assert "model.mlmodel" in str(info.value)
    assert os.strerror(code) in str(info.value)
    assert entries(tmp_path) == []


def test_commit_rename_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(src: Path, dst: Path, flags: int) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(src), None, str(dst))

    monkeypatch.setattr(fsops, "renameat2", refuse)
    with (
        pytest.raises(InputError, match="Permission denied") as info,
        stage_artifact(tmp_path, "m") as stage,
    ):
        write_new(stage.path)
        stage.commit()
    assert str(tmp_path / "m") in str(info.value)
    assert entries(tmp_path) == []


# ----------------------------------------------------------------- single-file writes


def test_write_helpers(tmp_path: Path) -> None:
    write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    write_text_atomic(tmp_path / "t.txt", "héllo")
    write_json_atomic(tmp_path / "r.json", {"b": 1, "a": [1, 2]})
    write_json_atomic(tmp_path / "r.json", {"z": 0})  # replaces
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    assert json.loads((tmp_path / "r.json").read_text()) == {"z": 0}
    assert (tmp_path / "r.json").read_text().endswith("\n")
    assert entries(tmp_path) == ["b.bin", "r.json", "t.txt"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_write_json_failure_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    target = tmp_path / "report.json"
    write_json_atomic(target, {"v": 1})

    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(InputError) as info:
        write_json_atomic(target, {"v": 2})
    assert str(target) in str(info.value)
    assert os.strerror(code) in str(info.value)
    assert json.loads(target.read_text()) == {"v": 1}
    assert entries(tmp_path) == ["report.json"]


# ----------------------------------------------------------------- leftovers


def test_clean_leftovers(tmp_path: Path) -> None:
    dead, live = dead_pid(), os.getpid()
    make_old(tmp_path, "keep")
    doomed = [
        tmp_path / f".anec-staging-my-model-{dead}-0a1b2c3d",
        tmp_path / f".anec-old-keep-{dead}-deadbeef",  # "keep" exists: old copy is stale
    ]
    survivors = [
        tmp_path / f".anec-staging-my-model-{live}-0a1b2c3d",
        tmp_path / f".anec-old-keep-{live}-deadbeef",
        tmp_path / ".anec-staging-unparseable",
        tmp_path / "keep.failed",
    ]
    for d in doomed + survivors:
        d.mkdir()
        (d / "f").write_text("x")
    tmp_file = tmp_path / f".anec-tmp-report.json-{dead}-00ff00ff"
    tmp_file.write_text("partial")
    removed = clean_leftovers(tmp_path)
    assert sorted(removed) == sorted([*doomed, tmp_file])
    for d in survivors:
        assert d.exists()
    assert (tmp_path / "keep").exists()


def test_clean_leftovers_restores_interrupted_fallback(tmp_path: Path) -> None:
    """A crash between the two fallback renames leaves the old artifact aside: put it back."""
    dead = dead_pid()
    old = make_old(tmp_path, "m")
    os.rename(tmp_path / "m", tmp_path / f".anec-old-m-{dead}-12345678")
    (tmp_path / f".anec-staging-m-{dead}-87654321").mkdir()
    removed = clean_leftovers(tmp_path)
    assert removed == [tmp_path / f".anec-staging-m-{dead}-87654321"]
    assert snapshot(tmp_path / "m") == old
    assert entries(tmp_path) == ["m"]


def test_clean_leftovers_missing_dir(tmp_path: Path) -> None:
    assert clean_leftovers(tmp_path / "absent") == []


# ----------------------------------------------------------------- signals


def test_signals_as_interrupts_raises_and_restores() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info, signals_as_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
    assert info.value.signum == signal.SIGTERM
    assert info.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_signals_as_interrupts_noop_off_main_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def run() -> None:
        with signals_as_interrupts():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [before]


def test_sigterm_during_commit_is_deferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM arriving mid-rename lets the rename finish, then interrupts."""
    real = fsops.rename_noreplace

    def rename_then_signal(src: Path, dst: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        real(src, dst)

    monkeypatch.setattr(fsops, "rename_noreplace", rename_then_signal)
    with (
        pytest.raises(Interrupted),
        signals_as_interrupts(),
        stage_artifact(tmp_path, "m") as stage,
    ):
        new = write_new(stage.path)
        stage.commit()
        pytest.fail("the deferred signal must be raised when commit's renames end")
    assert snapshot(tmp_path / "m") == new
    assert entries(tmp_path) == ["m"]


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from converter.pipeline.publish import Interrupted, signals_as_interrupts, stage_artifact

    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        with signals_as_interrupts(), stage_artifact(out, "m", force=True) as stage:
            (stage.path / "new_weight.bin").write_bytes(b"new" * 1000)
            # Written aside and renamed, so the parent never reads a half-written path.
            marker.with_suffix(".tmp").write_text(str(stage.path))
            marker.with_suffix(".tmp").rename(marker)
            time.sleep(600)
            stage.commit()
    except Interrupted as e:
        sys.exit(e.exit_code)
    sys.exit(0)
    """
)


def test_real_sigterm_in_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = make_old(out)
    marker = tmp_path / "marker"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, "child exited before staging"
            assert time.monotonic() < deadline, "child never started staging"
            time.sleep(0.02)
        stage_path = Path(marker.read_text())
        assert stage_path.is_dir()
        proc.send_signal(signal.SIGTERM)
        # Generous: removing the stage syncs the disk, which can take long when other
        # tests write packages beside it. A lost signal still fails (the child sleeps 600 s).
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signal.SIGTERM
    assert not stage_path.exists()
    assert snapshot(out / "m") == old
    assert entries(out) == ["m"]


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_write_npy_writes_np_save_bytes_a_block_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str | None
) -> None:
    """A host table is cast and written in blocks of rows (no whole copy), as np.save's bytes."""
    import io

    import numpy as np

    from converter.pipeline import manifest_fields

    monkeypatch.setattr(manifest_fields, "_NPY_BLOCK", 1000)  # many blocks
    table = np.random.default_rng(0).standard_normal((1001, 37)).astype(np.float32)
    cast = np.float16 if dtype else None
    entry = manifest_fields.write_npy(tmp_path / "t.npy", table, "rows", cast)
    expected = io.BytesIO()
    np.save(expected, table.astype(cast) if cast else table, allow_pickle=False)
    assert (tmp_path / "t.npy").read_bytes() == expected.getvalue()
    assert entry.dtype == (dtype or "float32") and entry.shape == [1001, 37]


def test_a_signal_deferred_over_the_staging_mkdir_leaves_no_staging_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM arriving while the staging directory is made is raised as that section
    ends, still inside ``__enter__`` (where ``with`` calls no ``__exit__``): the stage is
    removed all the same."""
    real = os.mkdir

    def mkdir_then_signal(path: str | os.PathLike[str], mode: int = 0o777) -> None:
        real(path, mode)
        if Path(path).name.startswith(".anec-staging-"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "mkdir", mkdir_then_signal)
    with pytest.raises(Interrupted), signals_as_interrupts(), stage_artifact(tmp_path, "m"):
        pytest.fail("the deferred signal must be raised before the body runs")
    assert entries(tmp_path) == []
