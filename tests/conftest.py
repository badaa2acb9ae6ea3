"""Shared pytest fixtures. Keep each fixture small; add new ones below."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker (the README's command runs one per core), run torch on one
    thread, and the ``anec`` processes tests start too: a worker's second thread fights the
    other worker for its core (parity/torch_settings.py: 14x the wall time under such load)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def _rank(item: pytest.Item) -> int:
    """0: a slow test; 1: a test using a module- or session-scoped fixture of its own file
    (a conversion its file's tests share); 2: the rest."""
    if item.get_closest_marker("slow"):
        return 0
    own = item.nodeid.split("::")[0]
    for defs in item._fixtureinfo.name2fixturedefs.values():  # type: ignore[attr-defined]
        if defs[-1].scope in ("module", "session") and defs[-1].baseid == own:
            return 1
    return 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that take minutes first, each file's tests kept in order: files with a slow
    test, then files sharing a conversion between their tests, then the rest. With one worker
    per core, the long files start early and the quick ones fill the end, instead of one
    worker starting a 4-minute file while the other runs out of work. (The README's command
    turns off pytest-xdist's own order, most tests first, which put the long files, with
    their one or two tests, last.)"""
    ranks: dict[Path, int] = {}
    for item in items:
        ranks[item.path] = min(ranks.get(item.path, 2), _rank(item))
    items.sort(key=lambda item: ranks[item.path])  # stable: order kept within a rank


@pytest.fixture
def write_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Return a function that writes text to `tmp_path / name` (folders created) and returns it."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def stand_in_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept compute-plan dumps and measurements that say ``origin: stand-in`` (test-only:
    no Mac records them here); every report then prints STAND-IN."""
    from converter.placement.provenance import STAND_IN_ENV

    monkeypatch.setenv(STAND_IN_ENV, "1")


# CI's artifact job converts the shipped SmolLM2 recipe before the tests run (.ci/run); naming
# its output here lets the tests examine that artifact instead of converting it a second time.
SHARED_SMOLLM2 = "ANEC_TEST_SMOLLM2_ARTIFACT"
SMOLLM2_RECIPE = "smollm2-135m-draft"


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped SmolLM2 recipe converted once through the CLI, for every test that needs
    it: here, or the artifact named by ``ANEC_TEST_SMOLLM2_ARTIFACT`` (which must hold that
    recipe, converted by this anec)."""
    from click.testing import CliRunner

    from converter.commands import main

    given = os.environ.get(SHARED_SMOLLM2)
    if given:
        return _shared_smollm2(Path(given))
    out = tmp_path_factory.mktemp("artifacts")
    result = CliRunner().invoke(main, ["convert", SMOLLM2_RECIPE, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out / SMOLLM2_RECIPE


def _shared_smollm2(artifact: Path) -> Path:
    """``artifact`` checked to be the shipped recipe's, converted by the installed anec."""
    from importlib.metadata import version

    from converter.pipeline.manifest import Manifest
    from converter.recipe import load_recipe, locate_recipe

    shipped = load_recipe(locate_recipe(SMOLLM2_RECIPE)).model_dump()
    held = load_recipe(artifact / "recipe.yaml").model_dump()
    assert held == shipped, f"{SHARED_SMOLLM2}={artifact} holds another recipe"
    manifest = Manifest.model_validate_json((artifact / "manifest.json").read_text())
    assert manifest.tools["anec"] == version("anec"), f"{artifact}: made by another anec"
    return artifact


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> object:
    """The packaged SmolLM2 checkpoint loaded once (transformers model, tokenizer, config)."""
    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import load_recipe, locate_recipe

    recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
    return load_checkpoint(recipe.resolve_source(), recipe.task)
