"""The cached functions' MIL fp32 level: each call, layer by layer, against the module in fp64.

The window program is held to ``mil_fp32_layer_rel_error`` per layer (`parity.decoder_fp32`);
this holds prefill, decode and extend - each chunk of a chunked chain - to the same gate. Per
fixture the prompt is prefilled, then each other function is called once on the next tokens of
its greedy continuation, in the MIL evaluator's fp32 profile; a `Recorder` keeps each layer's
output (the markers the conversion names) and the key / value rows each call writes.

The baseline then makes the same calls through `CachedDecoder.run_layer` on float64 copies of
the layers holding the program's constants, one layer at a time (a whole fp64 copy would take
8 bytes a parameter), on the inputs the program read and on the cache the *program* held
before the call (its own written rows, rounded as it stores them). Each call is compared on
its own, so an error is charged to the function and layer that made it, not carried along by
the cache; the cache gates (`parity.kv_gates`) judge the chain of calls end to end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from graph_passes.cached_decoder import HIDDEN_IN, HIDDEN_OUT, CachedDecoder
from graph_passes.logits_layout import chunk_names, join_logits
from graph_passes.markers import MarkerError, find_markers
from graph_passes.model import Block
from parity.decoder_fp32 import fp64_head, fp64_piece
from parity.kv_session import CacheSession
from parity.mil.numerics import round_fp16
from parity.mil_fp32 import Fp32Check, Pair
from parity.mil_level import Fp32Run
from parity.model_copies import set_weights
from parity.reference import Continuation

PROFILE = "fp32"
# A compressed variant's decoded weights by window-module parameter name (None: the module's).
Weights = Mapping[str, np.ndarray] | None


@dataclass
class Call:
    """One call of one chunk's function as the program ran it."""

    function: str
    session: int  # the host loop it belongs to (each starts with an empty cache)
    where: str  # "<fixture> <function> call <k>"
    feed: dict[str, np.ndarray]  # the inputs as the program read them (fp16 ones rounded)
    real: np.ndarray  # (T,) bool: the call's slots that hold real tokens
    position: int  # cache slots holding context before the call
    layers: list[np.ndarray]  # each layer's output (D, T)
    rows: np.ndarray  # (2N, KV, T, d): the key and value rows the call wrote
    logits: np.ndarray | None  # (m, V): the last chunk's logits


def function_markers(
    program: Any, modules: dict[str, CachedDecoder]
) -> tuple[dict[str, list[str]], list[str]]:
    """Each function's layer markers in layer order (a chunk before the last: its last
    layer's output is ``hidden_out``), and a problem per function that lost one."""
    first = next(iter(modules.values()))
    marked = first.num_layers - (0 if first.last else 1)
    handed = [] if first.last else [HIDDEN_OUT]
    markers: dict[str, list[str]] = {}
    problems: list[str] = []
    for name in modules:
        try:
            markers[name] = find_markers(program.functions[name], marked, first.start) + handed
        except MarkerError as e:
            markers[name] = []
            problems.append(f"{name}: {e}")
    return markers, problems


class Recorder:
    """Records each call of one chunk's functions (a `parity.kv_session.CallObserver`)."""

    def __init__(self, program: Any, modules: dict[str, CachedDecoder]) -> None:
        self.modules = modules
        self.markers, self.problems = function_markers(program, modules)
        self.calls: list[Call] = []
        self.session = -1
        self.label = ""
        self.stores_fp16 = False  # whether the program holds its cache in fp16

    def begin(self, label: str) -> None:
        """A new host loop (an empty cache), for the fixture ``label``."""
        self.session += 1
        self.label = label

    def capture(self, function: str) -> list[str]:
        """The layer markers of ``function``."""
        return self.markers[function]

    def see(
        self, function: str, evaluator: Any, inputs: dict[str, np.ndarray], result: Any,
        states: dict[str, np.ndarray] | None,
    ) -> None:  # fmt: skip
        """Keep what the call read, each layer's output, the rows it wrote and its logits."""
        feed = {}
        for name, (dtype, _) in evaluator.inputs.items():
            value = np.asarray(inputs[name])
            feed[name] = round_fp16(value.astype(np.float32)) if dtype == "fp16" else value
        if "new_kv" in result.outputs:  # style io: the rows are an output
            self.stores_fp16 = evaluator.inputs["kv_cache_in"][0] == "fp16"
            rows = np.asarray(result.outputs["new_kv"])
        else:  # style state: the rows are in the state, at each call slot's cache slot
            ((name, (dtype, _)),) = evaluator.states.items()
            assert states is not None
            self.stores_fp16 = dtype == "fp16"
            rows = states[name][:, :, feed["write_slots"][0, 0].argmax(axis=0), :]
        mask = next(v for k, v in feed.items() if k.startswith("mask"))
        logits = None
        if names := chunk_names(result.outputs):
            logits = join_logits({k: result.outputs[k] for k in names})[0]
        count = sum(c.session == self.session for c in self.calls)
        self.calls.append(
            Call(
                function, self.session, f"{self.label} {function} call {count}", feed,
                (mask[0, :, 0, :] == 0).any(axis=0), int(feed["cache_valid"].sum()),
                [result.captured[m][0, :, 0, :] for m in self.markers[function]],
                rows.astype(np.float32), logits,
            )
        )  # fmt: skip


def record_calls(
    make_session: Callable[[], CacheSession],
    recorders: Sequence[Recorder],
    continuations: Sequence[Continuation],
) -> None:
    """Per continuation: prefill its prompt, then call each other function once on the next
    tokens of its continuation (as many as the function takes, while tokens are left)."""
    for c in continuations:
        for recorder in recorders:
            recorder.begin(c.name)
        session = make_session()
        session.prefill("prefill", list(c.prompt))
        rest = list(c.ids[len(c.prompt) :])
        for name, function in session.functions.items():
            take = rest[: function.shape.tokens]
            if name == "prefill" or not take:
                continue
            session.call(name, take)
            rest = rest[len(take) :]


