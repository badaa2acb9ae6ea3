"""The bad-input matrix of `anec convert`: one row per kind of bad input.

Every row runs the real command (in-process, through click) against an output directory that
already holds a previous artifact, and asserts three things: exit code 2, a message naming
the file, field or tensor and what was expected, and an output directory byte-for-byte as it
was (no partial artifact, no staging leftovers, the previous artifact untouched).

Not a row: palette bits (e.g. 5) - the recipe schema has no palettization options yet, so
there is nothing to reject; add the row with the field.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    one_torch_thread,
    run_anec,
    save_tiny_llama,
    tiny_recipe,
    write_tiny_gguf,
)

UP_PROJ = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (no tokenizer files), saved once; every row starts from a copy."""
    return save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@dataclass
class Case:
    """A working directory for one row: recipe text, checkpoint copy, output directory."""

    root: Path
    checkpoint: Path
    out: Path
    recipe_text: str = ""
    args: list[str] = field(default_factory=list)

    def recipe(self, text: str | None = None) -> Path:
        """Write the recipe (the good one unless ``text``) and return its path."""
        path = self.root / "recipe.yaml"
        body = tiny_recipe(self.checkpoint) if text is None else text
        path.write_text(body, encoding="utf-8")
        return path

    def edit_recipe(self, old: str, new: str) -> Path:
        """The good recipe with one substring replaced."""
        text = tiny_recipe(self.checkpoint)
        assert old in text, old
        return self.recipe(text.replace(old, new))

    def edit_config(self, **changes: object) -> None:
        """Change keys of the checkpoint's config.json."""
        path = self.checkpoint / "config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))

    def edit_weights(self, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Rewrite model.safetensors after ``change`` edits its tensors in place."""
        path = self.checkpoint / "model.safetensors"
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def case(tmp_path: Path, checkpoint: Path) -> Case:
    """A copy of the checkpoint and an output directory holding a previous artifact."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    out = tmp_path / "out"
    previous = out / "previous-model"
    (previous / "previous-model.mlpackage" / "Data").mkdir(parents=True)
    (previous / "previous-model.mlpackage" / "Data" / "weight.bin").write_bytes(b"w" * 4096)
    (previous / "manifest.json").write_text('{"name": "previous-model"}\n')
    (out / "other.failed").mkdir()
    (out / "other.failed" / "parity.txt").write_text("an older failed run\n")
    return Case(tmp_path, ckpt, out)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: directories by name, files by content hash."""
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in dirnames:
            found[(here / d).relative_to(root).as_posix() + "/"] = "dir"
        for f in filenames:
            digest = hashlib.sha256((here / f).read_bytes()).hexdigest()
            found[(here / f).relative_to(root).as_posix()] = digest
    return found


# --------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Row:
    """One kind of bad input: how to make it, and what the error must say."""

    id: str
    make: Callable[[Case, pytest.MonkeyPatch], Path]
    expected: tuple[str, ...]  # substrings of stderr, in order of appearance not required


def _yaml(text: str) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    return lambda c, mp: c.recipe(text)


def _edit(old: str, new: str) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    return lambda c, mp: c.edit_recipe(old, new)


def _truncate(name: str, keep: Callable[[int], int]) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    def make(c: Case, mp: pytest.MonkeyPatch) -> Path:
        path = c.checkpoint / name
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))])
        return c.recipe()

    return make


def _corrupt_safetensors(c: Case, mp: pytest.MonkeyPatch) -> Path:
    path = c.checkpoint / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00garbage"  # the JSON header now starts with bytes that are not JSON
    path.write_bytes(bytes(data))
    return c.recipe()


def _gguf(damage: Callable[[bytes], bytes]) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    def make(c: Case, mp: pytest.MonkeyPatch) -> Path:
        path = write_tiny_gguf(c.checkpoint / "tiny.gguf")
        path.write_bytes(damage(path.read_bytes()))
        return c.recipe(tiny_recipe(path).replace("kind: hf-dir", "kind: gguf"))

    return make


def _missing_tensor(c: Case, mp: pytest.MonkeyPatch) -> Path:
    c.edit_weights(lambda t: t.pop(UP_PROJ))
    return c.recipe()


def _extra_tensor(c: Case, mp: pytest.MonkeyPatch) -> Path:
    c.edit_weights(lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(3)))
    return c.recipe()


def _wrong_shape(c: Case, mp: pytest.MonkeyPatch) -> Path:
    c.edit_weights(lambda t: t.__setitem__(UP_PROJ, torch.zeros(64, 64)))
    return c.recipe()


def _architecture(model_type: str, **extra: object) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    def make(c: Case, mp: pytest.MonkeyPatch) -> Path:
        c.edit_config(model_type=model_type, **extra)
        return c.recipe()

    return make


def _remote_code(c: Case, mp: pytest.MonkeyPatch) -> Path:
    """An unknown architecture whose auto_map points at code that would leave a marker."""
    marker = c.root / "REMOTE_CODE_RAN"
    (c.checkpoint / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    auto_map = {"AutoModelForCausalLM": "modeling_evil.Evil", "AutoConfig": "modeling_evil.Cfg"}
    c.edit_config(model_type="evil", auto_map=auto_map)
    return c.recipe()


def _pickle_only(c: Case, mp: pytest.MonkeyPatch) -> Path:
    tensors = load_file(c.checkpoint / "model.safetensors")
    (c.checkpoint / "model.safetensors").unlink()
    torch.save(tensors, c.checkpoint / "pytorch_model.bin")
    return c.recipe()


def _inject_write_error(code: int) -> Callable[[Case, pytest.MonkeyPatch], Path]:
    """Fail writes into the output directory with ``code`` (root ignores file permissions)."""

    def make(c: Case, mp: pytest.MonkeyPatch) -> Path:
        real_open, real_write = os.open, os.write
        under_out: set[int] = set()
        out = str(c.out)

        def fake_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
            inside = os.fspath(path).startswith(out)  # type: ignore[call-overload]
            if inside and flags & (os.O_WRONLY | os.O_RDWR) and code == errno.EACCES:
                raise PermissionError(code, os.strerror(code), os.fspath(path))  # type: ignore[call-overload]
            fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
            if inside:
                under_out.add(fd)
            return fd

        def fake_write(fd: int, data: bytes) -> int:
            if fd in under_out:
                raise OSError(code, os.strerror(code))
            return real_write(fd, data)

        def fake_close(fd: int) -> None:
            under_out.discard(fd)  # the number may be reused for a file elsewhere
            real_close(fd)

        real_close = os.close
        mp.setattr(os, "open", fake_open)
        mp.setattr(os, "write", fake_write)
        mp.setattr(os, "close", fake_close)
        return c.recipe()

    return make


def _unwritable_out_dir(c: Case, mp: pytest.MonkeyPatch) -> Path:
    """EACCES on creating anything in the output directory (the staging directory first)."""
    real_mkdir = os.mkdir
    out = str(c.out)

    def fake_mkdir(path: object, *args: object, **kwargs: object) -> None:
        if os.fspath(path).startswith(out):  # type: ignore[call-overload]
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))  # type: ignore[call-overload]
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    mp.setattr(os, "mkdir", fake_mkdir)
    return c.recipe()


def _disk_too_small(c: Case, mp: pytest.MonkeyPatch) -> Path:
    import converter.pipeline.resources

    usage = shutil.disk_usage(c.root)
    mp.setattr(
        converter.pipeline.resources.shutil, "disk_usage", lambda p: usage._replace(free=1000)
    )
    return c.recipe()


def _memory_limit(c: Case, mp: pytest.MonkeyPatch) -> Path:
    mp.setenv("ANEC_MEMORY_LIMIT", "64MiB")
    return c.recipe()


def _existing_artifact(c: Case, mp: pytest.MonkeyPatch) -> Path:
    return c.edit_recipe("name: tiny", "name: previous-model")


ROWS = [
    Row("yaml-malformed", _yaml("name: [tiny\ntask: x\n"), ("recipe.yaml:", "not valid YAML")),
    Row("yaml-empty", _yaml(""), ("recipe.yaml", "the recipe is empty", "expected a mapping")),
    Row("yaml-list", _yaml("- name\n- task\n"), ("recipe.yaml:1", "got a list")),
    Row(
        "unknown-key",
        _edit("  sequence_length: 16", "  sequence_lenght: 16"),
        ("recipe.yaml:8: shapes.sequence_lenght: unknown key; did you mean 'sequence_length'?",),
    ),
    Row(
        "wrong-type",
        _edit("  batch: 1", "  batch: one"),
        ("recipe.yaml:7: shapes.batch: expected an integer from 1 to 64, got 'one'",),
    ),
    Row(
        "sequence-length-0",
        _edit("sequence_length: 16", "sequence_length: 0"),
        ("shapes.sequence_length: expected an integer from 1 to 16384, got 0",),
    ),
    Row(
        "sequence-length-negative",
        _edit("sequence_length: 16", "sequence_length: -16"),
        ("shapes.sequence_length: expected an integer from 1 to 16384, got -16",),
    ),
    Row(
        "sequence-length-absurd",
        _edit("sequence_length: 16", "sequence_length: 1000000000"),
        ("shapes.sequence_length: expected an integer from 1 to 16384, got 1000000000",),
    ),
    Row(
        "batch-0",
        _edit("  batch: 1", "  batch: 0"),
        ("shapes.batch: expected an integer from 1 to 64, got 0",),
    ),
    Row(
        "target-cannot-hold-options",
        _edit("io:\n", "target: iOS15\nio:\n  dtype: float16\n"),
        ("io.dtype: float16 inputs and outputs need iOS16 / macOS13 or later; target is iOS15",),
    ),
    Row(
        "target-unknown",
        _edit("io:\n", "target: macOS41\nio:\n"),
        ("target: expected one of", "got 'macOS41'; did you mean 'macOS15'?"),
    ),
    Row(
        "fixture-longer-than-window",
        _edit("[1, 2, 3, 4, 5]", "[" + ", ".join(["1"] * 17) + "]"),
        ("fixtures.token_ids[0]: has 17 tokens, more than shapes.sequence_length 16",),
    ),
    Row(
        "checkpoint-missing",
        lambda c, mp: c.recipe(tiny_recipe(c.root / "nowhere")),
        ("recipe.yaml: source.path", "nowhere, which does not exist"),
    ),
    Row(
        "safetensors-truncated",
        _truncate("model.safetensors", lambda n: n // 2),
        ("model.safetensors: truncated: tensor", "the file holds"),
    ),
    Row(
        "safetensors-header-truncated",
        _truncate("model.safetensors", lambda n: 100),
        ("model.safetensors: truncated or corrupt safetensors file: the header claims",),
    ),
    Row(
        "safetensors-corrupt",
        _corrupt_safetensors,
        ("model.safetensors: corrupt safetensors header (not JSON",),
    ),
    Row(
        "safetensors-empty",
        _truncate("model.safetensors", lambda n: 0),
        ("model.safetensors: truncated safetensors file: 0 bytes, no header",),
    ),
    Row(
        "gguf-truncated-data",
        _gguf(lambda b: b[:-1000]),
        ("tiny.gguf: truncated: tensor blk.0.ffn_up.weight needs bytes up to",),
    ),
    Row(
        "gguf-truncated-header",
        _gguf(lambda b: b[:200]),
        ("tiny.gguf: truncated", "GGUF header"),
    ),
    Row(
        "gguf-corrupt-magic",
        _gguf(lambda b: b"GGML" + b[4:]),
        ("tiny.gguf: not a GGUF file (it starts with b'GGML', expected b'GGUF')",),
    ),
    Row(
        "gguf-corrupt-version",
        _gguf(lambda b: b[:4] + struct.pack("<I", 0x7F7F7F7F) + b[8:]),
        ("tiny.gguf: corrupt or unsupported GGUF file: version 2139062143",),
    ),
    Row(
        "tensor-missing",
        _missing_tensor,
        ("model.safetensors: the config and the weights disagree: missing tensor(s)", UP_PROJ),
    ),
    Row(
        "tensor-extra",
        _extra_tensor,
        ("the config and the weights disagree: extra tensor(s)", "model.layers.1.mlp.extra.weight"),
    ),
    Row(
        "tensor-wrong-shape",
        _wrong_shape,
        (f"tensor {UP_PROJ} has shape [64, 64] in the file, the config expects [128, 64]",),
    ),
    Row(
        "fixture-outside-vocabulary",
        _edit("[1, 2, 3, 4, 5]", "[1, 2, 3, 4, 300]"),
        ("fixtures.token_ids[0]: token ids [300] outside the vocabulary (0..299)",),
    ),
    Row(
        "architecture-unsupported",
        _architecture("gpt2"),
        (
            "config.json: model_type: architecture 'gpt2' is not supported",
            "supported for task text-generation: ",
            "llama, qwen2",
        ),
    ),
    Row(
        "architecture-unknown-with-remote-code",
        _remote_code,
        (
            "architecture 'evil' is not supported",
            "supported for task text-generation: ",
            "llama, qwen2",
            "never runs",
        ),
    ),
    Row(
        "pickle-only-checkpoint",
        _pickle_only,
        ("only pickle-based weights (pytorch_model.bin)", "--allow-pickle"),
    ),
    Row(
        "name-with-separator",
        _edit("name: tiny", "name: sub/tiny"),
        ("recipe.yaml:1: name: expected an artifact name", "got 'sub/tiny'"),
    ),
    Row(
        "name-with-dotdot",
        _edit("name: tiny", "name: ..tiny"),
        ("recipe.yaml:1: name: expected an artifact name", "has no '..'", "got '..tiny'"),
    ),
    Row(
        "prompts-without-tokenizer",
        _edit("  token_ids:", '  prompts: ["The capital of France is"]\n  token_ids:'),
        ("fixtures.prompts:", "has no tokenizer", "give fixtures.token_ids instead"),
    ),
    Row(
        "out-dir-unwritable-EACCES",
        _unwritable_out_dir,
        ("output directory", "is not writable: Permission denied"),
    ),
    Row(
        "write-EACCES",
        _inject_write_error(errno.EACCES),
        ("cannot write", "recipe.yaml: Permission denied"),
    ),
    Row(
        "disk-full-ENOSPC",
        _inject_write_error(errno.ENOSPC),
        ("cannot write", "recipe.yaml: No space left on device"),
    ),
    Row(
        "disk-too-small-for-artifact",
        _disk_too_small,
        ("tiny: not enough disk space in", "the artifact needs about", "0.00 GiB is free"),
    ),
    Row(
        "memory-too-small",
        _memory_limit,
        ("tiny: not enough memory:", "parameters", "need about", "ANEC_MEMORY_LIMIT=64MiB"),
    ),
    Row(
        "artifact-exists-without-force",
        _existing_artifact,
        ("previous-model already exists; pass --force to replace it",),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_exits_2_names_the_problem_and_changes_nothing(
    row: Row, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = row.make(case, monkeypatch)
    before = snapshot(case.out)
    result = run_anec("convert", recipe, "--out", case.out)
    monkeypatch.undo()  # before reading files again: some rows patch os.open / os.write
    assert result.exit_code == 2, result.output
    for text in row.expected:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
    assert "Traceback" not in result.output
    assert snapshot(case.out) == before
    assert not (case.root / "REMOTE_CODE_RAN").exists()
