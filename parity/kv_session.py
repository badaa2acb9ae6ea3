"""A host loop over a cached decoder's functions: positions, cache and inputs per call.

`CacheSession` keeps the position (and, for the ``io`` style, the cache) and builds every
call's inputs from `graph_passes.cache_host`; a `FunctionRunner` runs one function on named inputs
(the torch module here, the MIL evaluator in `parity.kv_mil`, Core ML on macOS). The parity
gates, the tests and ``anec generate`` drive the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from graph_passes.cache_host import CallShape, call_inputs, write_rows
from graph_passes.cached_decoder import HIDDEN_IN, HIDDEN_OUT, CachedDecoder
from graph_passes.logits_layout import join_logits, top_ids

# One call of one function of a package (the host loop's level, apart from the batch-level
# `parity.result.Runner`): (function name, named inputs) -> named outputs (logits_<k>
# chunks, new_kv for io).
FunctionRunner = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


class CallObserver(Protocol):
    """Sees each call `MilFunctions` runs (`parity.kv_mil.Recorder`)."""

    def capture(self, function: str) -> list[str]:
        """Values of ``function`` to capture besides its outputs."""
        ...

    def see(
        self, function: str, evaluator: Any, inputs: dict[str, np.ndarray], result: Any,
        states: dict[str, np.ndarray] | None,
    ) -> None:  # fmt: skip
        """One call: its inputs, the evaluation and the states after it."""
        ...


@dataclass
class FunctionShape:
    """One function of the package: its name, token count and what logits it returns."""

    name: str
    shape: CallShape
    logits: str  # "last" or "all"


@dataclass
class CacheSession:
    """Drive the functions of one cached decoder through a sequence of calls."""

    functions: dict[str, FunctionShape]
    rope: list[tuple[np.ndarray, np.ndarray]]  # per group, cos and sin (r, S)
    cache_shape: tuple[int, ...]
    runner: FunctionRunner
    token_input: str  # "input_ids" or "inputs_embeds"
    embed: Callable[[list[int]], np.ndarray] | None = None  # ids -> (n, D) rows
    position: int = 0
    cache: np.ndarray | None = field(default=None, repr=False)  # io style only
    # The runner's state values (style state, MIL evaluator), for `poison`.
    states: Mapping[str, np.ndarray] | None = field(default=None, repr=False)
    # The LM-head chunk sizes (manifest lm_head_chunks): to combine argmax / top-k outputs.
    chunk_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        style = next(iter(self.functions.values())).shape.style
        if style == "io":
            self.cache = np.zeros(self.cache_shape, dtype=np.float32)

    def call(self, function: str, ids: list[int]) -> np.ndarray:
        """Run ``ids`` (n <= T tokens) at the current position; returns logits (V, m) for the
        m positions the function returns, and advances the position by n."""
        return join_logits(self.call_outputs(function, ids))[0].T

    def call_outputs(self, function: str, ids: list[int]) -> dict[str, np.ndarray]:
        """As `call`, returning the function's named outputs (logits, or an argmax / top-k
        program's choice outputs)."""
        f = self.functions[function]
        t, n = f.shape.tokens, len(ids)
        inputs = call_inputs(f.shape, self.position, n, self.rope)
        padded = [0] * (t - n) + list(ids)
        if self.token_input == "input_ids":
            inputs["input_ids"] = np.array([padded], dtype=np.int32)
        else:
            assert self.embed is not None
            inputs["inputs_embeds"] = self.embed(padded)[None].astype(np.float32)
        if self.cache is not None:
            inputs["kv_cache_in"] = self.cache
        out = self.runner(function, inputs)
        if self.cache is not None:
            write_rows(self.cache, out["new_kv"], self.position, n)
        self.position += n
        return out

    def choose(self, outputs: dict[str, np.ndarray]) -> int:
        """The greedy token at the last position of ``outputs``, whichever the head returns
        (logits, or an in-model argmax / top-k per chunk): the manifest's head_output rule."""
        return int(top_ids(outputs, self.chunk_sizes)[0, -1, 0])

    def poison(self, start: int, value: float) -> None:
        """Write ``value`` into every cache slot from ``start`` on (a test of the rule that
        slots beyond the position change no output)."""
        caches = [self.cache] if self.cache is not None else list((self.states or {}).values())
        if not caches:
            raise ValueError("no cache to write into: this session's runner keeps it")
        for cache in caches:
            cache[:, :, start:, :] = value

    def prefill(self, function: str, ids: list[int]) -> np.ndarray:
        """Run a prompt of any length through ``function`` in calls of its T tokens (the
        first call left-padded, so every later call is full); returns the logits (V,) at the
        prompt's last position."""
        return join_logits(self.prefill_outputs(function, ids))[0, -1]

    def prefill_outputs(self, function: str, ids: list[int]) -> dict[str, np.ndarray]:
        """As `prefill`, returning the last call's named outputs."""
        t = self.functions[function].shape.tokens
        out = None
        first = len(ids) % t or t
        chunks = [ids[:first]] + [ids[i : i + t] for i in range(first, len(ids), t)]
        for chunk in chunks:
            out = self.call_outputs(function, chunk)
        assert out is not None
        return out

    def rollback(self, position: int) -> None:
        """Forget every token from ``position`` on (rejected drafts): they become stale."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position} from {self.position}")
        self.position = position


def rope_rows(module: CachedDecoder) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each RoPE group's cos and sin tables (r, S) for positions 0..S-1 (fp32)."""
    positions = torch.arange(module.io.cache_length)
    out = []
    for group in module.groups:
        cos, sin = group.tables(positions)
        out.append((cos[0, 0].numpy(), sin[0, 0].numpy()))
    return out


