"""The conversion log, ``convert.log``, written into every artifact directory and ``.failed`` one.

An unattended CI job is debugged from what it left behind, so each conversion records the
command, the tool versions, every step with its duration, and every warning and log record
(anec's and the libraries': transformers' load report, coremltools' notes). The lines are kept
in memory and written into the staging directory just before it is published or kept as
``.failed``, so the log is part of the atomic artifact and never half-written into a published
one. Timestamps make it differ between runs; it is not part of the content hash.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import io
import logging
import platform
import sys
from pathlib import Path

from converter.publish import write_text_atomic

LOG_NAME = "convert.log"
# Loggers that do not propagate to the root logger (transformers sets propagate=False).
_EXTRA_LOGGERS = ("transformers",)
# anec's own packages log their steps at INFO; libraries are recorded from WARNING up.
_OWN_LOGGERS = ("anec", "converter", "graph_passes", "parity")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DISTRIBUTIONS = ("anec", "torch", "transformers", "coremltools", "numpy")

_active: RunLog | None = None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class _UTCFormatter(logging.Formatter):
    """ISO-8601 UTC timestamps, so logs from CI runners in any time zone line up."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        when = _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc)
        return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z"


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
        for name in _EXTRA_LOGGERS + ("",):
            self._attach(logging.getLogger(name or None), self._handler)
        for name in _OWN_LOGGERS:
            logger = logging.getLogger(name)
            self._levels.append((logger, logger.level))
            logger.setLevel(logging.INFO)
        logging.captureWarnings(True)
        _active = self
        log = logging.getLogger("anec")
        log.info("anec convert %s", self.recipe_ref)
        log.info("command: %s", " ".join(sys.argv))
        log.info("python %s on %s", platform.python_version(), platform.platform())
        log.info("versions: %s", ", ".join(f"{d} {_version(d)}" for d in _DISTRIBUTIONS))
        return self

    def _attach(self, logger: logging.Logger, handler: logging.Handler | None) -> None:
        if handler is not None and handler not in logger.handlers:
            logger.addHandler(handler)
            self._attached.append((logger, handler))

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
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
