"""The recipe: what `anec convert` does, as a YAML file validated against its task's schema.

* `schema`: the union on ``task``: `DecoderRecipe` (text-generation) | `EncoderRecipe`
  (feature-extraction, sentence-similarity, text-classification), and the cross-field rules;
* `sections`: shapes, I/O, gates, fixtures, encoder options;
* `tasks`: which keys each task reads (a key its task does not read is an error);
* `sources`: where the checkpoint comes from and where it is on this machine;
* `compression`: the ``compression:`` section (variants, held-out slices, their gates);
* `loader`: reading a recipe file with ``file:line: field: expectation`` errors, through the
  error engine `yaml_errors` that the compression section shares;
* `refs`, `writer`, `fixture_text`: what an ``anec convert`` argument names, a recipe written
  back as YAML, the fixtures of a recipe made from a checkpoint.
"""

from __future__ import annotations

from converter.recipe.loader import (
    RecipeError,
    RecipeIssue,
    load_recipe,
    locate_recipe,
    shipped_recipes,
)
from converter.recipe.schema import (
    MAX_NAME_LENGTH,
    AttentionForm,
    DecisionRecipe,
    DecoderRecipe,
    EncoderRecipe,
    Recipe,
    RecipeBase,
    recipe_from_dict,
    recipe_model,
    recipe_to_dict,
    validate_recipe,
)
from converter.recipe.sections import (
    MAX_AXIS,
    DecisionOptions,
    DType,
    EncoderIOSpec,
    EncoderOptions,
    Fixtures,
    Gates,
    InputsMode,
    IOSpec,
    Shapes,
)
from converter.recipe.sources import ModelSource, ResolvedSource, SourceKind
from converter.recipe.task_keys import (
    DECODER_TASKS,
    ENCODER_TASKS,
    TASK_KEYS,
    TASKS,
    DecoderTask,
    EncoderTask,
    Task,
    TaskKey,
    misplaced_keys,
)
from converter.recipe.yaml_errors import MAX_NESTING

__all__ = [
    "DECODER_TASKS",
    "ENCODER_TASKS",
    "MAX_AXIS",
    "MAX_NAME_LENGTH",
    "MAX_NESTING",
    "TASKS",
    "TASK_KEYS",
    "AttentionForm",
    "DecisionOptions",
    "DecisionRecipe",
    "DType",
    "DecoderRecipe",
    "DecoderTask",
    "EncoderIOSpec",
    "EncoderOptions",
    "EncoderRecipe",
    "EncoderTask",
    "Fixtures",
    "Gates",
    "IOSpec",
    "InputsMode",
    "ModelSource",
    "Recipe",
    "RecipeBase",
    "RecipeError",
    "RecipeIssue",
    "ResolvedSource",
    "Shapes",
    "SourceKind",
    "Task",
    "TaskKey",
    "load_recipe",
    "locate_recipe",
    "misplaced_keys",
    "recipe_from_dict",
    "recipe_model",
    "recipe_to_dict",
    "shipped_recipes",
    "validate_recipe",
]
