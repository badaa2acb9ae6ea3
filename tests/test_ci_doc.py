"""docs/ci.md's Linux job runs exactly the commands CI runs (.ci/run), in the same order."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START, END = "# --- commands of .ci/run ---", "# --- end of .ci/run ---"
# .ci/run starts from its own folder; a CI job already runs from the checkout's root.
NOT_IN_JOB = {'cd "$(dirname "$0")/.."'}


def ci_run_commands() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return [c for c in commands if c not in NOT_IN_JOB]


def doc_job_commands() -> list[str]:
    text = (REPO / "docs" / "ci.md").read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    block = text[text.index(START) + len(START) : text.index(END)]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_linux_job_in_docs_ci_is_ci_run() -> None:
    commands = ci_run_commands()
    assert any(c.startswith("anec convert ") for c in commands)  # CI converts and gates
    assert doc_job_commands() == commands
