"""Parity of a program whose LM head returns an in-model argmax or top-k (``io.output``).

Such a program returns no logits, but it computes them: each chunk's selection op
(``reduce_max`` / ``reduce_argmax`` or ``topk``) reads the chunk's vocabulary-last logits. The
MIL evaluator captures those values, so every logits gate runs on the program's own logits
path exactly as for a logits program, and one more check ties the returned choice to them:
the ids the host combines from the argmax / top-k outputs (`graph_passes.logits_layout.
top_ids`) must be the top ids of the captured logits at every position, their values those
logits. Together: the chosen id is the reference's wherever the logits gates say the argmax
is (margin above the thresholds).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graph_passes.logits_layout import candidates, head_output_of, top_ids

_VALUE = re.compile(r"(argmax|topk)_value_(\d+)")
RESULTS_BYTES = 256 * 2**20  # the results `run_many_capturing_logits` holds at once, at most


def head_logit_vars(function: Any) -> dict[str, str]:
    """``logits_<k>`` -> the name of the value chunk k's selection op reads, for an argmax /
    top-k program; empty for a program that returns its logits."""
    found: dict[str, str] = {}
    for op in function.operations:
        for out in op.outputs:
            m = _VALUE.fullmatch(out.name)
            if m:
                found[f"logits_{m.group(2)}"] = op.x.name
    return found


@dataclass
class ChoiceCheck:
    """Positions where the returned choice disagrees with the program's own logits."""

    chunk_sizes: list[int]
    positions: int = 0
    mismatches: list[str] = field(default_factory=list)

    def see(self, outputs: dict[str, np.ndarray], where: str) -> None:
        """Compare one call's choice outputs with its captured ``logits_<k>`` (both in
        ``outputs``): ids equal to the logits' top ids, values equal to their logits."""
        choice = {k: v for k, v in outputs.items() if not k.startswith("logits_")}
        ids, values = candidates(choice, self.chunk_sizes)
        k = 1 if head_output_of(choice) == "argmax" else ids.shape[-1] // len(self.chunk_sizes)
        chosen = top_ids(choice, self.chunk_sizes, k)
        logits = {n: v for n, v in outputs.items() if n.startswith("logits_")}
        want = top_ids(logits, self.chunk_sizes, k)
        full = np.concatenate([np.asarray(logits[n], np.float32) for n in sorted(
            logits, key=lambda n: int(n[7:]))], axis=-1)[:, :, 0, :]  # fmt: skip
        picked = np.take_along_axis(full, ids, axis=-1)
        for b, p in np.ndindex(*chosen.shape[:2]):
            self.positions += 1
            if not np.array_equal(chosen[b, p], want[b, p]) or not np.array_equal(
                picked[b, p], values[b, p]
            ):
                self.mismatches.append(
                    f"{where} row {b} slot {p}: chose {chosen[b, p].tolist()}, "
                    f"logits say {want[b, p].tolist()}"
                )


def run_capturing_logits(
    evaluator: Any,
    inputs: dict[str, np.ndarray],
    capture: Iterable[str] = (),
    states: dict[str, np.ndarray] | None = None,
    check: ChoiceCheck | None = None,
    where: str = "",
) -> Any:
    """``evaluator.run`` that, for an argmax / top-k program, adds the program's own logits
    to the outputs as ``logits_<k>`` (captured before the selection) and, given ``check``,
    compares the returned choice with them. A logits program runs unchanged."""
    logit_vars = head_logit_vars(evaluator.function)
    wanted = list(capture) + list(logit_vars.values())
    result = evaluator.run(inputs, capture=wanted, states=states)
    add_logits(result, logit_vars, check, where)
    return result


def run_many_capturing_logits(
    evaluator: Any,
    feeds: Sequence[dict[str, np.ndarray]],
    capture: Iterable[str] = (),
    check: ChoiceCheck | None = None,
    wheres: Sequence[str] = (),
) -> list[Any]:
    """`run_capturing_logits` on each of ``feeds`` through ``evaluator.run_many`` (each
    result that input's own run's), in groups holding at most ``RESULTS_BYTES`` of results;
    ``check`` sees them in order, ``wheres[i]`` naming feed i."""
    logit_vars = head_logit_vars(evaluator.function)
    wanted = list(capture) + list(logit_vars.values())
    # In groups whose results stay under RESULTS_BYTES: a recipe returning every position's
    # logits over a large vocabulary holds tens of MB per input.
    size = max(1, RESULTS_BYTES // max(1, evaluator.result_bytes(wanted)))
    results: list[Any] = []
    for start in range(0, len(feeds), size):
        results += evaluator.run_many(feeds[start : start + size], capture=wanted)
    for i, result in enumerate(results):
        add_logits(result, logit_vars, check, wheres[i] if wheres else "")
    return results


def add_logits(
    result: Any, logit_vars: dict[str, str], check: ChoiceCheck | None, where: str
) -> None:
    """Put an argmax / top-k program's captured logits (``logit_vars``: output name ->
    captured value) into ``result``'s outputs, and let ``check`` compare its choice."""
    if logit_vars:
        for name, var in logit_vars.items():
            result.outputs[name] = result.captured[var]
        if check is not None:
            check.see(result.outputs, where)
