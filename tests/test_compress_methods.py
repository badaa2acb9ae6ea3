"""The compression methods registry: one module per method, found by name, and the recipe
schema built from it (the accepted ``method:`` values and which method owns which field)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from converter.compression import methods
from converter.compression.methods.base import CompressionMethod, Scheme
from converter.errors import InputError
from converter.recipe.compression_section import Compression, Variant
from converter.recipe.yaml_errors import expected_at

NEW_METHOD = """
from converter.compression.methods.base import CompressionMethod, Scheme


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
    assert expected_at(Variant, ("method",)) == "one of " + ", ".join(methods.names())
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


# A test-only method, as one file: int8 storage under its own name, listed first, searchable
# and carried into a cached decoder. Nothing else is edited to make it available.
DEMO_METHOD = """
from converter.compression.methods.base import CompressionMethod, Scheme
from converter.compression.methods.int8 import METHOD as INT8


class Demo(CompressionMethod):
    name = "demo8"
    summary = "a method added as one file, end to end"
    order = 5
    kv_cache = True
    records_symmetry = True
    searchable = True
    search_summary = "test-only int8 per row"
    fields = {"symmetric": "weights have a zero point"}

    def scheme(self, variant):
        return Scheme(self.name, 8, "per-channel", None, variant.symmetric)

    def describe(self, scheme):
        return "demo " + INT8.describe(scheme)

    def ct_config(self, scheme):
        return INT8.ct_config(scheme)

    def algorithm(self, scheme, site):
        return "demo: " + INT8.algorithm(scheme, site)

    def apply(self, mlmodel, op_configs):
        return INT8.apply(mlmodel, op_configs)

    def search_candidates(self, space, widths):
        return [Scheme(self.name, 8, "per-channel", None, True)] if 8 in widths else []

    def stored_bytes(self, site, scheme):
        return site.elements + site.shape[0] * 2


METHOD = Demo()
"""
GATES = {"min_top1_agreement": 0.5, "max_mean_kl": 0.5}


@pytest.fixture
def demo(demo_package: Path, monkeypatch: pytest.MonkeyPatch) -> CompressionMethod:
    """The demo method registered beside the real ones (as discovery would, in order)."""
    (demo_package / "demo8.py").write_text(DEMO_METHOD)
    found = methods.discover([str(demo_package)], "demo_methods")
    monkeypatch.setattr(methods, "METHODS", methods.ranked({**methods.METHODS, **found}))
    return found["demo8"]


def _demo_compression() -> Compression:
    search = {"bits": [16, 8], "methods": ["demo8", "lut"], "budget": GATES}
    return Compression.model_validate(
        {
            "held_out": [[1, 2, 3]],
            "calibration": [[4, 5, 6]],  # read by mixed
            "variants": [
                {"suffix": "d", "method": "demo8", "granularity": "per-channel",
                 "symmetric": False, "gates": GATES},
                {"suffix": "m", "method": "mixed", "search": search, "gates": GATES},
            ],
        }
    )  # fmt: skip


def test_a_registered_method_is_available_end_to_end(
    demo: CompressionMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_compress_schemes import NAMES, _model

    from converter.compression.candidates import candidates, fits, label, stored_bytes
    from converter.compression.records import weight_records
    from converter.compression.schemes import apply_plan, variant_scheme
    from converter.compression.search import _summaries
    from converter.compression.sites import weight_sites
    from converter.compression.stateful import check_methods
    from converter.recipe.cache_section import kv_method_problems

    # the recipe accepts it (a variant, a search method), listed by its order
    compression = _demo_compression()
    assert methods.names()[0] == "demo8" and methods.search_methods()[0] == "demo8"
    assert "demo8: test-only int8 per row" in _summaries()
    # a cached decoder takes it (kv_cache), in its own variant and in a search
    assert kv_method_problems(compression.variants) == []
    check_methods(compression)
    # the mixed search yields its candidates, labelled and sized by it
    space = compression.variants[1].search
    demo8 = Scheme("demo8", 8, "per-channel", None, True)
    assert candidates(space) == [None, demo8, Scheme("lut", 8, "per-tensor")]
    model = _model("iOS17")
    sites = weight_sites(model._mil_program.functions["main"], NAMES)
    assert label(demo8) == "demo88" and fits(sites[0], demo8)
    assert stored_bytes(sites[0], demo8) == sites[0].elements + sites[0].shape[0] * 2
    # its scheme is applied and recorded as its own (symmetry recorded: records_symmetry)
    scheme = variant_scheme(compression.variants[0])
    program = apply_plan(model, {"a.weight": scheme}, sites)._mil_program
    records, _ = weight_records(program.functions["main"], sites, {"a.weight": scheme}, {})
    a = next(r for r in records if r.weight == "a.weight")
    assert (a.method, a.symmetric, a.op) == ("demo8", False, "constexpr_affine_dequantize")
    assert a.scheme == "demo int8 per-channel asymmetric" and a.algorithm.startswith("demo:")
    # KV support follows the attribute
    monkeypatch.setattr(type(demo), "kv_cache", False)
    refused = kv_method_problems(compression.variants)
    assert [loc[-1] for loc, _ in refused] == ["method", "methods"]
    assert "use one of lut, int8, mixed" in refused[0][1] and "use [lut]" in refused[1][1]
    with pytest.raises(InputError, match=r"variants\[0\]\.method: demo8 variants of a cached"):
        check_methods(compression)


# MIL vocabulary, not method names: dtypes ("int8") and op inputs ("lut") of programs.
NOT_METHOD_NAMES = ("converter/compression/methods/", "converter/placement/", "parity/mil/")


def test_no_module_outside_methods_names_a_method() -> None:
    """A method's facts live on its class: no string equal to a method name elsewhere (a
    ``dtype=`` argument is a MIL dtype)."""
    repo = Path(__file__).resolve().parent.parent
    names = set(methods.names())
    found = []
    for root in ("converter", "graph_passes", "parity"):
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if rel.startswith(NOT_METHOD_NAMES):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            dtypes = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword)
                      and k.arg == "dtype"}  # fmt: skip
            found += [
                f"{rel}:{node.lineno}: {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) not in dtypes
            ]
    assert not found, found
