"""The fp32 cache level: does the converted program compute the model through its cache?

SPEC section 4, "Cached decoders": the conversion's cache logic is judged in fp32, strictly.
Per continuation (a fixture's prompt and its greedy continuation), in the MIL evaluator's fp32
profile with the program's fp16 inputs and cache held in fp32 (`parity.mil.profiles.FP32_HELD`:
the program's function alone; the fp16 levels judge its storage), through the host loop
(`parity.kv_session.CacheSession`):

* decode: the prompt prefilled, then every continuation token decoded one call at a time;
* extend: the same prompt, then the continuation absorbed K tokens per call;
* stale: a rejected draft and large values in every slot past the position, then decode
  steps that must equal the clean decode run's bits.

Every call of the first two is held to the reference, the window module's layers holding the
program's constants run in fp64 over the whole sequence with no cache (`parity.kv_sequence`):
each layer's output at each real position of the call (relative error per position, the
rewrite's own bound ``fp32_layer_rel_error``), and the logits the call returns (relative,
``fp32_logits_rel_error``, and absolute, `LOGIT_BOUND`). Extend is compared with decode too.
The bounds come from what an exact computation gives, fixed before measuring: the torch fp32
module is within 0.0015 logits of the fp32 checkpoint over Gemma 3's 540 positions, and a
wrong slot, a stale row, a wrong window or RoPE offset moves logits by tenths.

Each gate names where it first went over its bound, in call order: the fixture, the function
and its call, the layer and the position, so a fault is charged to the call that made it,
not to the later positions that inherit it through the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from graph_passes.cached_decoder import CachedDecoder
from graph_passes.logits_layout import join_logits
from parity.gate_registry import GateResult, gate
from parity.kv_gates import STALE_STEPS, stale_difference
from parity.kv_mil import Weights, function_markers, layer_piece
from parity.kv_sequence import SequenceRun, embedded, run_sequence
from parity.kv_session import CacheSession
from parity.lockstep import Lockstep, run_loops
from parity.mil.profiles import FP32_HELD
from parity.reference import Continuation, SpilledRows

LEVEL = "kv-cache"
IMPLEMENTATION = "mil-fp32"
PROFILE = FP32_HELD.name  # fp16 inputs and the cache held in fp32 (`FP32_HELD` says why)
# |logit| bounds of the fp32 program against the fp64 reference (module docstring): about 7x
# what the exact rewrite gives on the most fp32-sensitive model here.
LOGIT_BOUND = 0.01
EXTEND_BOUND = 0.01


class LayerCapture:
    """Each layer's output of the last call of one chunk's functions (a
    `parity.kv_session.CallObserver`); with a ``lockstep``, each loop's own last call."""

    def __init__(
        self, program: Any, modules: dict[str, CachedDecoder], lockstep: Lockstep | None = None
    ) -> None:
        self.start = next(iter(modules.values())).start
        self.markers, self.problems = function_markers(program, modules)
        self.lockstep = lockstep
        self._layers: dict[int, list[np.ndarray]] = {}  # by loop: (D, T) each

    @property
    def layers(self) -> list[np.ndarray]:
        """Each layer's output (D, T) of the last call (of the calling loop)."""
        return self._layers.get(self._lane(), [])

    def _lane(self) -> int:
        return self.lockstep.lane() if self.lockstep is not None else 0

    def capture(self, function: str) -> list[str]:
        """The layer markers of ``function``."""
        return self.markers[function]

    def see(
        self, function: str, evaluator: Any, inputs: dict[str, np.ndarray], result: Any,
        states: dict[str, np.ndarray] | None,
    ) -> None:  # fmt: skip
        """Keep each layer's output of this call."""
        self._layers[self._lane()] = [
            np.asarray(result.captured[m])[0, :, 0, :] for m in self.markers[function]
        ]


@dataclass
class FirstOver:
    """The worst value of a gate, and the first place (in call order) it went over ``bound``."""

    bound: float
    worst: float = 0.0
    worst_at: str = ""
    first_at: str = ""

    def see(self, value: float, where: str) -> None:
        """One measured value at ``where``."""
        if math.isnan(self.worst):
            return
        if value > self.worst or math.isnan(value):
            self.worst, self.worst_at = value, where
        if not self.first_at and not value <= self.bound:
            self.first_at = f"{where} ({value:.3g})"

    def then(self, later: FirstOver) -> FirstOver:
        """This one's values and then ``later``'s, as one `FirstOver` seeing them all in that
        order would hold them (the same bound)."""
        if math.isnan(self.worst):
            return self
        out = FirstOver(self.bound, self.worst, self.worst_at, self.first_at or later.first_at)
        if later.worst > self.worst or math.isnan(later.worst):
            out.worst, out.worst_at = later.worst, later.worst_at
        return out

    @property
    def where(self) -> str:
        """Where it first went over its bound, else where it was worst."""
        return f"first over at {self.first_at}; worst at {self.worst_at}" if self.first_at \
            else self.worst_at  # fmt: skip


