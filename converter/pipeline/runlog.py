"""The conversion log, ``convert.log``, written into every artifact directory and ``.failed`` one.

An unattended CI job is debugged from what it left behind, so each conversion records the
command, the tool versions, every step with its duration, and every warning and log record
(anec's and the libraries': transformers' load report, coremltools' notes). The lines are kept
in memory and written into the staging directory just before it is published or kept as
``.failed``, so the log is part of the atomic artifact and never half-written into a published
one. Timestamps make it differ between runs; it is not part of the content hash.

Library output stays off the terminal in every command (``route_library_output``, called by
the ``anec`` group before any command runs): the libraries' log records and Python warnings
(coremltools' notes on import, transformers' load report, warnings raised while loading,
tracing or converting) are kept in the session and written into ``convert.log`` by a
conversion, or into ``anec --log FILE`` by any command. Code that used to silence warnings
wraps the call in ``warnings_to_log()`` instead, so nothing a library says is lost. A
library that installs its own terminal handler when it is imported (transformers does) has it
removed (``keep_libraries_off_terminal``), and ANSI escape codes (transformers colours its
load report) are stripped from what is written.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import io
import logging
import os
import platform
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from converter.pipeline.publish import write_text_atomic

LOG_NAME = "convert.log"
# Libraries whose records are kept off the terminal and recorded instead. transformers sets
# propagate=False itself; route_library_output does the same for the rest.
LIBRARY_LOGGERS = (
    "coremltools",
    "transformers",
    "torch",
    "py.warnings",
    "huggingface_hub",
    "gguf",
)
_SESSION_LIMIT = 2000  # records kept for the session (a run that loops on a warning stays small)
# anec's own packages log their steps at INFO; libraries are recorded from WARNING up.
_OWN_LOGGERS = ("anec", "converter", "graph_passes", "parity")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DISTRIBUTIONS = ("anec", "torch", "transformers", "coremltools", "numpy")
# Terminal control sequences (colours, bold) that libraries put into their messages.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")

_active: RunLog | None = None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def plain(text: str) -> str:
    """``text`` without ANSI escape sequences."""
    return _ANSI.sub("", text)


class _UTCFormatter(logging.Formatter):
    """ISO-8601 UTC timestamps, so logs from CI runners in any time zone line up; no ANSI
    escape sequences (a log file is read in an editor, not a terminal)."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        when = _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc)
        return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z"


