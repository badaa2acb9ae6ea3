"""A host loop over a cached decoder's functions: positions, cache and inputs per call.

`CacheSession` keeps the position (and, for the ``io`` style, the cache) and builds every
call's inputs from `graph_passes.cache_host`; a `FunctionRunner` runs one function on named inputs
(the torch module here, the MIL evaluator in `parity.kv_mil`, Core ML on macOS). The parity
gates, the tests and ``anec generate`` drive the same loop.

A chunked cached decoder runs as one (`chain_runner`, `MilChain`): a decoder split by
``cache.package_budget_mb`` (`converter.tasks.kv_chunks`) is one package per chunk of
consecutive layers, each with its own cache (state or io). One call of a function (prefill,
decode, extend) runs chunk 0 .. n-1 in order with the same host inputs (RoPE rows, masks,
``cache_valid``, ``write_slots``; each chunk takes the ones its layers read): chunk 0 reads the
tokens, each later chunk the ``hidden_out`` its predecessor returned, and the last returns the
LM-head outputs. So `CacheSession`, the cache gates, ``anec generate`` and ``anec speculate``
run a chunked artifact with their logic unchanged.

The ``io`` style: the session keeps one host cache in the one-package layout (2N, KV, S, d);
chunk [a, b) is given its own (2(b - a), KV, S, d) cache - rows a..b-1 (keys) and N+a..N+b-1
(values) - and its ``new_kv`` rows are put back at those rows. A runtime may as well keep one
cache per chunk; the manifest states both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from graph_passes.cache_host import CallShape, call_inputs, write_rows
from graph_passes.cached_decoder import HIDDEN_IN, HIDDEN_OUT, CachedDecoder
from graph_passes.logits_layout import join_logits, top_ids
from parity.head_outputs import ChoiceCheck, add_logits, head_logit_vars
from parity.lockstep import Lockstep

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
    states: MutableMapping[str, np.ndarray] | None = field(default=None, repr=False)
    # The LM-head chunk sizes (manifest lm_head_chunks): to combine argmax / top-k outputs.
    chunk_sizes: list[int] = field(default_factory=list)
    # A trimmed head's token id per row (manifest draft_vocabulary); None: row j is token j.
    head_ids: np.ndarray | None = field(default=None, repr=False)

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
        (logits, or an in-model argmax / top-k per chunk): the manifest's head_output rule,
        then a trimmed head's row mapped to its token id (draft_vocabulary)."""
        return self.choices(outputs, 1)[0]

    def choices(self, outputs: dict[str, np.ndarray], n: int) -> list[int]:
        """`choose` at each of the last ``n`` positions of ``outputs``, in order."""
        rows = top_ids(outputs, self.chunk_sizes)[0, -n:, 0]
        return [int(r) if self.head_ids is None else int(self.head_ids[r]) for r in rows]

    def poison(self, start: int, value: float) -> None:
        """Write ``value`` into every cache slot from ``start`` on (a test of the rule that
        slots beyond the position change no output)."""
        if self.cache is not None:
            self.cache[:, :, start:, :] = value
            return
        if not self.states:
            raise ValueError("no cache to write into: this session's runner keeps it")
        # Written in place where the mapping holds the array (or a view of a module's buffer),
        # and set back whole: Core ML's state (read_state / write_state) is read as a copy.
        for name in list(self.states):
            cache = np.asarray(self.states[name])
            if not cache.flags.writeable:
                cache = cache.copy()
            cache[:, :, start:, :] = value
            self.states[name] = cache

    def prefill(self, function: str, ids: list[int]) -> np.ndarray:
        """Run a prompt of any length through ``function`` in calls of its T tokens (the
        first call left-padded, so every later call is full); returns the logits (V,) at the
        prompt's last position."""
        return join_logits(self.prefill_outputs(function, ids))[0, -1]

    def prefill_outputs(self, function: str, ids: list[int]) -> dict[str, np.ndarray]:
        """As `prefill`, returning the last call's named outputs."""
        out = None
        for chunk in self.prefill_chunks(function, ids):
            out = self.call_outputs(function, chunk)
        assert out is not None
        return out

    def prefill_chunks(self, function: str, ids: list[int]) -> list[list[int]]:
        """The calls `prefill` makes of ``ids``: the first takes the remainder (left-padded),
        every later one ``function``'s T tokens."""
        t = self.functions[function].shape.tokens
        first = len(ids) % t or t
        return [ids[:first]] + [ids[i : i + t] for i in range(first, len(ids), t)]

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
    profile; `session` gives a runner with a fresh (zero) state, as ``make_state()`` does.
    With a ``lockstep`` (`parity.lockstep`), the runners' calls go through it, so sessions
    run in its loops run side by side."""

    def __init__(
        self,
        program: object,
        profile: str,
        functions: list[str],
        cache_shape: tuple[int, ...],
        chunk_sizes: list[int] | None = None,
        observer: CallObserver | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        from parity.mil import Evaluator

        self.evaluators = {name: Evaluator(program, profile, name) for name in functions}
        self.cache_shape = cache_shape
        self.observer = observer
        self.lockstep = lockstep
        # An argmax / top-k program: every call's choice against its own logits (which the
        # runner returns as logits_<k>, captured before the selection).
        self._logit_vars = {n: head_logit_vars(e.function) for n, e in self.evaluators.items()}
        self._chunk_sizes = chunk_sizes if any(self._logit_vars.values()) else None
        self._checks: dict[int, ChoiceCheck] = {}  # by lockstep loop, combined in loop order

    @property
    def check(self) -> ChoiceCheck | None:
        """An argmax / top-k program's choices against its logits, every call so far (None
        for a logits program)."""
        if not self._chunk_sizes:
            return None
        every = ChoiceCheck(self._chunk_sizes)
        for lane in sorted(self._checks):
            every.positions += self._checks[lane].positions
            every.mismatches += self._checks[lane].mismatches
        return every

    def session(self) -> tuple[FunctionRunner, dict[str, np.ndarray]]:
        """A runner over the functions and the state values it keeps between calls (empty
        for the ``io`` style, whose cache the host keeps)."""
        states: dict[str, np.ndarray] = {}
        for evaluator in self.evaluators.values():
            for name in evaluator.states:
                states[name] = np.zeros(self.cache_shape, dtype=np.float32)
        lockstep = self.lockstep or Lockstep()  # outside its loops it simply runs the call

        def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            evaluator = self.evaluators[function]
            held = states if evaluator.states else None
            capture = self.observer.capture(function) if self.observer else []
            logit_vars = self._logit_vars[function]
            wanted = [*capture, *logit_vars.values()]
            result = lockstep.call(evaluator, inputs, wanted, held)
            check = None
            if self._chunk_sizes:
                check = self._checks.setdefault(lockstep.lane(), ChoiceCheck(self._chunk_sizes))
            add_logits(result, logit_vars, check, function)
            if self.observer is not None:
                self.observer.see(function, evaluator, inputs, result, held)
            return dict(result.outputs)

        return run, states


def session_for(
    functions: dict[str, CachedDecoder],
    runner: FunctionRunner,
    states: Any,
    embed: Any,
    head_ids: np.ndarray | None = None,
) -> CacheSession:
    """A fresh host loop over the cached modules ``functions`` run by ``runner`` (the
    functions share the cache shape, RoPE rows and token input; a chunk's functions give
    the host loop of the whole chain: its cache in the one-package layout)."""
    first = next(iter(functions.values()))
    shapes = {
        name: FunctionShape(
            name,
            CallShape(
                m.io.cache_length, m.io.tokens, tuple(m.windows), m.io.style, m.writes_in_place
            ),
            m.io.logits,
        )
        for name, m in functions.items()
    }
    token_input = "input_ids" if first.io.inputs == "token-ids" else "inputs_embeds"
    return CacheSession(
        shapes, rope_rows(first), first.model_cache_shape(), runner, token_input, embed,
        states=states, chunk_sizes=list(first.window.chunk_sizes), head_ids=head_ids,
    )  # fmt: skip


# ---- a chunked decoder's chain ---------------------------------------------------------------


@dataclass(frozen=True)
class ChunkMeta:
    """What the host needs to call one chunk: its layers [start, stop) of ``layers``, the
    input names its functions take and its cache's shape."""

    start: int
    stop: int
    layers: int  # N: every layer of the model
    inputs: frozenset[str]
    cache_shape: tuple[int, ...]

    @property
    def first(self) -> bool:
        """Reads the tokens."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Returns the LM-head outputs."""
        return self.stop == self.layers

    def cache_rows(self) -> list[int]:
        """The rows of the one-package cache layout this chunk's cache holds, in order."""
        keys = list(range(self.start, self.stop))
        return keys + [self.layers + i for i in keys]


