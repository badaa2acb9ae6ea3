"""The macOS workflow (.github/workflows/macos.yml) as far as Linux can check it: the file
parses, installs what the README's test command installs, and every anec command, option and
shipped recipe it names exists (the commands themselves run in the other tests up to the Core
ML call: tests/test_device_check.py, tests/test_mil_cli.py)."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path
from typing import Any

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


def _steps() -> list[dict[str, Any]]:
    doc = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    # YAML 1.1 reads the key `on` as the boolean true
    assert doc.get("on", doc.get(True)) is not None
    (job,) = doc["jobs"].values()
    assert str(job["runs-on"]).startswith("macos")
    steps: list[dict[str, Any]] = job["steps"]
    assert all(("uses" in s) != ("run" in s) for s in steps)
    return steps


def _lines(prefix: str) -> list[list[str]]:
    out = []
    for step in _steps():
        for line in str(step.get("run", "")).splitlines():
            line = line.strip()
            if line.startswith(prefix):
                out.append(shlex.split(line))
    return out


def test_it_installs_what_the_readme_test_command_installs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (command,) = [line for line in readme.splitlines() if "pytest -n auto" in line]
    chunks = [c.split("&&")[0] for c in command.split("pip install")[1:]]
    wanted = {p for chunk in chunks for p in shlex.split(chunk)}
    installed = {p for args in _lines("pip install") for p in args[2:]}
    assert wanted <= installed, wanted - installed


def test_every_anec_command_option_and_recipe_exists() -> None:
    import click

    from converter.commands import main
    from converter.recipe import locate_recipe

    calls = _lines("anec ")
    assert {args[1] for args in calls} >= {"convert", "parity", "device-check", "plan-inspect"}
    for args in calls:
        command = main.commands.get(args[1])
        assert isinstance(command, click.Command), args
        options = {o for p in command.params for o in getattr(p, "opts", [])}
        for token in args[2:]:
            if token.startswith("--"):
                assert token in options, (args[1], token)
        if args[1] == "convert":  # the recipes: every argument before the first option
            for name in itertools.takewhile(lambda t: not t.startswith("-"), args[2:]):
                assert locate_recipe(name).is_file(), name


def test_the_fast_tier_it_runs_is_a_marker_pytest_knows() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    markers = options["tool"]["pytest"]["ini_options"]["markers"]
    (pytest_call,) = _lines("pytest")
    assert pytest_call[1:3] == ["-m", "not slow"]
    assert any(m.startswith("slow:") for m in markers)
