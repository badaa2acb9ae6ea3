"""Progress display for the long steps of a conversion, and their timings."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from converter.pipeline.resources import gib, own_peak_bytes

log = logging.getLogger(__name__)


def quiet_third_party_output() -> None:
    """Keep other libraries' progress bars, log records and warnings off the terminal.

    They are recorded instead (``converter.pipeline.runlog.route_library_output``, which the
    ``anec``
    command calls before any subcommand); kept for scripts such as ``bench/mil.py``. Must run
    before torch is imported: tqdm reads ``TQDM_DISABLE`` when it is imported.
    """
    from converter.pipeline.runlog import route_library_output

    route_library_output()


class Steps:
    """Shows one line per step (spinner or bar) on stderr and records each step's wall time.

    With ``quiet`` (``--json``, or output that is not a terminal) nothing is drawn; the
    timings are still recorded.
    """

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.timings: dict[str, float] = {}
        self._progress: Progress | None = None
        if not quiet:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description:<28}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}", style="dim"),
                TimeElapsedColumn(),
                console=console or Console(stderr=True),
            )

    def __enter__(self) -> Steps:
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.stop()

    @contextmanager
    def step(self, name: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        """Time the block as step ``name``; yields ``advance()`` for steps with a ``total``."""
        task = self._progress.add_task(name, total=total) if self._progress else None
        start = time.perf_counter()
        log.info("step %s: started", name)  # the conversion log (convert.log) reads these
        ok = False

        def advance() -> None:
            if self._progress and task is not None:
                self._progress.advance(task)

        try:
            yield advance
            ok = True
        finally:
            self.timings[name] = time.perf_counter() - start
            result = "done" if ok else "stopped"
            log.info(
                "step %s: %s after %.2f s (peak RSS so far %s)",
                name,
                result,
                self.timings[name],
                gib(own_peak_bytes()),
            )
            if self._progress and task is not None:
                self._progress.update(task, total=total or 1, completed=total or 1)
