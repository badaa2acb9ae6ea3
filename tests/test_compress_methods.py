"""The compression methods registry: one module per method, found by name, and the recipe
schema built from it (the accepted ``method:`` values and which method owns which field)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from converter.compress import methods
from converter.compress.config import Variant
from converter.compress.methods.base import CompressionMethod, Scheme

NEW_METHOD = """
from converter.compress.methods.base import CompressionMethod, Scheme


class Int4(CompressionMethod):
    name = "int4-demo"
    summary = "a method added as one file"
    fields = {"symmetric": "weights have a zero point"}

    def scheme(self, variant):
        return Scheme("int8", 8, "per-channel")


METHOD = Int4()
"""


def test_every_method_is_a_registered_module_and_a_recipe_value() -> None:
    assert methods.names() == (
        "lut",
        "int8",
        "w8a8",
        "mixed",
        "outliers",
        "scaled",
        "gptq",
        "skm",
        "grid",
    )
    assert get_args(Variant.model_fields["method"].annotation) == methods.names()
    for name in methods.names():
        assert isinstance(methods.get(name), CompressionMethod) and methods.get(name).summary
    with pytest.raises(
        KeyError, match="registered: lut, int8, w8a8, mixed, outliers, scaled, gptq, skm, grid"
    ):
        methods.get("int4")


def test_storing_methods_describe_their_schemes() -> None:
    assert Scheme("int8", 8, "per-channel", None, True).describe() == "int8 per-channel symmetric"
    assert Scheme("lut", 6, "per-tensor").describe() == "lut6 k-means per-tensor"
    with pytest.raises(ValueError, match="mixed variants have a searched plan"):
        methods.get("mixed").scheme(Variant.model_validate(_mixed()))


def _mixed() -> dict[str, object]:
    return {
        "suffix": "m",
        "method": "mixed",
        "search": {"budget": {"min_top1_agreement": 0.9, "max_mean_kl": 0.1}},
        "gates": {"min_top1_agreement": 0.9, "max_mean_kl": 0.1},
    }


def test_fields_a_method_does_not_own_are_refused_with_their_owners() -> None:
    from pydantic import ValidationError

    gates = {"min_top1_agreement": 0.9, "max_mean_kl": 0.1}
    with pytest.raises(ValidationError) as e:
        Variant.model_validate(
            {"suffix": "v", "method": "lut", "bits": 4, "symmetric": False,
             "activations_keep_fp16": ["*"], "gates": gates}
        )  # fmt: skip
    text = str(e.value)
    assert "only int8 and w8a8 weights have a zero point" in text
    assert "only for method: w8a8" in text


@pytest.fixture
def demo_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    package = tmp_path / "demo_methods"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m.startswith("demo_methods")]:
        del sys.modules[name]


def test_a_new_method_is_one_file(demo_package: Path) -> None:
    (demo_package / "int4_demo.py").write_text(NEW_METHOD)
    found = methods.discover([str(demo_package)], "demo_methods")
    assert list(found) == ["int4-demo"]
    assert found["int4-demo"].fields == {"symmetric": "weights have a zero point"}


def test_a_module_without_a_method_is_refused(demo_package: Path) -> None:
    (demo_package / "broken.py").write_text("METHOD = object()\n")
    with pytest.raises(TypeError, match="broken: expected METHOD"):
        methods.discover([str(demo_package)], "demo_methods")
