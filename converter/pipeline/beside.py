"""Run one part of a step in a forked child process while this process runs another.

The MIL evaluator and ``ct.convert`` each run on one core: their time is Python per op, not
arithmetic BLAS could spread. So on a host with a second core a cached decoder's fp32 levels
run in a child while this process runs its fp16 cache gates (`converter.tasks.kv_parity`),
and its functions convert in one process each (`converter.tasks.kv_convert`). The child is
forked: it starts with this process's programs, modules and fixtures as they are
(copy-on-write: nothing loaded or pickled twice; a patched function stays patched) and sends
back its progress, its log records and its result. It computes what this process would have,
with the same code on the same values; torch runs one thread there (two processes on two
cores) and BLAS one thread in the evaluator (`parity.mil.evaluator.BlasThreads`).

Only on Linux: macOS's system frameworks are not safe in a forked child, and Windows has no
fork. There, and on a host with one core, the work runs in this process, first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

from converter.pipeline.steps import Advance

T = TypeVar("T")

log = logging.getLogger(__name__)

_ADVANCE, _LOG, _RESULT = b"a", b"l", b"r"
_LENGTH = struct.Struct("<Q")


def can_fork() -> bool:
    """Whether work runs beside this process: Linux with fork and at least two usable cores."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    return len(os.sched_getaffinity(0)) >= 2


class ChildEnded(RuntimeError):
    """The child ended without a result (killed, or its result could not be sent)."""


class Pending(Generic[T]):
    """Work started by `beside`: `result` waits for it and returns its value or raises its
    error. ``peak_bytes``: the child's peak resident memory, ``shared_bytes``: what it
    shared with this process when it started (0 and 0 when the work ran here)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.peak_bytes = 0
        self.shared_bytes = 0
        self._value: tuple[bool, object] | None = None
        self._pid: int | None = None
        self._started = time.perf_counter()
        self._reader: threading.Thread | None = None

    def result(self) -> T:
        """The work's value (waiting for the child), or its error raised here."""
        if self._pid is not None:
            self._wait()
        assert self._value is not None
        ok, value = self._value
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]

    def cancel(self) -> None:
        """Stop the child if it still runs (this process failed first); no effect otherwise."""
        if self._pid is None:
            return
        with contextlib.suppress(ProcessLookupError):  # it ended already
            os.kill(self._pid, signal.SIGTERM)
        self._wait()

    def _wait(self) -> None:
        assert self._pid is not None and self._reader is not None
        waited = time.perf_counter()
        self._reader.join()
        _, status, usage = os.wait4(self._pid, 0)
        self._pid = None
        ended = time.perf_counter()
        self.peak_bytes = usage.ru_maxrss * 1024  # Linux: KiB
        log.info(
            "%s ran in a child process for %.1f s (this process waited %.1f s for it): peak RSS "
            "%.2f GiB, %.2f GiB of it shared with this process at the start",
            self.what,
            ended - self._started,
            ended - waited,
            self.peak_bytes / 2**30,
            self.shared_bytes / 2**30,
        )
        if self._value is None:
            how = (
                f"killed by signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit status {os.waitstatus_to_exitcode(status)}"
            )
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            hint = " (out of memory?)" if killed else ""
            message = f"{self.what}: its process ended without a result, {how}{hint}"
            self._value = (False, ChildEnded(message))


def beside(
    work: Callable[[Advance], T], advance: Advance, what: str, separate: bool = True
) -> Pending[T]:
    """Start ``work(advance)`` in a forked child (`can_fork`, and ``separate``: the caller
    says whether there is memory for it), or run it here now.

    The child's ``advance`` calls reach ``advance`` here (from a reader thread). ``what``
    names the work in errors and in the conversion log. Call `Pending.result` to collect it,
    or `Pending.cancel` when this process fails before that.
    """
    pending: Pending[T] = Pending(what)
    if not (separate and can_fork()):
        if can_fork():
            log.info("%s runs in this process: the memory budget has no room for a child", what)
        try:
            pending._value = (True, work(advance))
        except Exception as e:  # raised by `result`, as a child's error would be
            pending._value = (False, e)
        return pending
    pending.shared_bytes = _resident_bytes()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        _run_child(work, write_fd)
    os.close(write_fd)
    pending._pid = pid
    pending._reader = threading.Thread(
        target=_read, args=(read_fd, advance, pending), name=f"beside-{pid}", daemon=True
    )
    pending._reader.start()
    return pending