def layer_piece(
    window: torch.nn.Module, part: torch.nn.Module, precision: str, weights: Weights
) -> torch.nn.Module:
    """An fp64 copy of ``part`` (a submodule of ``window``) holding the program's constants:
    ``precision``'s, and a compressed variant's decoded ``weights`` (window-module parameter
    names) where it has them."""
    piece = fp64_piece(part, precision)
    if weights:
        prefix = next(name for name, m in window.named_modules() if m is part) + "."
        own = {n[len(prefix) :]: v for n, v in weights.items() if n.startswith(prefix)}
        set_weights(piece, {n: v.astype(np.float64) for n, v in own.items()})
    return piece


def _stream_in(call: Call, module: CachedDecoder, embed: Any) -> torch.Tensor:
    """The call's stream into its first layer (1, D, 1, T) in fp64, from what it read: the
    embedded tokens (as `BC1LDecoder.embed_bc1l`) or the previous chunk's stream."""
    if not module.first:
        return torch.from_numpy(call.feed[HIDDEN_IN]).double()
    if embed is not None:
        x = embed(torch.from_numpy(call.feed["input_ids"]).long())
    else:
        x = torch.from_numpy(call.feed["inputs_embeds"]).double()
    return x.transpose(1, 2).unsqueeze(2)


def pairs(recorder: Recorder, precision: str, weights: Weights = None) -> Iterator[Pair]:
    """Run the recorded calls through the fp64 layers: each layer's output, the key / value
    rows it wrote and (last chunk) the logits, beside the program's (see the module
    docstring)."""
    modules, calls = recorder.modules, recorder.calls
    some = next(iter(modules.values()))
    window, start, n = some.window, some.start, some.num_layers
    named = [{k: torch.from_numpy(v).double() for k, v in c.feed.items()} for c in calls]
    with torch.no_grad():
        embed = None
        if window.embed is not None:
            embed = layer_piece(window, window.embed, precision, weights)
        hs = [_stream_in(c, modules[c.function], embed) for c in calls]
        del embed
        for i, layer in enumerate(some.layers()):
            piece, index = cast(Block, layer_piece(window, layer, precision, weights)), start + i
            caches: dict[int, torch.Tensor] = {}  # per session: this layer's keys and values
            for b, call in enumerate(calls):
                shape = (2, *some.cache_shape()[1:])
                cache = caches.setdefault(call.session, torch.zeros(shape, dtype=torch.float64))
                valid = named[b]["cache_valid"][0]
                module = modules[call.function]
                hs[b], kv = module.run_layer(
                    index, piece, hs[b], named[b], cache[0] * valid, cache[1] * valid
                )
                k, v = kv.written()
                real, mine = call.real, torch.from_numpy(call.real)
                at = f"{call.where}, layer {index}"
                yield Pair(call.layers[i][:, real], hs[b][0, :, 0, mine], at, index)
                yield Pair(call.rows[i][:, real], k[:, mine], at + " keys", index)
                yield Pair(call.rows[n + i][:, real], v[:, mine], at + " values", index)
                # The cache the next call reads: the program's own rows, as it stores them.
                rows = call.rows[[i, n + i]][:, :, real]
                rows = round_fp16(rows) if recorder.stores_fp16 else rows
                cache[:, :, call.position : call.position + rows.shape[2]] = torch.from_numpy(rows)
        if some.last:
            yield from _logit_pairs(calls, modules, hs, precision, weights)


def _logit_pairs(
    calls: list[Call],
    modules: dict[str, CachedDecoder],
    hs: list[torch.Tensor],
    precision: str,
    weights: Weights,
) -> Iterator[Pair]:
    """The last chunk's logits: the final norm, then one LM-head chunk at a time in fp64."""
    window = next(iter(modules.values())).window
    returned = [
        h[:, :, :, -1:] if modules[c.function].io.logits == "last" else h
        for c, h in zip(calls, hs, strict=True)
    ]
    heads = fp64_head(window, returned, lambda part: layer_piece(window, part, precision, weights))
    for call, logits in zip(calls, heads, strict=True):
        want = logits[0, :, 0, :].T  # (m, V)
        real = call.real[-want.shape[0] :]
        assert call.logits is not None
        mine = torch.from_numpy(real)
        yield Pair(call.logits[real], want[mine], f"{call.where}, logits")


def cached_fp32_run(
    recorders: Sequence[Recorder], precision: str, weights: Weights = None
) -> Fp32Run:
    """The fp32 check over every recorded call of every chunk, for the MIL level's gates
    (`parity.mil_level`; ``precision``: the program's; ``weights``: a compressed variant's
    decoded weights)."""
    problems = [p for r in recorders for p in r.problems]
    layers = sum(next(iter(r.modules.values())).num_layers for r in recorders)
    every = () if problems else (c for r in recorders for c in pairs(r, precision, weights))
    check = Fp32Check.of(layers, every, layers_lost=bool(problems))
    # Calls per function, counted in the first chunk (every chunk runs each call).
    counts = Counter(c.function for c in recorders[0].calls)
    calls = ", ".join(f"{name} {n}" for name, n in counts.items())
    detail = (
        f"the cached functions' calls ({calls}): each layer's output and written key / value "
        "rows (and the logits) at real positions, against the cached module with the "
        "program's constants in fp64 reading the cache the program held"
    )
    problem = problems[0] if problems else ""
    return Fp32Run(check, detail, problem, "every layer's output in every cached function")