def column_rel_errors(mine: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``||m_c - w_c|| / ||w_c||`` per column (position); inf where ``mine`` is not finite."""
    mine, want = mine.astype(np.float64), want.astype(np.float64)
    diff = np.sqrt(np.einsum("ij,ij->j", mine - want, mine - want))
    errors = diff / np.maximum(np.sqrt(np.einsum("ij,ij->j", want, want)), 1e-30)
    return np.where(np.isfinite(mine).all(axis=0), errors, math.inf)


@dataclass
class Judge:
    """Holds every call of one run to the reference (`FirstOver` per gate)."""

    layer: FirstOver
    logits_rel: FirstOver
    logits_abs: FirstOver
    calls: dict[str, int] = field(default_factory=dict)  # per function, every run

    def fresh(self) -> Judge:
        """A judge with the same bounds that has seen nothing."""
        return Judge(FirstOver(self.layer.bound), FirstOver(self.logits_rel.bound),
                     FirstOver(self.logits_abs.bound))  # fmt: skip

    def then(self, later: Judge) -> Judge:
        """This judge's findings and then ``later``'s (`FirstOver.then`), calls summed."""
        calls = dict(self.calls)
        for name, n in later.calls.items():
            calls[name] = calls.get(name, 0) + n
        return Judge(self.layer.then(later.layer), self.logits_rel.then(later.logits_rel),
                     self.logits_abs.then(later.logits_abs), calls)  # fmt: skip

    def call(
        self,
        session: CacheSession,
        captures: Sequence[LayerCapture],
        ref: SequenceRun,
        label: str,
        function: str,
        ids: list[int],
        count: int,
    ) -> dict[int, np.ndarray]:
        """Run ``ids`` through ``function`` and judge it; its logits by position."""
        start, n = session.position, len(ids)
        tokens = session.functions[function].shape.tokens
        out = session.call_outputs(function, ids)
        self.calls[function] = self.calls.get(function, 0) + 1
        where = f"{label} {function} call {count}"
        positions = range(start, start + n)
        for capture in captures:
            for j, states in enumerate(capture.layers):
                index = capture.start + j
                errors = column_rel_errors(states[:, tokens - n :], ref.layers[index][:, positions])
                k = int(np.argmax(errors))
                if (over := np.flatnonzero(~(errors <= self.layer.bound))).size:
                    k = int(over[0])  # the first position over the bound, for `FirstOver`
                self.layer.see(float(errors[k]), f"{where}, layer {index}, position {start + k}")
        logits = join_logits(out)[0]  # (m, V): the last m slots of the call
        at = list(positions)[-logits.shape[0] :]
        rows = logits[-min(n, logits.shape[0]) :]
        by_position = {}
        for p, row in zip(at, rows, strict=True):
            want = ref.logits[p].astype(np.float64)
            mine = row.astype(np.float64)
            diff = mine - want
            finite = bool(np.isfinite(mine).all())
            self.logits_abs.see(float(np.abs(diff).max()) if finite else math.inf,
                                f"{where}, logits, position {p}")  # fmt: skip
            rel = math.sqrt(float(diff @ diff)) / max(math.sqrt(float(want @ want)), 1e-30)
            self.logits_rel.see(rel if finite else math.inf, f"{where}, logits, position {p}")
            by_position[p] = row
        return by_position


def reference(
    modules: dict[str, CachedDecoder],
    c: Continuation,
    table: np.ndarray,
    precision: str,
    weights: Weights,
) -> SequenceRun:
    """The fp64 reference of one continuation: the window module with the program's
    constants (``precision``; a variant's decoded ``weights``) over the whole sequence."""
    window = next(iter(modules.values())).window

    def piece(part: torch.nn.Module) -> torch.nn.Module:
        return layer_piece(window, part, precision, weights)

    stream = embedded(window, list(c.ids), table, piece, torch.float64)
    return run_sequence(window, stream, piece, torch.float64)


def cached_fp32_level(
    make_session: Callable[[], CacheSession],
    captures: Sequence[LayerCapture],
    continuations: Sequence[Continuation],
    reference_of: Callable[[Continuation], SequenceRun],
    extend_tokens: int,
    thresholds: tuple[float, float],
    lockstep: Lockstep | None = None,
) -> list[GateResult]:
    """Every gate of the fp32 cache level (see the module docstring); ``thresholds``: the
    recipe's ``fp32_layer_rel_error`` and ``fp32_logits_rel_error``. ``lockstep``: the one
    the sessions' runner calls through, to run the continuations side by side
    (`parity.lockstep`; the captures keep each loop's own layers); None: one after the
    other."""
    problems = [p for c in captures for p in c.problems]
    judge = Judge(FirstOver(thresholds[0]), FirstOver(thresholds[1]), FirstOver(LOGIT_BOUND))
    extend_diff, stale = FirstOver(EXTEND_BOUND), FirstOver(0.0)
    if problems:  # without every layer's marker no call can be judged per layer
        judge.layer.see(math.inf, problems[0])
        continuations = []
    bodies = [partial(_continuation, make_session, captures, reference_of, c, judge.fresh(),
                      extend_tokens) for c in continuations]  # fmt: skip
    found = run_loops(bodies, lockstep)
    for part in found:  # in order, as one after the other
        judge = judge.then(part.judge)
        extend_diff, stale = extend_diff.then(part.extend), stale.then(part.stale)
    calls = ", ".join(f"{name} {n}" for name, n in judge.calls.items())
    detail = (f"every call ({calls}) over each fixture's whole continuation, in fp32, against "
              "the window module with the program's constants in fp64 over the whole "
              "sequence, no cache")  # fmt: skip
    g = lambda name: gate(LEVEL, name)  # noqa: E731
    return [
        g("fp32_layer_rel_error").check(judge.layer.worst, thresholds[0],
                                        implementation=IMPLEMENTATION, where=judge.layer.where,
                                        detail="each layer's output at every real position: "
                                        + detail),
        g("fp32_logits_rel_error").check(judge.logits_rel.worst, thresholds[1],
                                         implementation=IMPLEMENTATION,
                                         where=judge.logits_rel.where, detail=detail),
        g("kv_fp32_max_abs_logit_error").check(judge.logits_abs.worst,
                                               implementation=IMPLEMENTATION,
                                               where=judge.logits_abs.where, detail=detail),
        g("kv_fp32_extend_max_abs_diff").check(extend_diff.worst, implementation=IMPLEMENTATION,
                                               where=extend_diff.where),
        g("kv_fp32_stale_max_abs_diff").check(stale.worst, implementation=IMPLEMENTATION,
                                              where=stale.where),
    ]  # fmt: skip


@dataclass
class _Findings:
    """What the fp32 cache level found on one continuation, combined in order."""

    judge: Judge
    extend: FirstOver
    stale: FirstOver


def _continuation(
    make_session: Callable[[], CacheSession],
    captures: Sequence[LayerCapture],
    reference_of: Callable[[Continuation], SequenceRun],
    c: Continuation,
    judge: Judge,
    extend_tokens: int,
) -> _Findings:
    """The level's runs on one continuation: decode, then extend and stale."""
    found = _Findings(judge, FirstOver(EXTEND_BOUND), FirstOver(0.0))
    ref = reference_of(c)
    # Rows from the prompt's last position on, kept on disk (Gemma 3: 513 x 262,144).
    first = len(c.prompt) - 1
    session = make_session()
    decoded = _decode_run(session, captures, ref, c, judge)
    if "extend" in session.functions:
        for p, row in _extend_run(make_session(), captures, ref, c, judge, extend_tokens):
            diff = np.abs(row.astype(np.float64) - decoded[p - first]).max()
            found.extend.see(float(diff), f"{c.name} extend, position {p}")
        clean = {p: decoded[p - first] for p in range(first, first + STALE_STEPS + 1)
                 if p - first < len(decoded)}  # fmt: skip
        found.stale.see(stale_difference(make_session(), c, "prefill", extend_tokens, clean),
                        c.name)  # fmt: skip
    return found


def _decode_run(
    session: CacheSession,
    captures: Sequence[LayerCapture],
    ref: SequenceRun,
    c: Continuation,
    judge: Judge,
) -> SpilledRows:
    """Prefill the prompt, decode the continuation one token a call; the logits from the
    prompt's last position on, in position order."""
    rows = SpilledRows()
    for k, chunk in enumerate(session.prefill_chunks("prefill", list(c.prompt))):
        last = judge.call(session, captures, ref, c.name, "prefill", chunk, k)
    rows.append(last[len(c.prompt) - 1])
    for k, p in enumerate(range(len(c.prompt), len(c.ids))):
        rows.append(judge.call(session, captures, ref, c.name, "decode", [c.ids[p]], k)[p])
    return rows


def _extend_run(
    session: CacheSession,
    captures: Sequence[LayerCapture],
    ref: SequenceRun,
    c: Continuation,
    judge: Judge,
    k: int,
) -> Iterator[tuple[int, np.ndarray]]:
    """Prefill the prompt, absorb the continuation K tokens a call (each call judged);
    (position, logits) in position order, a call at a time, none kept (Gemma 3: 512 rows of
    262,144 held at once were 0.5 GiB)."""
    for i, chunk in enumerate(session.prefill_chunks("prefill", list(c.prompt))):
        judge.call(session, captures, ref, c.name, "prefill", chunk, i)
    rest = list(c.ids[len(c.prompt) :])
    for i in range(0, len(rest), k):
        yield from judge.call(session, captures, ref, c.name, "extend", rest[i : i + k],
                              i // k).items()  # fmt: skip