class _SessionHandler(logging.Handler):
    """Keeps the library records of this process (up to ``_SESSION_LIMIT``) and forwards
    each to the active run log, if any."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.preamble: int | None = None  # records before the first conversion of the process

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _SESSION_LIMIT:
            self.records.append(record)
        if _active is not None:
            _active.handle(record)
        if record.levelno >= logging.ERROR:  # a library's error stays visible, as plain text
            sys.stderr.write(plain(record.getMessage()) + "\n")


_session: _SessionHandler | None = None


def route_library_output() -> None:
    """Keep library log records and Python warnings off the terminal; record them instead.

    Call before the libraries are imported (coremltools logs ten notes on import: an
    unsupported scikit-learn, an untested torch, its missing macOS runtime library) and
    before torch (tqdm reads ``TQDM_DISABLE`` when it is imported). Idempotent. Records go to
    the active conversion's ``convert.log`` and to ``write_session_log``; a library's
    ERROR records still reach stderr too.
    """
    global _session
    os.environ.setdefault("TQDM_DISABLE", "1")  # anec shows its own progress
    if _session is not None:
        return
    _session = _SessionHandler()
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(_session)
        logger.propagate = False
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    keep_libraries_off_terminal()


def keep_libraries_off_terminal() -> None:
    """Remove the handlers libraries attached to their own loggers, once they are imported.

    transformers adds a stderr handler to its ``transformers`` logger when it is imported
    (``transformers.utils.logging._configure_library_root_logger``), which is after
    ``route_library_output`` ran: its load report reached the terminal through it, raw ANSI
    codes included; with ``CI=true`` in the environment it also makes its logger propagate.
    Called by ``route_library_output`` and where anec imports such a library
    (``converter.checkpoints.loading``); does nothing before ``route_library_output`` (library use
    of
    anec keeps the caller's logging as it is).
    """
    if _session is None:
        return
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        # transformers also sets propagate=True when CI=true is in the environment, which
        # sends its records to the root logger and from there to logging's stderr fallback.
        logger.propagate = False
        for handler in list(logger.handlers):
            if handler is not _session:
                logger.removeHandler(handler)


def session_log_text() -> str:
    """Every library record of this process so far (after ``route_library_output``)."""
    formatter = _UTCFormatter(_FORMAT)
    records = _session.records if _session is not None else []
    return "".join(formatter.format(r) + "\n" for r in records)


def write_session_log(path: Path) -> Path:
    """Write the library records of this process to ``path`` (``anec --log FILE``)."""
    return write_text_atomic(path, session_log_text())


@contextmanager
def warnings_to_log(during: str) -> Iterator[None]:
    """Record the warnings raised inside the block in the log instead of discarding them.

    Each distinct warning is logged once (logger ``py.warnings``) with where it was raised
    and ``during`` (e.g. "ct.convert"), after the block, whether or not it raised.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            seen: dict[tuple[str, str], int] = {}
            for w in caught:
                key = (w.category.__name__, str(w.message))
                seen[key] = seen.get(key, 0) + 1
                if seen[key] == 1:
                    log_warning(w, during)
            repeats = {k: n for k, n in seen.items() if n > 1}
            for (category, message), n in repeats.items():
                logging.getLogger("py.warnings").warning(
                    "(during %s) %s repeated %d times: %s", during, category, n, message[:200]
                )


def log_warning(w: warnings.WarningMessage, during: str) -> None:
    """Log one caught warning as ``warnings.showwarning`` would print it, with its context."""
    text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    logging.getLogger("py.warnings").warning("(during %s) %s", during, text.rstrip())


class RunLog:
    """Collects the log lines of one conversion while it is the active log (``with`` block)."""

    def __init__(self, recipe_ref: str) -> None:
        self.recipe_ref = recipe_ref
        self._buffer = io.StringIO()
        self._handler = logging.StreamHandler(self._buffer)
        self._handler.setLevel(logging.INFO)
        self._handler.setFormatter(_UTCFormatter(_FORMAT))
        self._attached: list[tuple[logging.Logger, logging.Handler]] = []
        self._levels: list[tuple[logging.Logger, int]] = []
        self._captured = False

    def handle(self, record: logging.LogRecord) -> None:
        """Record one log record (the session handler forwards library records here)."""
        if record.levelno >= self._handler.level:
            self._handler.handle(record)

    def text(self) -> str:
        """Everything recorded so far."""
        self._handler.flush()
        return self._buffer.getvalue()

    def write_into(self, directory: Path) -> Path:
        """Write the log so far to ``directory/convert.log`` (atomically) and return its path."""
        return write_text_atomic(directory / LOG_NAME, self.text())

    def __enter__(self) -> RunLog:
        global _active
        root = logging.getLogger()
        if not root.handlers:
            # Our handler would silence logging's last-resort stderr output; keep it visible.
            self._attach(root, logging.lastResort)
        self._attach(root, self._handler)
        if _session is None:
            # Library use without the CLI: the root handler misses the libraries that do not
            # propagate (transformers sets propagate=False).
            for name in LIBRARY_LOGGERS:
                if not logging.getLogger(name).propagate:
                    self._attach(logging.getLogger(name), self._handler)
        for name in _OWN_LOGGERS:
            logger = logging.getLogger(name)
            self._levels.append((logger, logger.level))
            logger.setLevel(logging.INFO)
        self._captured = _session is None
        if self._captured:
            logging.captureWarnings(True)
        _active = self
        log = logging.getLogger("anec")
        log.info("anec convert %s", self.recipe_ref)
        log.info("command: %s", " ".join(sys.argv))
        log.info("python %s on %s", platform.python_version(), platform.platform())
        log.info("versions: %s", ", ".join(f"{d} {_version(d)}" for d in _DISTRIBUTIONS))
        if _session is not None:
            # What the libraries said before the first conversion (e.g. on import): every
            # conversion's log carries it, so each convert.log stands on its own.
            if _session.preamble is None:
                _session.preamble = len(_session.records)
            if _session.preamble:
                log.info("library notes from before the first conversion of this process:")
            for record in _session.records[: _session.preamble]:
                self.handle(record)
        return self

    def _attach(self, logger: logging.Logger, handler: logging.Handler | None) -> None:
        if handler is not None and handler not in logger.handlers:
            logger.addHandler(handler)
            self._attached.append((logger, handler))

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
        if self._captured:
            logging.captureWarnings(False)
        for logger, handler in self._attached:
            logger.removeHandler(handler)
        for logger, level in self._levels:
            logger.setLevel(level)
        self._attached.clear()
        self._levels.clear()


def write_log_into(directory: Path, outcome: str) -> Path | None:
    """Log ``outcome``, then write the active conversion's log into ``directory``.

    The pipeline calls this on the staging directory right before publishing it (or keeping
    it as ``.failed``). A no-op without an active RunLog (library callers, tests).
    """
    if _active is None:
        return None
    logging.getLogger("anec").info("%s", outcome)
    return _active.write_into(directory)
