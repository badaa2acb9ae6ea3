"""The MIL fp32 check, one for every model kind: the emitted program, run by the MIL evaluator
in its fp32 profile, against the same function computed in float64 with the program's
constants (the module's values rounded as the program stores them, a variant's decoded
weights).

A subject runs the program and its fp64 baseline in its own way: a window decoder through its
layer markers and logits, an encoder or decision island through its markers, a decision tail
on its gather, a cached chain call by call reading the cache the program held, a compressed
decoder variant through its markers and logits, an encoder variant on its outputs. What it
yields is the same: `Pair`s, the program's value beside the baseline's. `Fp32Check` keeps the
worst relative error of each layer, of the outputs and of all; `level_gates` makes the level's
two gates for every kind, ``layer_markers_present`` and ``mil_fp32_layer_rel_error``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from parity.gate_registry import GateResult, Worst, gate
from parity.metrics import rel_error_np

LEVEL = "mil-fp32"
GATE = "mil_fp32_layer_rel_error"
MARKERS = "layer_markers_present"


@dataclass(frozen=True)
class Pair:
    """One value the program computed beside the baseline's, at real positions only."""

    got: Any  # the program's (array-like)
    want: Any  # the fp64 baseline's, the same shape
    where: str  # the gate's ``where`` when this is the worst
    layer: int | None = None  # the layer whose output (or cache rows) it is; None: an output


@dataclass
class Fp32Check:
    """The worst ``||got - want|| / ||want||`` per layer, of the outputs and overall (inf where
    ``got`` is not finite; NaN is worst of all, as in `Worst`)."""

    layers: list[Worst]
    output: Worst = field(default_factory=lambda: Worst(0.0))
    overall: Worst = field(default_factory=lambda: Worst(0.0))

    @classmethod
    def of(cls, n_layers: int, pairs: Iterable[Pair], layers_lost: bool = False
           ) -> Fp32Check:  # fmt: skip
        """The check over ``pairs`` of a program with ``n_layers`` layers; with
        ``layers_lost`` (a layer marker the program lost) no layer could be compared, so each
        layer's error and the overall worst are inf."""
        start = math.inf if layers_lost else 0.0
        check = cls([Worst(start) for _ in range(n_layers)], overall=Worst(start))
        for pair in pairs:
            check.see(pair)
        return check

    def see(self, pair: Pair) -> None:
        """Compare one pair and keep it where it is the worst."""
        error = rel_error_np(pair.got, pair.want)
        (self.output if pair.layer is None else self.layers[pair.layer]).see(error, pair.where)
        self.overall.see(error, pair.where)

    @property
    def layer_rel_error(self) -> list[float]:
        """Each layer's worst error."""
        return [worst.value for worst in self.layers]

    def gate(self, threshold: float, detail: str) -> GateResult:
        """``mil_fp32_layer_rel_error``: the worst over every value compared."""
        return gate(LEVEL, GATE).check(
            self.overall.value, threshold, where=self.overall.where, detail=detail
        )


def level_gates(
    check: Fp32Check | None, threshold: float, detail: str, problem: str = "", found: str = ""
) -> list[GateResult]:
    """The mil-fp32 level's gates, the same for every model kind.

    ``layer_markers_present``: the evaluator prepared the program(s) and found every layer's
    output (``found`` says what), or ``problem`` says what it could not, and no layer was
    compared. Then, when the fp32 profile ran (``check``), ``mil_fp32_layer_rel_error``.
    Recorded when they pass too, so every artifact and its re-check have the same gate set.
    """
    gates = [gate(LEVEL, MARKERS).check(float(not problem), detail=problem or found)]
    if check is not None:
        gates.append(check.gate(threshold, detail))
    return gates
