"""The gate registry (parity/gate_registry.py): every gate anec runs is registered once, named by
the
recipe key that sets its threshold, checked through one comparison, and listed in docs/parity.md."""

from __future__ import annotations

import ast
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from converter.recipe import Gates
from converter.recipe.gate_table import markdown_table, recipe_field
from parity.gate_registry import REGISTRY, Comparison, Level, Worst, gate, registered
from parity.kv_fp32 import FirstOver

ROOT = Path(__file__).resolve().parent.parent


def test_every_threshold_is_set_by_a_recipe_key_that_exists() -> None:
    for g in registered():
        if g.recipe_key is None:
            assert g.fixed is not None, f"{g.key}: neither a recipe key nor a fixed threshold"
            continue
        assert g.fixed is None, f"{g.key}: a recipe key and a fixed threshold"
        recipe_field(g.recipe_key)  # KeyError naming the missing step
        # The recipe's key is the gate's name: `gates:` is keyed by gate name.
        assert g.recipe_key.rsplit(".", 1)[-1] == g.name, g.key
        if g.recipe_key.startswith("gates."):
            assert g.name in Gates.model_fields, g.key


def test_every_gates_field_names_a_registered_gate() -> None:
    keyed = {g.recipe_key for g in registered()}
    for field in set(Gates.model_fields) - set(Gates.SWITCHES):
        assert f"gates.{field}" in keyed, f"recipe gates.{field} sets no registered gate"


def test_a_recipe_key_that_does_not_exist_is_named() -> None:
    with pytest.raises(KeyError, match="Gates has no field fp32_nonsense"):
        recipe_field("gates.fp32_nonsense")
    with pytest.raises(KeyError, match="VariantGates has no field min_top5"):
        recipe_field("compression.variants[].gates.min_top5")


def test_the_parity_doc_lists_every_registered_gate() -> None:
    readme = (ROOT / "docs" / "parity.md").read_text(encoding="utf-8")
    assert markdown_table() in readme, (
        "docs/parity.md gate table is stale: python -m converter.recipe.gate_table"
    )
    for g in registered():
        assert f"| {g.level} | `{g.name}` |" in readme, g.key


@pytest.mark.parametrize(
    ("comparison", "passing", "failing"),
    [(Comparison.AT_MOST, 1e-5, 2e-4), (Comparison.AT_LEAST, 1.0, 0.99), (Comparison.EQUALS, 1, 0)],
)
def test_the_verdict_and_its_text_come_from_one_comparison(
    comparison: Comparison, passing: float, failing: float
) -> None:
    g = next(g for g in registered() if g.comparison is comparison)
    given = {"<=": 1e-4, ">=": 1.0}.get(comparison.value) if g.recipe_key else None
    threshold = given if given is not None else g.fixed
    assert threshold is not None
    assert g.check(passing, given).passed
    bad = g.check(failing, given, where="layer 3")
    assert not bad.passed
    assert f" {comparison.value} " in bad.relation()
    assert bad.text().endswith(": FAIL") and "at layer 3" in bad.text()
    assert not g.check(math.nan, given).passed  # NaN never passes
    assert bad.threshold == threshold
    assert bad.to_json()["comparison"] == comparison.value


def test_thresholds_are_fixed_or_given_never_both() -> None:
    finite = gate("torch-fp16", "finite_outputs")
    assert finite.check(1.0).passed and not finite.check(0.0).passed
    with pytest.raises(ValueError, match="fixed"):
        finite.check(0.0, 0.0)
    with pytest.raises(ValueError, match="gates.fp32_layer_rel_error"):
        gate("torch-fp32", "fp32_layer_rel_error").check(1e-6)
    with pytest.raises(KeyError, match="'argmax agreement'"):
        gate("torch-fp16", "argmax agreement")


def test_worst_keeps_the_worst_and_never_hides_nan() -> None:
    worst = Worst(0.0)
    for value, where in [(1e-6, "a"), (3e-6, "b"), (2e-6, "c")]:
        worst.see(value, where)
    assert (worst.value, worst.where) == (3e-6, "b")
    worst.see(math.nan, "d")
    worst.see(1.0, "e")
    assert math.isnan(worst.value) and worst.where == "d"
    lowest = Worst(math.inf, lowest=True)
    for value, where in [(0.9999, "a"), (0.999, "b")]:
        lowest.see(value, where)
    assert lowest.where == "b"


# Ties, NaN and inf on either side of every cut, and (for FirstOver's bound 1.0) values over
# and under the bound: the lockstep's loops' findings are combined this way, in order.
SEEN = [0.5, 2.0, 0.2, 0.5, 3.0, 3.0, 0.1, math.nan, 0.3, math.inf, 0.0]
KEEPERS: dict[str, Callable[[], Any]] = {
    "worst": lambda: Worst(0.0),
    "lowest": lambda: Worst(math.inf, lowest=True),
    "first over": lambda: FirstOver(1.0),
}


@pytest.mark.parametrize("kind", list(KEEPERS))
def test_then_holds_what_one_keeper_seeing_both_in_order_holds(kind: str) -> None:
    def state(keeper: Any) -> tuple[str, str]:
        value = keeper.value if isinstance(keeper, Worst) else keeper.worst
        return str(value), keeper.where

    for length in range(len(SEEN) + 1):
        values = [(v, f"at {i}") for i, v in enumerate(SEEN[:length])]
        for cut in range(length + 1):
            whole, first, later = (KEEPERS[kind]() for _ in range(3))
            for keeper, part in ((whole, values), (first, values[:cut]), (later, values[cut:])):
                for v, w in part:
                    keeper.see(v, w)
            assert state(first.then(later)) == state(whole), (kind, cut, values)


def test_no_module_builds_a_gate_result_by_hand() -> None:
    # Every result comes from Gate.check: the registry is the one place a gate is declared.
    offenders = []
    for package in ("parity", "converter", "graph_passes"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "parity" / "gate_registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "GateResult":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders


def test_registry_keys_are_unique_level_and_name() -> None:
    assert len(REGISTRY) == len(registered())
    assert {g.level for g in registered()} <= {
        "torch-fp32",
        "torch-fp16",
        "mil-fp32",
        "mil-fp16",
        "mil-device-margin",
        "acceptance",
        "kv-cache",
        "compression",
        "plan",
        "recheck",
    }


def test_the_parity_doc_says_what_each_registered_level_is_the_first_to_catch() -> None:
    readme = (ROOT / "docs" / "parity.md").read_text(encoding="utf-8")
    section = readme.split("### What each level is the first to catch", 1)[1].split("###", 1)[0]
    rows = {line.split("|")[1].strip().strip("`") for line in section.splitlines()
            if line.startswith("| `")}  # fmt: skip
    assert rows == set(typing.get_args(Level))
