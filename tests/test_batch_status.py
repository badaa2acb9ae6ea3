"""`anec convert`'s per-recipe status says which kind of gate failed (exit code 1 covers the
parity, plan and variant gates), in the --json lines and in the closing list of recipes.

Conversions are stand-ins (pipeline.convert replaced): only the batch bookkeeping runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import run_anec

import converter.pipeline.run
import converter.recipe.from_checkpoint
from converter.commands.batch import Outcome
from converter.compression.variant_steps import VariantResult
from converter.pipeline.run import ConvertResult
from converter.pipeline.summary import failed_gate
from parity.gate_registry import gate
from parity.result import LayerRow, ParityReport


def _result(
    name: str, parity: bool = True, plan: bool = True, variant: bool = True
) -> ConvertResult:
    """A conversion result whose parity gate, plan gate and one variant passed or failed."""
    argmax = gate("torch-fp16", "fp16_argmax_agreement")
    result = argmax.check(1.0 if parity else 0.5, 1.0)
    report = ParityReport([result], [LayerRow(0, fp16_max_abs=1.0)], [], None)
    variants = [VariantResult(f"{name}-int8", "int8", variant, Path(f"{name}-int8"))]
    # as pipeline.gate_failed returns it: not passed, with the kind of gate that blocked it
    blocked = None if parity and plan else "parity" if not parity else "plan"
    return ConvertResult(
        name, blocked is None, None, Path(name), report, {}, variants=variants, failed_gate=blocked
    )


RESULTS = {
    "good": _result("good"),
    "parity": _result("parity", parity=False),
    "plan": _result("plan", plan=False),
    "variant": _result("variant", variant=False),
}


def test_failed_gate_names_the_kind_that_failed() -> None:
    assert {ref: failed_gate(r) for ref, r in RESULTS.items()} == {
        "good": None,
        "parity": "parity",
        "plan": "plan",
        "variant": "variant",
    }
    assert all(r.exit_code == (0 if ref == "good" else 1) for ref, r in RESULTS.items())


def test_exit_code_1_without_a_result_is_a_gate_failure_of_unknown_kind() -> None:
    # An AnecError with exit code 1 (e.g. a missing layer marker) carries no result.
    assert Outcome("r.yaml", "r", 1, error="layer marker missing").status == "a gate failed"
    assert Outcome("r.yaml", "r", 3).status == "internal error"


@pytest.fixture
def stand_in_conversions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recipe refs are names of RESULTS; converting one returns that result."""
    monkeypatch.setattr(
        converter.recipe.from_checkpoint, "recipe_for", lambda ref, flags: SimpleNamespace(name=ref)
    )
    monkeypatch.setattr(converter.pipeline.run, "convert", lambda recipe, *_: RESULTS[recipe.name])


@pytest.mark.usefixtures("stand_in_conversions")
def test_json_lines_and_the_recipe_list_name_the_failed_gate() -> None:
    refs = ["parity", "plan", "variant", "good"]
    result = run_anec("convert", *refs, "--json")
    assert result.exit_code == 1, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(x["recipe"], x["exit_code"], x["status"]) for x in lines] == [
        ("parity", 1, "parity gate failed"),
        ("plan", 1, "plan gate failed"),
        ("variant", 1, "variant gate failed"),
        ("good", 0, "converted"),
    ]

    listing = run_anec("convert", *refs).stdout
    for ref in ("parity", "plan", "variant"):
        assert f"{ref} ({ref}): {ref} gate failed [1]" in listing
    assert "good (good): converted [0]" in listing
