"""`anec recipes validate|list` and the CLI's error handling, through click's CliRunner."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from converter import commands as cli
from converter.commands import recipes as recipes_cli
from converter.errors import GateFailure, InputError
from converter.recipe import shipped_recipes

WriteFile = Callable[[str, str], Path]

GOOD = """\
name: tiny
task: text-generation
source: {kind: gguf, path: model.gguf}
shapes: {batch: 1, sequence_length: 8}
fixtures:
  token_ids: [[1, 2, 3]]
"""
BAD = GOOD.replace("sequence_length: 8", "sequnce_length: 8")  # error on line 4


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # so ~/models/... does not exist
    return CliRunner()


def test_validate_shipped_recipes(runner: CliRunner) -> None:
    files = [str(p) for p in shipped_recipes()]
    result = runner.invoke(cli.main, ["recipes", "validate", *files])
    assert result.exit_code == 0, result.output
    assert "ok: " in result.stdout
    assert "(smollm2-135m-draft, text-generation, macOS14)" in result.stdout
    assert "(qwen2.5-0.5b-draft, text-generation, macOS14)" in result.stdout
    # The Qwen checkpoint is only needed to convert: a note, not an error.
    assert "note: source.path '~/models/Qwen2.5-0.5B-Instruct'" in result.stdout
    assert "does not exist" in result.stdout


def test_validate_invalid_file_exits_2_with_file_line_field(
    runner: CliRunner, write_file: WriteFile
) -> None:
    write_file("bad.yaml", BAD)
    result = runner.invoke(cli.main, ["recipes", "validate", "bad.yaml"])
    assert result.exit_code == 2
    assert "bad.yaml:4: shapes.sequnce_length: unknown key; did you mean 'sequence_length'?" in (
        result.stderr
    )
    assert "Traceback" not in result.output


def test_validate_refuses_a_key_the_task_does_not_read(
    runner: CliRunner, write_file: WriteFile
) -> None:
    """An encoder recipe with a decoder-only key: the key's line, the key and the task."""
    encoder = GOOD.replace("task: text-generation", "task: feature-extraction")
    write_file("enc.yaml", encoder + "io:\n  dtype: float16\n  logits: last\n")
    result = runner.invoke(cli.main, ["recipes", "validate", "enc.yaml"])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: enc.yaml:9: io.logits: does not apply to task feature-extraction: the positions "
        "the LM head returns, read by text-generation only; remove it\n"
    )
    write_file("dec.yaml", GOOD + "encoder:\n  partition: single\n")
    result = runner.invoke(cli.main, ["recipes", "validate", "--json", "dec.yaml"])
    assert result.exit_code == 2
    (error,) = json.loads(result.stdout)[0]["errors"]
    assert (error["line"], error["field"]) == (7, "encoder")
    assert error["message"].startswith("does not apply to task text-generation")


def test_validate_json(runner: CliRunner, write_file: WriteFile) -> None:
    write_file("good.yaml", GOOD)
    write_file("bad.yaml", BAD)
    result = runner.invoke(cli.main, ["recipes", "validate", "--json", "good.yaml", "bad.yaml"])
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert [(r["file"], r["ok"]) for r in data] == [("good.yaml", True), ("bad.yaml", False)]
    assert data[0]["errors"] == []
    assert "does not exist" in data[0]["notes"][0]  # model.gguf is not there
    (error,) = data[1]["errors"]
    assert (error["line"], error["field"]) == (4, "shapes.sequnce_length")
    assert "did you mean" in error["message"]


def test_validate_json_all_ok_exits_0(runner: CliRunner, write_file: WriteFile) -> None:
    write_file("good.yaml", GOOD)
    result = runner.invoke(cli.main, ["recipes", "validate", "--json", "good.yaml"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)[0]["ok"] is True


def test_validate_missing_file_exits_2(runner: CliRunner) -> None:
    result = runner.invoke(cli.main, ["recipes", "validate", "nope.yaml"])
    assert result.exit_code == 2
    assert "nope.yaml: cannot read" in result.stderr


def test_validate_needs_a_file(runner: CliRunner) -> None:
    assert runner.invoke(cli.main, ["recipes", "validate"]).exit_code == 2


def test_list_table_and_json(runner: CliRunner) -> None:
    result = runner.invoke(cli.main, ["recipes", "list"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-draft" in result.stdout and "qwen2.5-0.5b-draft" in result.stdout
    data = json.loads(runner.invoke(cli.main, ["recipes", "list", "--json"]).stdout)
    by_name = {row["name"]: row for row in data}
    assert by_name["smollm2-135m-draft"]["shapes"] == "B=1 L=64"
    assert by_name["smollm2-135m-draft"]["target"] == "macOS14"
    assert by_name["qwen2.5-0.5b-draft"]["source"].startswith("hf-dir: ")


def test_list_reports_a_broken_shipped_recipe(
    runner: CliRunner, write_file: WriteFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = write_file("bad.yaml", BAD)
    monkeypatch.setattr(recipes_cli, "shipped_recipes", lambda: [bad])
    result = runner.invoke(cli.main, ["recipes", "list"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "bad.yaml:4" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [[], ["recipes"], ["recipes", "validate"], ["recipes", "list"]],
)
def test_help(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(cli.main, [*args, "--help"])
    assert result.exit_code == 0
    assert "Usage: " in result.stdout


def test_version(runner: CliRunner) -> None:
    result = runner.invoke(cli.main, ["--version"])
    assert result.exit_code == 0 and "anec, version" in result.stdout


@pytest.mark.parametrize(
    ("error", "code"), [(GateFailure("gate x failed"), 1), (InputError("bad"), 2)]
)
def test_anec_errors_exit_with_their_code_without_traceback(
    runner: CliRunner, error: Exception, code: int
) -> None:
    # A fresh group built the way later commands extend `main`, including a nested group.
    @click.group(cls=cli.AnecGroup)
    def top() -> None:
        """Top."""

    @top.group(cls=cli.AnecGroup)
    def sub() -> None:
        """Sub."""

    @sub.command()
    def boom() -> None:
        """Raise."""
        raise error

    @top.command()
    def flat() -> None:
        """Raise."""
        raise error

    for args in (["sub", "boom"], ["flat"]):
        result = runner.invoke(top, args)
        assert result.exit_code == code
        assert result.stderr == f"error: {error}\n"
        assert result.exception is None or isinstance(result.exception, SystemExit)
