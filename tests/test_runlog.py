"""Library output is recorded, not printed and not discarded (converter/runlog.py)."""

from __future__ import annotations

import logging
import warnings

import pytest

from converter.runlog import RunLog, route_library_output, session_log_text, warnings_to_log


def test_library_warnings_are_recorded_and_errors_stay_visible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    route_library_output()  # what the anec command does first
    library = logging.getLogger("coremltools")
    library.warning("anec-test: a note on import")
    library.error("anec-test: a library error")
    err = capsys.readouterr().err
    assert "a note on import" not in err
    assert "a library error" in err
    log = session_log_text()
    assert "WARNING coremltools: anec-test: a note on import" in log
    assert "ERROR coremltools: anec-test: a library error" in log


def test_warnings_raised_in_a_block_go_to_the_run_log_once_each() -> None:
    route_library_output()
    with RunLog("test") as run, warnings_to_log("a test step"):
        for _ in range(3):
            warnings.warn("anec-test: repeated", UserWarning, stacklevel=1)
        warnings.warn("anec-test: once", DeprecationWarning, stacklevel=1)
    text = run.text()
    # Three records: the UserWarning once, its repeat count, the DeprecationWarning.
    assert text.count("WARNING py.warnings: (during a test step)") == 3
    assert "(during a test step) UserWarning repeated 3 times: anec-test: repeated" in text
    assert "(during a test step)" in text and "DeprecationWarning: anec-test: once" in text