def _run_child(work: Callable[[Advance], T], write_fd: int) -> None:
    """Run ``work`` and send its progress, its log records and its result (or its error, with
    its traceback) to the parent."""
    code = 1
    try:
        sender = _Sender(write_fd)
        _forward_logs(sender)
        import torch

        torch.set_num_threads(1)  # the other core runs the parent
        try:
            payload = pickle.dumps((True, work(lambda: sender.send(_ADVANCE))))
        except BaseException as e:  # noqa: BLE001  (everything goes back to the parent)
            e.add_note(f"in the child process:\n{traceback.format_exc().rstrip()}")
            payload = pickle.dumps((False, _portable(e)))
        sender.send(_RESULT, payload)
        code = 0
    finally:
        os._exit(code)  # no atexit handlers, no parent's finally blocks


class _Sender:
    """The child's end of the pipe: one message at a time (the work may run threads)."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "wb")
        self._lock = threading.Lock()

    def send(self, kind: bytes, payload: bytes | None = None) -> None:
        sized = b"" if payload is None else _LENGTH.pack(len(payload)) + payload
        with self._lock:
            self._out.write(kind + sized)
            self._out.flush()


class _Forward(logging.Handler):
    """Sends a record that reached a logger's handlers in the child to that logger's handlers
    in the parent: the conversion log (`converter.pipeline.runlog`) is the parent's memory."""

    def __init__(self, sender: _Sender, logger: str) -> None:
        super().__init__()
        self._sender, self._logger = sender, logger

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None  # its arguments may not pickle
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self._sender.send(_LOG, pickle.dumps((self._logger, record)))


def _forward_logs(sender: _Sender) -> None:
    """Every logger with handlers in the child hands its records to `_Forward` instead."""
    root = logging.getLogger()
    loggers = [root, *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        if isinstance(logger, logging.Logger) and logger.handlers:
            name = "" if logger is root else logger.name
            logger.handlers = [_Forward(sender, name)]


def _read(read_fd: int, advance: Advance, pending: Pending[T]) -> None:
    """The parent's end of the pipe: calls ``advance`` per message, hands each log record to
    its logger's handlers here, stores the result."""
    with os.fdopen(read_fd, "rb") as inp:
        while kind := inp.read(1):
            if kind == _ADVANCE:
                advance()
                continue
            (length,) = _LENGTH.unpack(inp.read(_LENGTH.size))
            payload = inp.read(length)
            if len(payload) < length:
                return  # the child died mid-message
            if kind == _LOG:
                name, record = pickle.loads(payload)
                for handler in logging.getLogger(name or None).handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)
                continue
            ok, value = pickle.loads(payload)
            pending._value = (True, value) if ok else (False, _rebuilt(value))
            return


def _portable(
    e: BaseException,
) -> tuple[type[BaseException], tuple[object, ...], dict[str, object]]:
    """An error as (type, args, attributes), which pickles even where the error does not (an
    ``__init__`` whose parameters are not its ``args``, as `parity.mil.errors`' have); an
    error whose parts do not pickle goes as a RuntimeError with its text and traceback."""
    parts = (type(e), e.args, dict(e.__dict__))
    try:
        pickle.dumps(parts)
    except Exception:
        text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        return (RuntimeError, (text,), {})
    return parts


def _rebuilt(
    parts: tuple[type[BaseException], tuple[object, ...], dict[str, object]],
) -> BaseException:
    """The error `_portable` sent: its type, args and attributes (notes included), made
    without calling its ``__init__`` again."""
    kind, args, attributes = parts
    error: BaseException = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(attributes)
    return error


def _resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
