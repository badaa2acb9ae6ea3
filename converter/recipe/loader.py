"""Loading recipe files: every mistake as ``file:line: dotted.field: what was expected``, all at
once, sorted by line; and finding the recipes shipped with anec."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from converter.errors import InputError
from converter.recipe.schema import (
    Recipe,
    RecipeBase,
    cross_field_problems,
    schema_for,
    validate_recipe,
)
from converter.recipe.sections import Fixtures, Shapes
from converter.recipe.task_keys import misplaced_keys
from converter.recipe.yaml_errors import (
    RULE,
    ConfigError,
    ConfigIssue,
    duplicate_keys,
    got,
    issue_from_error,
    read_yaml,
)

# The recipe's names for the engine's types (a recipe file is the configuration file here).
RecipeIssue = ConfigIssue
RecipeError = ConfigError


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file against its task's schema.

    Raises RecipeError listing every mistake as `file:line: field: expectation`, sorted by line.
    """
    file = str(path)
    root, data = read_yaml(file)
    if root is None:
        required = [k for k, f in RecipeBase.model_fields.items() if f.is_required()]
        expected = ", ".join(required + ["..."])
        message = f"the recipe is empty; expected a mapping with keys {expected}"
        raise RecipeError([RecipeIssue(file, None, None, message)])
    if not isinstance(data, dict):
        message = f"expected a mapping of recipe fields, got {got(data)}"
        raise RecipeError([RecipeIssue(file, root.start_mark.line + 1, None, message)])

    issues = duplicate_keys(file, root)
    recipe: Recipe | None = None
    try:
        # An unknown task is reported with the common keys' mistakes; the task's own keys
        # (io, encoder) are checked once the task is known.
        recipe = validate_recipe(data)
    except ValidationError as e:
        model = schema_for(data)
        issues += [issue_from_error(file, root, err, model) for err in _errors(e, data, model)]
    if issues or recipe is None:
        raise RecipeError(issues)
    recipe._source_file = Path(path)
    return recipe


def _errors(e: ValidationError, data: dict[str, Any], model: type[BaseModel]) -> list[Any]:
    """pydantic's errors, with a key the task does not read said as such (not "unknown key"),
    and the cross-field rules checked on the sections that did validate."""
    misplaced = misplaced_keys(data.get("task"), data)
    cut = [loc for loc, _ in misplaced]
    errors: list[Any] = [
        err for err in e.errors() if not any(tuple(err["loc"])[: len(c)] == c for c in cut)
    ]
    # Cross-field rules only run once every field is valid; check them on what did validate.
    seen = {tuple(err["loc"]) for err in errors}
    for loc, reason in misplaced + cross_field_problems(**_valid_sections(data, model)):
        if loc not in seen:
            errors.append({"type": RULE, "loc": loc, "ctx": {"reason": reason}})
            seen.add(loc)
    return errors


def _valid_sections(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """The sections the cross-field rules read, each validated alone (None where invalid)."""
    io = model.model_fields.get("io")
    models: dict[str, Any] = {"shapes": Shapes, "fixtures": Fixtures}
    if io is not None:
        models["io"] = io.annotation
    sections: dict[str, Any] = {"io": None}
    for key, section in models.items():
        try:
            sections[key] = section.model_validate(data[key]) if key in data else section()
        except ValidationError:
            sections[key] = None
    target = data.get("target", RecipeBase.model_fields["target"].default)
    sections["target"] = target if isinstance(target, str) else None
    task = data.get("task")
    sections["task"] = task if isinstance(task, str) else None
    return sections


def shipped_recipes() -> list[Path]:
    """The recipe files shipped in the `recipes` package, sorted by file name."""
    root = importlib.resources.files("recipes")
    return sorted(
        (Path(str(entry)) for entry in root.iterdir() if entry.name.endswith(".yaml")),
        key=lambda p: p.name,
    )


def locate_recipe(ref: str | os.PathLike[str]) -> Path:
    """Return `ref` if it is a file, else the shipped recipe named `ref` (with or without .yaml)."""
    path = Path(ref)
    if path.is_file():
        return path
    for shipped in shipped_recipes():
        if str(ref) in (shipped.name, shipped.stem):
            return shipped
    names = ", ".join(p.stem for p in shipped_recipes())
    raise InputError(f"{ref}: no such recipe file or shipped recipe (shipped: {names})")
