"""The predicted speed of a speculative draft-and-verify loop, written once.

Per cycle with depth K, from the draft's step costs (the cost model's floors per chip), the
target's verify cost (given by the user) and the mean accepted drafts per cycle (measured):

* tokens per cycle = mean accepted + 1 (the accepted drafts and the target's own token);
* draft per cycle = (K - 1) x decode + ceil((K + 1) / E) x extend: the first draft of a cycle
  comes out of the extend calls (E tokens each) that absorb the previous cycle's tokens, at
  most K + 1 of them, so the extend term is an upper bound;
* verify per cycle = one merged target call of the K + 1 positions (``verify_ms``), or, not
  merged, K + 1 target calls of one token (``target_ms`` each);
* sequential cycle = draft + verify; pipelined cycle = max(draft, verify): the draft proposes
  cycle N + 1 while the target checks cycle N. Optimistic: drafting past a rejection is
  wasted work this does not charge;
* tokens / s = tokens per cycle / cycle time; speed-up = that over the target alone
  (1 / ``target_ms``).

Every figure here is a prediction (`converter.evidence.labels.Evidence.PREDICTED`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from converter.errors import InputError
from converter.evidence.labels import Evidence

FORMULA = (
    "tokens per cycle = mean accepted + 1; draft = (K - 1) * decode_ms + ceil((K + 1) / E) * "
    "extend_ms (an upper bound); verify = verify_ms merged, else (K + 1) * target_ms; "
    "sequential = draft + verify; pipelined = max(draft, verify) (drafting past a rejection "
    "not charged); speed-up = (tokens per cycle / cycle ms) * target_ms"
)


@dataclass(frozen=True)
class LoopCosts:
    """What one cycle costs: the draft's (predicted per chip) and the target's (given)."""

    decode_ms: float  # one draft decode call (1 token)
    extend_ms: float  # one draft extend call (E tokens)
    extend_tokens: int  # E
    verify_ms: float  # one merged target call verifying K drafts (K + 1 positions)
    target_ms: float  # the target alone, per generated token

    def __post_init__(self) -> None:
        for name in ("decode_ms", "extend_ms", "verify_ms", "target_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value!r}: expected a finite time above 0 ms")
        if self.extend_tokens < 1:
            raise ValueError(f"extend_tokens {self.extend_tokens}: expected 1 or more")


@dataclass(frozen=True)
class LoopPrediction:
    """The loop's predicted cycle times, throughput and speed-up at one K."""

    k: int
    merged: bool
    tokens_per_cycle: float
    draft_ms_per_cycle: float
    verify_ms_per_cycle: float
    sequential_ms: float
    pipelined_ms: float
    sequential_tokens_per_s: float
    pipelined_tokens_per_s: float
    target_tokens_per_s: float
    sequential_speedup: float
    pipelined_speedup: float

    def to_json(self) -> dict[str, Any]:
        """The figures with their evidence label and the formula."""
        return {**asdict(self), "evidence": Evidence.PREDICTED.value, "formula": FORMULA}


def predict(k: int, mean_accepted: float, costs: LoopCosts, merged: bool = True) -> LoopPrediction:
    """The loop at depth ``k`` (see the module docstring)."""
    if k < 1:
        raise ValueError(f"k {k}: expected 1 or more")
    if not 0 <= mean_accepted <= k:
        raise ValueError(f"mean_accepted {mean_accepted}: expected 0..{k} (K = {k})")
    tokens = mean_accepted + 1.0
    draft = (k - 1) * costs.decode_ms + math.ceil((k + 1) / costs.extend_tokens) * costs.extend_ms
    verify = costs.verify_ms if merged else (k + 1) * costs.target_ms
    sequential, pipelined = draft + verify, max(draft, verify)
    alone = 1000.0 / costs.target_ms
    seq_rate, pipe_rate = 1000.0 * tokens / sequential, 1000.0 * tokens / pipelined
    return LoopPrediction(
        k, merged, tokens, draft, verify, sequential, pipelined, seq_rate, pipe_rate, alone,
        seq_rate / alone, pipe_rate / alone,
    )  # fmt: skip


def best(predictions: Sequence[LoopPrediction], pipelined: bool) -> LoopPrediction:
    """The prediction with the highest speed-up (pipelined or sequential); ties: smaller K."""
    if not predictions:
        raise ValueError("no predictions to choose from")

    def key(p: LoopPrediction) -> tuple[float, int]:
        return (p.pipelined_speedup if pipelined else p.sequential_speedup, -p.k)

    return max(predictions, key=key)


@dataclass(frozen=True)
class DraftCost:
    """One chip's predicted draft step costs and the weight bytes a decode call streams."""

    chip: str
    decode_ms: float
    extend_ms: float
    streamed_bytes_per_token: float | None


def draft_costs(
    packages: Sequence[Path], per_function: dict[str, Path] | None = None
) -> dict[str, DraftCost]:
    """Per chip, the cost model's floors of the draft's decode and extend calls
    (`converter.placement.inspect.inspect_package`, predicted) and the weight bytes one decode
    call reads (the streamed section), summed over a chunked decoder's ``packages`` (a call
    runs every chunk); ``per_function``: the per-function layout's package of each function
    (its ``main``). InputError naming a package without the function it needs."""
    if per_function:
        missing = {"decode", "extend"} - set(per_function)
        if missing:
            raise InputError(f"per-function packages: no {', '.join(sorted(missing))} package")
        calls = [(per_function["decode"], {"decode": "main"}),
                 (per_function["extend"], {"extend": "main"})]  # fmt: skip
    else:
        calls = [(p, {"decode": "decode", "extend": "extend"}) for p in packages]
    ms: dict[str, dict[str, float]] = {}
    streamed: float | None = 0.0
    for package, names in calls:
        predicted = _predicted(package, set(names.values()))
        for f in predicted["floors"]:
            for call, function in names.items():
                if f["function"] == function:
                    by = ms.setdefault(f["chip"], {"decode": 0.0, "extend": 0.0})
                    by[call] += float(f["ms"])
        if "decode" in names:
            read = predicted["streamed"]["functions"][names["decode"]]["weight_bytes_read_per_call"]
            streamed = None if streamed is None or read is None else streamed + float(read)
    return {chip: DraftCost(chip, by["decode"], by["extend"], streamed) for chip, by in ms.items()}


def _predicted(package: Path, functions: set[str]) -> dict[str, Any]:
    """The package's ``predicted`` section; InputError when it lacks one of ``functions``."""
    from converter.placement.inspect import inspect_package

    predicted = inspect_package(package).predicted
    have = {f["function"] for f in predicted["floors"]}
    if not functions <= have:
        raise InputError(
            f"{package}: a draft loop needs its {', '.join(sorted(functions))} function(s); "
            f"it has {', '.join(sorted(have)) or 'none'}"
        )
    return dict(predicted)
