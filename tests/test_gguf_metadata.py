"""GGUF metadata read from the header alone (`read_gguf_metadata`), and the checkpoint licence
taken from it: the same values gguf.GGUFReader decodes, on small files written with gguf."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader
from tiny_models import write_tiny_gguf

from converter.checkpoints.loading import _license
from converter.checkpoints.weightfiles import read_gguf, read_gguf_metadata
from converter.errors import InputError
from converter.recipe import ResolvedSource


def test_metadata_values_match_gguf_reader(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "apache-2.0")
    keys = ["general.license", "general.architecture", "llama.block_count", "no.such.key"]
    found = read_gguf_metadata(path, keys)
    assert found == {
        "general.license": "apache-2.0",
        "general.architecture": "llama",
        "llama.block_count": 1,
    }
    fields = GGUFReader(path).fields
    assert bytes(fields["general.license"].parts[-1]).decode() == found["general.license"]
    # Arrays are passed over, not decoded; an empty request reads nothing.
    assert read_gguf_metadata(path, ["tokenizer.ggml.tokens"]) == {"tokenizer.ggml.tokens": None}
    assert read_gguf_metadata(path, []) == {}
    assert read_gguf(path).architecture == "llama"  # the full header parse still agrees


def test_not_a_gguf_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(InputError, match="x.gguf: not a GGUF file"):
        read_gguf_metadata(path, ["general.license"])


def test_license_comes_from_gguf_metadata_then_the_model_card(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "with.gguf", "mit")
    write_tiny_gguf(tmp_path / "without.gguf")
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    assert _license(ResolvedSource("gguf", tmp_path, "with.gguf")) == "mit"
    assert _license(ResolvedSource("gguf", tmp_path, "without.gguf")) == "apache-2.0"
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")  # a reader error is not fatal
    assert _license(ResolvedSource("gguf", tmp_path, "broken.gguf")) == "apache-2.0"


def test_header_parse_reads_the_same_fields_and_puts_the_reader_back(tmp_path: Path) -> None:
    """`load_checkpoint`'s GGUF context parses through a plain-array reader: every field and
    tensor as gguf's own reader has them; outside the block gguf's class is back."""
    import gguf
    import numpy as np
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from converter.checkpoints.loading import _gguf_header_parsed_once

    path = write_tiny_gguf(tmp_path / "m.gguf", "apache-2.0")
    plain = GGUFReader(path)
    reader, parse = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    with _gguf_header_parsed_once():
        assert gguf.GGUFReader is not reader
        fast = gguf.GGUFReader(path)
        assert type(fast.data) is np.ndarray
    assert (gguf.GGUFReader, gguf_utils.load_gguf_checkpoint) == (reader, parse)
    assert list(fast.fields) == list(plain.fields)
    for name, field in plain.fields.items():
        assert field.types == fast.fields[name].types, name
        for a, b in zip(field.parts, fast.fields[name].parts, strict=True):
            assert np.array_equal(a, b), name
    for a, b in zip(plain.tensors, fast.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert np.array_equal(a.data, b.data), a.name