def torch_runner(modules: dict[str, CachedDecoder], dtype: torch.dtype) -> FunctionRunner:
    """Run the torch modules (sharing one state buffer for the ``state`` style)."""

    def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        module = modules[function]
        if module.first:
            names = ["input_ids" if "input_ids" in inputs else "inputs_embeds"]
        else:
            names = [HIDDEN_IN]
        names += module.input_names()
        args = []
        for name in names:
            value = torch.from_numpy(np.asarray(inputs[name]))
            args.append(value if name == "input_ids" else value.to(dtype))
        with torch.no_grad():
            out = module(*args)
        if module.last:
            result = {
                f"logits_{k}": o.float().numpy()
                for k, o in enumerate(out[: len(module.window.lm_head)])
            }
        else:
            result = {HIDDEN_OUT: out[0].float().numpy()}
        if module.io.style == "io":
            result["new_kv"] = out[-1].float().numpy()
        return result

    return run


class MilFunctions:
    """The functions of a multifunction program prepared once in the MIL evaluator under one
    profile; `session` gives a runner with a fresh (zero) state, as ``make_state()`` does."""

    def __init__(
        self,
        program: object,
        profile: str,
        functions: list[str],
        cache_shape: tuple[int, ...],
        chunk_sizes: list[int] | None = None,
        observer: CallObserver | None = None,
    ) -> None:
        from parity.head_outputs import ChoiceCheck, head_logit_vars
        from parity.mil import Evaluator

        self.evaluators = {name: Evaluator(program, profile, name) for name in functions}
        self.cache_shape = cache_shape
        self.observer = observer
        # An argmax / top-k program: every call's choice against its own logits (which the
        # runner returns as logits_<k>, captured before the selection).
        chooses = any(head_logit_vars(e.function) for e in self.evaluators.values())
        self.check = ChoiceCheck(chunk_sizes) if chooses and chunk_sizes else None

    def session(self) -> tuple[FunctionRunner, dict[str, np.ndarray]]:
        """A runner over the functions and the state values it keeps between calls (empty
        for the ``io`` style, whose cache the host keeps)."""
        states: dict[str, np.ndarray] = {}
        for evaluator in self.evaluators.values():
            for name in evaluator.states:
                states[name] = np.zeros(self.cache_shape, dtype=np.float32)

        def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            from parity.head_outputs import run_capturing_logits

            evaluator = self.evaluators[function]
            held = states if evaluator.states else None
            capture = self.observer.capture(function) if self.observer else []
            result = run_capturing_logits(
                evaluator, inputs, capture, states=held, check=self.check, where=function
            )
            if self.observer is not None:
                self.observer.see(function, evaluator, inputs, result, held)
            return dict(result.outputs)

        return run, states


def session_for(
    functions: dict[str, CachedDecoder], runner: FunctionRunner, states: Any, embed: Any
) -> CacheSession:
    """A fresh host loop over the cached modules ``functions`` run by ``runner`` (the
    functions share the cache shape, RoPE rows and token input; a chunk's functions give
    the host loop of the whole chain: its cache in the one-package layout)."""
    first = next(iter(functions.values()))
    shapes = {
        name: FunctionShape(
            name,
            CallShape(m.io.cache_length, m.io.tokens, tuple(m.windows), m.io.style),
            m.io.logits,
        )
        for name, m in functions.items()
    }
    token_input = "input_ids" if first.io.inputs == "token-ids" else "inputs_embeds"
    return CacheSession(
        shapes, rope_rows(first), first.model_cache_shape(), runner, token_input, embed,
        states=states, chunk_sizes=list(first.window.chunk_sizes),
    )  # fmt: skip
