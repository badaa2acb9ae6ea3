"""One error engine for YAML configuration files: the recipe and its ``compression:`` section.

It reads a YAML file (YAML 1.2 floats, duplicate keys, nesting limits), turns pydantic errors
into ``file:line: dotted.field: what was expected`` issues, and lets schema validators raise
their own readable rule violations, all at once. It knows no schema: the caller passes the
root model, so the recipe and any other YAML-configured schema share it.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from converter.errors import InputError

# A rule violation found by a schema's own validators; its context carries the readable reason.
RULE = "recipe_rule"

Loc = tuple[str | int, ...]

# Configuration files nest a few levels deep; far deeper input is a mistake or hostile
# (recursive aliases).
MAX_NESTING = 32
_TOO_DEEP = f"not a recipe: nested more than {MAX_NESTING} levels deep (or a recursive alias)"


class StrictModel(BaseModel):
    """A configuration section: frozen, and an unknown key is an error (a misspelt key must
    never fall back to a default silently)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def rule(reason: str) -> PydanticCustomError:
    """A validation error whose message is ``reason`` as written (raise it in a validator)."""
    return PydanticCustomError(RULE, "{reason}", {"reason": reason})


@dataclass(frozen=True)
class OneOf:
    """Field metadata (``Annotated[str, OneOf(options)]``): the value must be one of
    ``options()``, read when validating rather than when the schema is defined, so a registry
    that gains an entry (a compression method) is accepted without editing the schema. Errors
    read like a ``Literal``'s: ``expected one of a, b, got 'c'``."""

    options: Callable[[], Sequence[str]]

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        def check(value: Any) -> str:
            allowed = tuple(self.options())
            if not isinstance(value, str) or value not in allowed:
                expected = ", ".join(repr(a) for a in allowed)
                raise PydanticCustomError(
                    "literal_error", "Input should be one of {expected}", {"expected": expected}
                )
            return value

        return core_schema.no_info_plain_validator_function(check)


def raise_rules(title: str, problems: list[tuple[Loc, str]], value: Any = None) -> None:
    """Raise every problem at once, each at its own field (pydantic prefixes the parent loc)."""
    if problems:
        details = [
            InitErrorDetails(type=rule(reason), loc=loc, input=value) for loc, reason in problems
        ]
        raise ValidationError.from_exception_data(title, details)


def got(value: Any) -> str:
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


def dotted(loc: Loc) -> str:
    """``("fixtures", "token_ids", 2)`` -> ``fixtures.token_ids[2]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --------------------------------------------------------------------------------------------
# issues


@dataclass(frozen=True)
class ConfigIssue:
    """One mistake in a configuration file."""

    file: str
    line: int | None  # 1-based
    field: str | None  # dotted path, e.g. "shapes.sequence_length" or "fixtures.token_ids[2]"
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f"{self.field}: " if self.field else ""
        return f"{where}: {field}{self.message}"


class ConfigError(InputError):
    """A configuration file that cannot be used; `issues` lists every mistake, sorted by line."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: (i.line or 0, i.field or ""))
        super().__init__("\n".join(str(i) for i in self.issues))


# --------------------------------------------------------------------------------------------
# reading YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 1e-4 (YAML 1.1 makes them strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: Path | str) -> tuple[yaml.Node | None, Any]:
    """The root node (for line numbers) and the data of a YAML file.

    Raises ConfigError for a file that cannot be read, is not UTF-8, is not valid YAML or nests
    too deeply. An empty document gives ``(None, None)``.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue(file, None, None, "not UTF-8 text")]) from None
    except OSError as e:
        reason = e.strerror or str(e)
        raise ConfigError([ConfigIssue(file, None, None, f"cannot read: {reason}")]) from None

    try:
        loader = _Loader(text)  # its reader refuses characters YAML does not allow
    except yaml.reader.ReaderError as e:
        at = text.count("\n", 0, e.position) + 1
        message = f"not valid YAML: character #x{e.character:04x} is not allowed ({e.reason})"
        raise ConfigError([ConfigIssue(file, at, None, message)]) from None
    try:
        root = loader.get_single_node()
        if root is not None and _nesting_exceeds(root, MAX_NESTING):
            raise ConfigError([ConfigIssue(file, root.start_mark.line + 1, None, _TOO_DEEP)])
        data = loader.construct_document(root) if root is not None else None
    except RecursionError:  # PyYAML composes recursively: thousands of brackets end here
        raise ConfigError([ConfigIssue(file, None, None, _TOO_DEEP)]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        problem = e.problem or e.context or "unreadable"
        raise ConfigError([ConfigIssue(file, line, None, f"not valid YAML: {problem}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError([ConfigIssue(file, None, None, f"not valid YAML: {e}")]) from None
    finally:
        loader.dispose()
    return root, data


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


def line_of(root: yaml.Node, loc: Loc) -> int:
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


def duplicate_keys(
    file: str, node: yaml.Node, loc: Loc = (), seen: set[int] | None = None
) -> list[ConfigIssue]:
    """PyYAML silently keeps the last of duplicate keys; report them instead."""
    issues: list[ConfigIssue] = []
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
                issues.append(ConfigIssue(file, line, dotted((*loc, name)), message))
            else:
                first[name] = line
            issues += duplicate_keys(file, value, (*loc, name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += duplicate_keys(file, item, (*loc, i), seen)
    return issues


# --------------------------------------------------------------------------------------------
# pydantic errors -> issues


def issue_from_error(file: str, root: yaml.Node, err: Any, model: type[BaseModel]) -> ConfigIssue:
    """One pydantic error (``ValidationError.errors()`` item, or a rule ``{"type", "loc",
    "ctx": {"reason"}}``) as an issue; ``model`` is the schema the data was validated against,
    which says what each field expects."""
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    line = line_of(root, loc)
    field = dotted(loc) or None
    if kind == RULE:
        return ConfigIssue(file, line, field, err["ctx"]["reason"])
    if kind == "missing":
        expected = expected_at(model, loc)
        suffix = f"; expected {expected}" if expected else ""
        return ConfigIssue(file, line, field, f"required key is missing{suffix}")
    if kind == "extra_forbidden":
        return ConfigIssue(file, line, field, _unknown_key(model, loc))
    expected = expected_at(model, loc)
    if expected:
        return ConfigIssue(file, line, field, f"expected {expected}, got {got(err['input'])}")
    return ConfigIssue(file, line, field, f"{err['msg']}, got {got(err['input'])}")


def _unknown_key(model: type[BaseModel], loc: Loc) -> str:
    parent = _annotation_at(model, loc[:-1])
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


def _annotation_at(model: type[BaseModel], loc: Loc) -> tuple[Any, list[Any], str | None] | None:
    """The annotation, constraints and explicit expectation text of the field at `loc`."""
    annotation: Any = model
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


def expected_at(model: type[BaseModel], loc: Loc) -> str | None:
    """What the field at ``loc`` of ``model`` accepts, in words (None if unknown)."""
    found = _annotation_at(model, loc)
    if found is None:
        return None
    annotation, metadata, expected = found
    return expected or _describe(annotation, metadata)


def _describe(annotation: Any, metadata: list[Any]) -> str | None:
    """Say in words what a field accepts, from its type and constraints."""
    annotation, metadata = _unwrap(annotation, metadata)
    choices = [m for m in metadata if isinstance(m, OneOf)]
    if choices:
        return "one of " + ", ".join(choices[0].options())
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
