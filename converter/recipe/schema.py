"""The recipe schema: a union on ``task`` of a decoder recipe and an encoder recipe.

`DecoderRecipe` (text-generation) has the decoder's I/O (`io.inputs`, `io.logits`,
`io.lm_head_chunk`) and `logits_positions`; `EncoderRecipe` (feature-extraction,
sentence-similarity, text-classification) has `encoder:`. `Recipe` is their union: narrow it
with ``isinstance`` (or on ``recipe.task``) where a pipeline needs one kind. Keys that only
some tasks of one kind read are in `converter.recipe.task_keys`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from converter.coreml.targets import TARGETS, Feature, check_feature
from converter.errors import InputError
from converter.recipe.cache_section import CacheSpec, cache_problems
from converter.recipe.compression_section import Compression, compression_problems
from converter.recipe.sections import (
    KV_MAX_ABS_DPROB,
    MAX_AXIS,
    DecisionOptions,
    DType,
    EncoderIOSpec,
    EncoderOptions,
    Fixtures,
    Gates,
    IOSpec,
    Shapes,
)
from converter.recipe.sources import ModelSource, ResolvedSource
from converter.recipe.task_keys import (
    DECISION_TASKS,
    DECODER_TASKS,
    ENCODER_TASKS,
    DecisionTask,
    DecoderTask,
    EncoderTask,
    Task,
    misplaced_keys,
    without_misplaced,
)
from converter.recipe.vocabulary_section import DraftVocabulary
from converter.recipe.yaml_errors import Loc, StrictModel, got, raise_rules, rule

MAX_NAME_LENGTH = 100

AttentionForm = Literal["per-head"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NAME_EXPECTED = (
    "an artifact name of letters, digits, '.', '_' and '-' that starts with a letter or digit, "
    f"has no '..' and at most {MAX_NAME_LENGTH} characters"
)
_TARGET_EXPECTED = "one of " + ", ".join(TARGETS)


def _features_used(io: IOSpec | EncoderIOSpec) -> list[tuple[Loc, Feature, str]]:
    """Target-dependent features a recipe needs: the field that asks, the feature, the fix."""
    used: list[tuple[Loc, Feature, str]] = [
        (("target",), Feature.MLPROGRAM, "choose a later target")
    ]
    if io.dtype == "float16":
        fix = "set io.dtype: float32 or choose a later target"
        used.append((("io", "dtype"), Feature.FP16_IO, fix))
    return used


def cross_field_problems(
    task: str | None,
    target: str | None,
    shapes: Shapes | None,
    io: IOSpec | EncoderIOSpec | None,
    fixtures: Fixtures | None,
) -> list[tuple[Loc, str]]:
    """Rules that span sections; a None argument is a section that did not validate."""
    problems: list[tuple[Loc, str]] = []
    if target in TARGETS and io is not None:
        for loc, feature, fix in _features_used(io):
            reason = check_feature(target, feature)
            if reason:
                problems.append((loc, f"{reason}; {fix}"))
    if shapes is None:
        return problems
    length = shapes.sequence_length
    if isinstance(io, IOSpec) and isinstance(io.logits, int) and io.logits > length:
        reason = f"asks for the last {io.logits} positions but shapes.sequence_length is {length}"
        problems.append((("io", "logits"), reason))
    folded = shapes.batch * length
    if (task in ENCODER_TASKS or task in DECISION_TASKS) and folded > MAX_AXIS:
        # An encoder folds the batch into the sequence axis (one [1, D, 1, B*L] program).
        reason = (
            f"batch {shapes.batch} x sequence_length {length} = {folded} exceeds the Neural "
            f"Engine's per-axis limit {MAX_AXIS} (an encoder folds the batch into the sequence)"
        )
        problems.append((("shapes",), reason))
    for i, ids in enumerate(fixtures.token_ids if fixtures else []):
        if len(ids) > length:
            reason = f"has {len(ids)} tokens, more than shapes.sequence_length {length}"
            problems.append((("fixtures", "token_ids", i), reason))
    return problems


class RecipeBase(StrictModel):
    """What every recipe has, whatever its task. Build one with `load_recipe` (file:line errors)
    or `validate_recipe`; the concrete classes are `DecoderRecipe` and `EncoderRecipe`."""

    name: str = Field(json_schema_extra={"expected": _NAME_EXPECTED})
    task: Task
    source: ModelSource
    shapes: Shapes = Field(default_factory=Shapes)
    precision: DType = "float16"
    target: str = Field(default="macOS14", json_schema_extra={"expected": _TARGET_EXPECTED})
    attention: AttentionForm = "per-head"
    gates: Gates = Field(default_factory=Gates)
    fixtures: Fixtures
    output_dir: Path = Path("artifacts")
    compression: Compression | None = None

    _source_file: Path | None = PrivateAttr(None)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        ok = len(value) <= MAX_NAME_LENGTH and ".." not in value and _NAME_RE.match(value)
        if not ok:
            raise rule(f"expected {_NAME_EXPECTED}, got {got(value)}")
        return value

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        if value not in TARGETS:
            close = difflib.get_close_matches(value, list(TARGETS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise rule(f"expected {_TARGET_EXPECTED}, got {got(value)}{hint}")
        return value

    @field_validator("attention", mode="before")
    @classmethod
    def _check_attention(cls, value: Any) -> Any:
        if value == "heads-batched":
            raise rule(
                "heads-batched is not implemented; the implemented form is per-head "
                "(one attention matmul per head)"
            )
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> RecipeBase:
        io = getattr(self, "io", None)  # each task's schema has its own io section
        problems = cross_field_problems(self.task, self.target, self.shapes, io, self.fixtures)
        problems += misplaced_keys(self.task, self.model_dump(exclude_unset=True))
        if self.compression is not None:
            problems += compression_problems(
                self.compression, self.target, self.task, self.name, self.fixtures.prompts,
                MAX_NAME_LENGTH,
            )  # fmt: skip
        raise_rules("Recipe", problems)
        return self

    @property
    def source_file(self) -> Path | None:
        """The YAML file this recipe was loaded from, if any."""
        return self._source_file

    @property
    def recipe_dir(self) -> Path:
        """The folder relative source paths are resolved against (cwd without a file)."""
        return self._source_file.parent if self._source_file else Path.cwd()

    def resolve_source(self) -> ResolvedSource:
        """Locate the checkpoint (see `ModelSource.resolve`); errors name the recipe file."""
        try:
            return self.source.resolve(self.recipe_dir)
        except InputError as e:
            where = f"{self._source_file}: " if self._source_file else ""
            raise InputError(f"{where}{e}") from None


class DecoderRecipe(RecipeBase):
    """A text-generation recipe: a draft decoder and its LM head."""

    task: DecoderTask
    io: IOSpec = Field(default_factory=IOSpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    # A trimmed LM head (a draft's vocabulary, judged by acceptance); None: the whole head.
    vocabulary: DraftVocabulary | None = None
    # How the program spells the MLP's SiLU: one silu op, or x * sigmoid(x) with no silu op
    # (the NE's silu is reported inexact near 0: parity.mil.deviations).
    silu_form: Literal["op", "mul-sigmoid"] = "op"

    @model_validator(mode="after")
    def _cache_checks(self) -> DecoderRecipe:
        problems = cache_problems(
            self.cache, self.target, self.shapes.batch,
            list(self.compression.variants) if self.compression else [],
            self.precision,
        )  # fmt: skip
        if self.cache.style != "none" and self.gates.device_margin_argmax_agreement is not None:
            # The cached task gates its functions through the cache, never the window
            # program the device-margin profile runs on: the key would be ignored.
            problems.append((("gates", "device_margin_argmax_agreement"), (
                "applies to a decoder without a cache (cache.style none): the device-margin "
                "profile runs on the window program, which a cached decoder does not gate; "
                "remove it"
            )))  # fmt: skip
        # (by value: a written-out window recipe carries the default, which changes nothing)
        if self.cache.style == "none" and self.gates.kv_max_abs_dprob != KV_MAX_ABS_DPROB:
            problems.append((("gates", "kv_max_abs_dprob"), (
                "applies to a cached decoder (cache.style state or io): a window decoder's "
                "probabilities are gated by gates.fp16_max_abs_dprob; remove it"
            )))  # fmt: skip
        raise_rules("Recipe", problems)
        return self

    @property
    def logits_positions(self) -> int:
        """How many sequence positions the program returns logits for."""
        if self.io.logits == "last":
            return 1
        if self.io.logits == "all":
            return self.shapes.sequence_length
        return int(self.io.logits)


class EncoderRecipe(RecipeBase):
    """An encoder recipe: feature-extraction, sentence-similarity or text-classification."""

    task: EncoderTask
    io: EncoderIOSpec = Field(default_factory=EncoderIOSpec)
    encoder: EncoderOptions = Field(default_factory=EncoderOptions)

    @model_validator(mode="after")
    def _variants_of_one_program(self) -> EncoderRecipe:
        if self.compression is not None and self.encoder.partition != "single":
            problem = (
                "variants of a partitioned encoder (encoder.partition: host-embedding) are not "
                "implemented; use encoder.partition: single"
            )
            raise_rules("Recipe", [(("compression",), problem)])
        return self


class DecisionRecipe(RecipeBase):
    """A decision recipe: a ModernBERT encoder with a decision head (docs/decision-head.md),
    partitioned host embedding | NE island | CPU tail."""

    task: DecisionTask
    io: EncoderIOSpec = Field(default_factory=EncoderIOSpec)
    decision: DecisionOptions = Field(default_factory=DecisionOptions)

    @model_validator(mode="after")
    def _no_compression(self) -> DecisionRecipe:
        if self.compression is not None:
            problem = "compressed variants of a decision model are not implemented"
            raise_rules("Recipe", [(("compression",), problem)])
        return self


Recipe = DecoderRecipe | EncoderRecipe | DecisionRecipe
RecipeModel = type[DecoderRecipe] | type[EncoderRecipe] | type[DecisionRecipe]
RECIPE_MODELS: tuple[RecipeModel, ...] = (DecoderRecipe, EncoderRecipe, DecisionRecipe)


def recipe_model(task: Any) -> RecipeModel | None:
    """The schema for ``task``, or None for a task that is not one of anec's tasks."""
    if task in DECODER_TASKS:
        return DecoderRecipe
    if task in ENCODER_TASKS:
        return EncoderRecipe
    if task in DECISION_TASKS:
        return DecisionRecipe
    return None