def handoff(fed: dict[str, np.ndarray], returned: dict[str, np.ndarray]) -> np.ndarray:
    """What the next chunk reads as ``hidden_in``: the stream this chunk returned."""
    return returned[HIDDEN_OUT]


def chain_runner(chunks: Sequence[ChunkMeta], runners: Sequence[FunctionRunner]) -> FunctionRunner:
    """One runner over every chunk, in call order (see the module docstring)."""
    if not chunks or not chunks[0].first or not chunks[-1].last:
        raise ValueError("a chain runs chunks from layer 0 to the last layer")
    for a, b in zip(chunks, chunks[1:], strict=False):
        if a.stop != b.start:
            raise ValueError(f"chunks [{a.start}, {a.stop}) and [{b.start}, {b.stop}) do not meet")

    def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        hidden: np.ndarray | None = None
        whole = inputs.get("kv_cache_in")
        rows: list[tuple[ChunkMeta, np.ndarray]] = []
        out: dict[str, np.ndarray] = {}
        for chunk, runner in zip(chunks, runners, strict=True):
            feed = {k: v for k, v in inputs.items() if k in chunk.inputs}
            if not chunk.first:
                assert hidden is not None
                feed[HIDDEN_IN] = hidden
            if whole is not None:
                feed["kv_cache_in"] = whole[chunk.cache_rows()]
            returned = runner(function, feed)
            if "new_kv" in returned:
                rows.append((chunk, returned["new_kv"]))
            if chunk.last:
                out = {k: v for k, v in returned.items() if k != "new_kv"}
            else:
                hidden = handoff(feed, returned)
        if rows:
            n = chunks[0].layers
            first = rows[0][1]
            new = np.zeros((2 * n, *first.shape[1:]), dtype=first.dtype)
            for chunk, r in rows:
                new[chunk.cache_rows()] = r
            out["new_kv"] = new
        return out

    return run


