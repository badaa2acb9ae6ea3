"""The registered gates against the recipe schema: where each threshold is set, its default,
and the gate table built from both (docs/parity.md).

``python -m converter.recipe.gate_table`` prints the table docs/parity.md's "Gates" section
holds (a test keeps the two equal).
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from converter.recipe import DecisionRecipe, DecoderRecipe, EncoderRecipe
from parity.gate_registry import Gate, registered


def _model_of(annotation: Any, step: str, key: str) -> type[BaseModel]:
    """The pydantic model a field's annotation holds (through ``X | None`` and, for a
    ``name[]`` step, ``list[X]``)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if step.endswith("[]"):
        if get_origin(annotation) is not list:
            raise KeyError(f"recipe key {key}: {step[:-2]} is not a list")
        (annotation,) = get_args(annotation)
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        raise KeyError(f"recipe key {key}: {step} holds no fields")
    return annotation


def recipe_field(key: str) -> FieldInfo:
    """The recipe schema's field at dotted ``key`` ("[]" steps into a list's items), in the
    schema of any task that has it; KeyError naming the step that does not exist."""
    problems = []
    for recipe in (DecoderRecipe, EncoderRecipe, DecisionRecipe):
        try:
            return _field(recipe, key)
        except KeyError as e:
            problems.append(str(e.args[0]))
    raise KeyError("; ".join(dict.fromkeys(problems)))


def _field(model: type[BaseModel], key: str) -> FieldInfo:
    *steps, last = key.split(".")
    for step in steps:
        info = model.model_fields.get(step.removesuffix("[]"))
        if info is None:
            raise KeyError(f"recipe key {key}: {model.__name__} has no field {step}")
        model = _model_of(info.annotation, step, key)
    if last not in model.model_fields:
        raise KeyError(f"recipe key {key}: {model.__name__} has no field {last}")
    return model.model_fields[last]


def default_threshold(g: Gate) -> float | None:
    """The threshold a recipe that does not set it gets (None: no default, see docs/parity.md)."""
    if g.recipe_key is None:
        return g.fixed
    default = recipe_field(g.recipe_key).get_default(call_default_factory=True)
    return None if default is None else float(default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(gates: list[Gate] | None = None) -> str:
    """The gate table of docs/parity.md: one row per registered gate."""
    lines = [
        "| level | gate | comparison | default | recipe key | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in registered() if gates is None else gates:
        default = default_threshold(g)
        shown = "-" if default is None else f"{default:g}"
        if g.recipe_key is None:
            shown += " (fixed)"
        key = f"`{g.recipe_key}`" if g.recipe_key else "-"
        lines.append(
            f"| {g.level} | `{g.name}` | `{g.comparison.value}` | {shown} | {key} | "
            f"{_cell(g.meaning)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - regenerates docs/parity.md's table
    print(markdown_table())