def schema_for(data: Any) -> type[BaseModel]:
    """The model ``data`` is validated against: its task's, or the common part when the task
    is missing or unknown (then the task is the error, and the common keys are still checked)."""
    task = data.get("task") if isinstance(data, dict) else None
    return recipe_model(task) or RecipeBase


def _task_specific_keys() -> set[str]:
    common = set(RecipeBase.model_fields)
    return {k for m in RECIPE_MODELS for k in m.model_fields if k not in common}


def common_part(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys only a task's own schema knows (io, encoder)."""
    specific = _task_specific_keys()
    return {k: v for k, v in data.items() if k not in specific}


def validate_recipe(data: Any) -> Recipe:
    """Validate parsed recipe data against its task's schema (pydantic errors)."""
    model = schema_for(data)
    if model is RecipeBase:
        # An unknown task: the common part's errors, the task's among them.
        RecipeBase.model_validate(common_part(data) if isinstance(data, dict) else data)
        raise AssertionError("a recipe without a known task validated")  # pragma: no cover
    recipe = model.model_validate(data)
    assert isinstance(recipe, DecoderRecipe | EncoderRecipe | DecisionRecipe)
    return recipe


def recipe_to_dict(recipe: Recipe, resolved: ResolvedSource | None = None) -> dict[str, Any]:
    """Every value of `recipe` its task reads, defaults included, as JSON-ready data for the
    manifest (`recipe_from_dict` reads it back)."""
    data: dict[str, Any] = {
        "recipe_file": str(recipe.source_file) if recipe.source_file else None,
        **without_misplaced(recipe.task, recipe.model_dump(mode="json")),
    }
    if resolved is not None:
        data["resolved_source"] = {
            "kind": resolved.kind,
            "directory": str(resolved.directory),
            "gguf_file": resolved.gguf_file,
        }
    return data


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """The recipe a manifest records (`recipe_to_dict`), validated again.

    Keys that are not recipe fields (``recipe_file``, ``resolved_source``) are dropped, and so
    are keys the task does not read, which manifests written before the recipe was a union on
    the task record with their defaults. Raises pydantic's ValidationError.
    """
    model = schema_for(data)
    fields = {k: v for k, v in _moved_to_gates(data).items() if k in model.model_fields}
    return validate_recipe(without_misplaced(data.get("task"), fields))


# Keys a manifest written before they moved under ``gates:`` records under ``encoder:``.
_COSINE_GATES = ("fp32_min_cosine", "fp16_min_cosine")


def _moved_to_gates(data: dict[str, Any]) -> dict[str, Any]:
    encoder = data.get("encoder")
    if not isinstance(encoder, dict) or not any(k in encoder for k in _COSINE_GATES):
        return data
    gates = dict(data.get("gates") or {})
    for key in _COSINE_GATES:
        if key in encoder:
            gates.setdefault(key, encoder[key])
    kept = {k: v for k, v in encoder.items() if k not in _COSINE_GATES}
    return {**data, "encoder": kept, "gates": gates}