class ChainStates(MutableMapping[str, np.ndarray]):
    """Every chunk's state values, keyed ``chunk<i>.<state>``, read and written through to the
    mappings the chunks' runners hold (a run replaces a state's array, so a copy would go
    stale)."""

    def __init__(self, parts: Sequence[MutableMapping[str, np.ndarray]]) -> None:
        self.parts = list(parts)

    def _split(self, key: str) -> tuple[int, str]:
        head, _, name = key.partition(".")
        return int(head.removeprefix("chunk")), name

    def __getitem__(self, key: str) -> np.ndarray:
        i, name = self._split(key)
        return self.parts[i][name]

    def __setitem__(self, key: str, value: np.ndarray) -> None:
        i, name = self._split(key)
        self.parts[i][name] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"{key}: a chunk's state cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter([f"chunk{i}.{name}" for i, part in enumerate(self.parts) for name in part])

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


class MilChain:
    """The chunks' packages prepared once in the MIL evaluator under one profile;
    `session` gives a chained runner with fresh (zero) states, as `MilFunctions` does (and,
    as it, calls through ``lockstep`` when given one)."""

    def __init__(
        self,
        programs: Sequence[object],
        profile: str,
        functions: list[str],
        chunks: Sequence[ChunkMeta],
        chunk_sizes: list[int] | None = None,
        observers: Sequence[CallObserver | None] | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.parts: list[MilFunctions] = []
        for p, c, observer in zip(programs, chunks, observers or [None] * len(chunks), strict=True):
            sizes = chunk_sizes if c.last else None  # the LM head is the last chunk's
            self.parts.append(
                MilFunctions(p, profile, functions, c.cache_shape, sizes, observer, lockstep)
            )

    @property
    def check(self) -> ChoiceCheck | None:
        """The last chunk's `MilFunctions.check`: the LM head's choice outputs are its."""
        return self.parts[-1].check

    def session(self) -> tuple[FunctionRunner, ChainStates]:
        """A chained runner and every chunk's state values (`ChainStates`; empty for the
        ``io`` style)."""
        runners: list[FunctionRunner] = []
        held: list[dict[str, np.ndarray]] = []
        for part in self.parts:
            runner, states = part.session()
            runners.append(runner)
            held.append(states)
        return chain_runner(self.chunks, runners), ChainStates(held)
