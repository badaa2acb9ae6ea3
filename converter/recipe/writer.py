"""A recipe written back as YAML: the ``recipe.yaml`` of an artifact, ``anec recipes new``.

Every value the recipe's task reads is written, defaults included, so the file says what the
conversion did and reads back to the same recipe (`load_recipe`). Comments go above each
top-level key: why a value was chosen (read from the checkpoint, given as a flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from converter.recipe.schema import Recipe
from converter.recipe.sources import ResolvedSource
from converter.recipe.task_keys import without_misplaced

_ORDER = (
    "name", "task", "source", "shapes", "io", "cache", "vocabulary", "encoder", "decision",
    "precision",
)  # fmt: skip
RECIPE_FILE = "recipe.yaml"  # in every artifact: the recipe it was converted from


class _Dumper(yaml.SafeDumper):
    """Block style, except token-id lists: one line each (``[1, 2, 3]``)."""

    def represent_ids(self, data: list[Any]) -> yaml.Node:
        """A list, in flow style when it holds integers only."""
        flow = bool(data) and all(isinstance(x, int) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_ids)


def recipe_data(recipe: Recipe, resolved: ResolvedSource | None = None) -> dict[str, Any]:
    """The recipe as YAML-ready data; with ``resolved``, a local source as its absolute path,
    so the file reconverts the same checkpoint from wherever it is kept."""
    dumped = without_misplaced(recipe.task, recipe.model_dump(mode="json", exclude_none=True))
    fixtures = dumped["fixtures"]
    for key in ("prompts", "token_ids"):
        if not fixtures[key]:
            del fixtures[key]  # an empty list is the default: one kind of fixture is enough
    # The schema's order, with the task's own sections after the shapes they go with.
    data = {k: dumped[k] for k in _ORDER if k in dumped}
    data |= {k: v for k, v in dumped.items() if k not in data}
    if resolved is not None and recipe.source.kind == "gguf" and resolved.gguf_path:
        data["source"]["path"] = str(resolved.gguf_path)
    elif resolved is not None and recipe.source.kind == "hf-dir":
        data["source"]["path"] = str(resolved.directory)
    return data


def recipe_yaml(
    data: Mapping[str, Any],
    header: Sequence[str] = (),
    notes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """YAML text of recipe ``data``: ``header`` comment lines first, then each top-level key
    with the ``notes`` filed under it (by key) as comments above it."""
    lines = [f"# {line}".rstrip() for line in header]
    for key, value in data.items():
        lines += [f"# {note}" for note in (notes or {}).get(key, ())]
        text = yaml.dump(
            {key: value}, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100
        )
        lines.append(text.rstrip("\n"))
    return "\n".join(lines) + "\n"


def artifact_recipe_yaml(recipe: Recipe, resolved: ResolvedSource) -> str:
    """The ``recipe.yaml`` of an artifact: its recipe, every value written, the checkpoint
    at its absolute path; `anec convert` on it converts the same artifact again."""
    header = [
        f"The recipe artifact {recipe.name} was converted from, every value written out.",
        f"`anec convert {RECIPE_FILE}` converts it again (the same package bytes).",
    ]
    return recipe_yaml(recipe_data(recipe, resolved), header)
