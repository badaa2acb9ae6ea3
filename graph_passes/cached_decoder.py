"""The cached BC1L decoder: T new tokens at explicit positions against a KV cache of S slots.

It calls the layers of a window module (`graph_passes.decoder.BC1LDecoder`) - the same
`Block` objects and their forward, final norm and LM head - so a change to the window module's
weights or norms (the residual-stream scale, norm prescales set by name) is the cached
module's too, a layer feature is written once for both, and the weights are held once in
memory. Only where the keys and values live differs: each layer's attention gets a
`CachedKeys` (`graph_passes.attention.KeyValues`), which scores the T new tokens against the
cache as well and keeps the rows they write.

Cache: one fp16 tensor ``kv_cache`` (2N, KV, S, d) for N layers of KV kv heads of d channels:
row ``i`` holds layer i's keys, row ``N + i`` its values, slot ``s`` the token at position
``s``. Rank 4, the last axis the head dimension (64 or 128: a multiple of 32 fp16 elements),
fully static (`docs` in the manifest cite the sources, ../shared/research/anchors_runtime.md
section 2: rank <= 5 with rank 4 safer, last axis a multiple of 32, fp16 only, static shapes).

Position-dependent values are host inputs, so the program has no integer arithmetic:

* ``rope_cos_<g>`` / ``rope_sin_<g>`` (1, 1, r, T): the RoPE rows of the T tokens' positions
  for each distinct RoPE of the layers (Gemma 3's local and global layers differ);
* ``mask`` (1, S + T, 1, T) (and ``mask_window_<w>`` for local layers): additive, keys on axis
  1 - the S cache slots, then the T new tokens - queries on axis 3, 0 visible, ``MASKED`` not;
  (1, S, 1, T), the S slots alone, for a function that writes in place (below);
* ``cache_valid`` (1, 1, S, 1): 1 for a slot that holds a token before this call, 0 otherwise.
  The cache is multiplied by it before use, so a stale slot (a rejected draft's K/V) or any
  finite value written beyond the position contributes exactly 0 to a score and to an output,
  even where it is large enough that its score would overflow fp16 (a mask alone would not
  cancel an infinite score);
* ``write_slots`` (1, 1, S, T), cache style ``state`` only: one-hot, column t is 1 at the slot
  token t is written to, all 0 for a padding token (written nowhere).

Cache styles (`CacheStyle`):

* ``state``: the cache is a Core ML state (``ct.StateType``, macOS 15 / iOS 18). The update is
  ``cache * (1 - sum_t write_slots) + sum_t write_slots[t] * rows[t]``, a layer at a time:
  fp16 elementwise ops (a 2-D matmul per kv head for a prefill's T tokens), no
  ``slice_update`` with run-time indices (which ANE compilers reject or send to the CPU:
  coreai-torch #6, Anemll #27, anemll-profile's "Cannot support standalone slice_update")
  and no int32 tensor. Its cost is a pass over the cache per token written.
* ``io``: the cache is an input and only the new rows come out, ``new_kv`` (2N, KV, T, d); the
  host writes them at their slots (macOS 14 / iOS 17).

Where the new tokens' keys meet the cache:

* written in place (style ``state``): each layer blends its rows into its cache slots first
  (`SlotWrite`) and attends to the S slots alone - per head one score, one softmax and one
  weighted sum, as in the window program. The blend is the state update itself, done a layer
  at a time, so it costs no pass more than writing after the layers would;
* scored apart (style ``io``): the cache is the host's, so the new keys' scores are
  concatenated on the key axis after the cache's (T x (S + T) values per head, not a copy of
  the cache).

Either way the values are read as the cache holds them, rows (S, d): one matmul of the
weights' transpose with the rows per head, never a transpose of the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from graph_passes.attention import Attention
from graph_passes.decoder import BC1LDecoder, InputKind
from graph_passes.model import Block
from graph_passes.rope import Positions, inverse_frequencies, rope_tables
from graph_passes.spec import AttentionSpec

CacheStyle = Literal["state", "io"]
LogitPositions = Literal["last", "all"]
CACHE_NAME = "kv_cache"
# Up to this many tokens per call a layer's cache write is elementwise (`SlotWrite.blend`).
ELEMENTWISE_WRITE = 8
# A chunk of a chunked decoder (layers [start, stop) of N) returns the stream (1, D, 1, T) as
# HIDDEN_OUT unless it is the last; the next chunk reads it as HIDDEN_IN.
HIDDEN_OUT = "hidden_out"
HIDDEN_IN = "hidden_in"


@dataclass(frozen=True)
class CacheIO:
    """Fixed shapes of one function of a cached decoder (batch 1)."""

    style: CacheStyle
    cache_length: int  # S slots
    tokens: int  # T new tokens per call
    logits: LogitPositions  # "last": slot T - 1 only; "all": every slot
    inputs: InputKind


@dataclass(frozen=True)
class RopeGroup:
    """One distinct RoPE of the layers: its rotated channels and frequencies (fp64)."""

    rotary_dim: int
    inv_freq: torch.Tensor

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (1, 1, r, len(positions)) in fp32, as `Rope` holds them."""
        return rope_tables(self.rotary_dim, 0.0, positions, self.inv_freq)


def rope_groups(specs: list[AttentionSpec]) -> tuple[list[RopeGroup], list[int]]:
    """The distinct RoPEs of the layers and each layer's index into them."""
    groups: list[RopeGroup] = []
    keys: list[tuple[int, float, object]] = []
    index = []
    for s in specs:
        key = (s.rotary_channels, s.rope_theta, s.rope_scaling)
        if key not in keys:
            keys.append(key)
            inv = inverse_frequencies(s.rotary_channels, s.rope_theta, s.rope_scaling)
            groups.append(RopeGroup(s.rotary_channels, inv))
        index.append(keys.index(key))
    return groups, index


class CachedDecoder(nn.Module):
    """T tokens against a KV cache, with the window module's layers; see the module docstring.

    ``forward(x, *host)`` takes the inputs `input_names` lists, in that order; for style
    ``io`` the cache comes last. It returns the LM-head chunks (1, n, 1, V_k) and, for
    ``io``, the new rows (2N, KV, T, d); ``state`` updates the ``kv_cache`` buffer.
    """

    kv_cache: torch.Tensor

    def __init__(
        self, window: BC1LDecoder, io: CacheIO, layers: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        spec = window.spec
        self.start, self.stop = layers or (0, spec.num_layers)
        if not 0 <= self.start < self.stop <= spec.num_layers:
            raise ValueError(f"layers {layers}: expected a range inside 0..{spec.num_layers}")
        if io.inputs != window.io.inputs:
            raise ValueError(
                f"a cached decoder reads its window module's inputs ({window.io.inputs}), "
                f"not {io.inputs}"
            )
        for layer in spec.layers:
            if layer.placement == "post" or not layer.attention.rope:
                raise ValueError("a cached decoder needs pre-norm RoPE layers")
        self.window = window
        self.io = io
        self.spec = spec
        attention = [layer.attention for layer in spec.layers]
        # RoPE groups and windows of the whole model: every chunk of a call reads the same
        # host inputs (its own subset of them: `used_groups`, `chunk_windows`).
        self.groups, self.group_of = rope_groups(attention)
        self.windows = sorted({w for a in attention if (w := a.window) is not None})
        mine = attention[self.start : self.stop]
        self.used_groups = sorted({self.group_of[i] for i in range(self.start, self.stop)})
        self.chunk_windows = sorted({w for a in mine if (w := a.window) is not None})
        self.uses_global_mask = any(a.window is None for a in mine)
        first = attention[0]
        self.kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        if any((a.num_kv_heads, a.head_dim) != (self.kv_heads, self.head_dim) for a in attention):
            raise ValueError("a cached decoder needs the same kv heads and head_dim in every layer")
        if io.style == "state":
            self.register_buffer(CACHE_NAME, torch.zeros(self.cache_shape()))

    @property
    def first(self) -> bool:
        """Whether this chunk reads the tokens (else the previous chunk's ``hidden_out``)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Whether this chunk applies the final norm and the LM head (else returns the
        stream as ``hidden_out``)."""
        return self.stop == self.spec.num_layers

    @property
    def num_layers(self) -> int:
        """Layers this module runs (all of them unless it is a chunk)."""
        return self.stop - self.start

    def cache_shape(self) -> tuple[int, int, int, int]:
        """(2N, KV, S, d): keys of layer i in row i, values in row N + i (N, i: this
        module's layers)."""
        return (2 * self.num_layers, self.kv_heads, self.io.cache_length, self.head_dim)

    def model_cache_shape(self) -> tuple[int, int, int, int]:
        """(2N, KV, S, d) over every layer of the model, whichever chunk this is: the
        one-package layout a chunked decoder's host loop keeps (`parity.kv_session`)."""
        n = self.spec.num_layers
        return (2 * n, self.kv_heads, self.io.cache_length, self.head_dim)

    def rows_shape(self) -> tuple[int, int, int, int]:
        """(2N, KV, T, d): the new rows of one call, in the cache's layout."""
        return (2 * self.num_layers, self.kv_heads, self.io.tokens, self.head_dim)

    def input_names(self) -> list[str]:
        """The host inputs after the tokens (or ``hidden_in``), in ``forward`` order: the
        RoPE rows and masks this module's layers read, then the cache inputs."""
        names = []
        for g in self.used_groups:
            names += [f"rope_cos_{g}", f"rope_sin_{g}"]
        if self.uses_global_mask:
            names.append("mask")
        names += [*(f"mask_window_{w}" for w in self.chunk_windows), "cache_valid"]
        names.append("write_slots" if self.io.style == "state" else "kv_cache_in")
        return names

    def reset_cache(self) -> None:
        """Zero the state (torch runs only; a Core ML state starts at zero)."""
        if self.io.style == "state":
            self.kv_cache.zero_()

    def layers(self) -> list[Block]:
        """The window module's transformer layers this module runs (shared objects)."""
        return self.window.decoder_layers()[self.start : self.stop]

    @property
    def writes_in_place(self) -> bool:
        """Whether the new tokens' keys and values are blended into their cache slots before
        the layer attends (cache style ``state``): their scores are then part of the cache's
        and the mask covers the S slots only."""
        return self.io.style == "state"

    def mask_keys(self) -> int:
        """Keys on the masks' axis 1: the S slots, then (unless written in place) the T new
        tokens."""
        return self.io.cache_length + (0 if self.writes_in_place else self.io.tokens)

    def forward(self, x: torch.Tensor, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.input_names(), host, strict=True))
        t = self.io.tokens
        raw = self.kv_cache if self.io.style == "state" else named["kv_cache_in"]
        cache = raw * named["cache_valid"]
        # The first chunk embeds the tokens; a later one reads the stream (1, D, 1, T).
        h = self.window.embed_bc1l(x) if self.first else x
        keys, values, held = [], [], []
        n = self.num_layers
        for i, layer in enumerate(self.layers()):
            h, kv = self.run_layer(self.start + i, layer, h, named, cache[i], cache[n + i])
            k, v = kv.written()
            keys.append(k)
            values.append(v)
            held.append(kv.held)
        if self.last:
            if self.io.logits == "last":
                h = h[:, :, :, t - 1 :]
            outputs = self.window.head_outputs(h)
        else:
            outputs = (h,)  # every position: the next chunk's layers need all T
        if self.io.style == "io":
            return (*outputs, torch.stack(keys + values))  # the new rows (2N, KV, T, d)
        # One state write of the whole cache, the layers' blended caches (the assignment
        # coremltools reads as a state update; converter.coreml.mil_passes folds its whole-tensor
        # slice_update away).
        self.kv_cache[:, :, :, :] = torch.stack(
            [k for k, _ in held] + [v for _, v in held]  # type: ignore[misc]
        )
        return outputs

    def run_layer(
        self,
        index: int,
        layer: Block,
        h: torch.Tensor,
        named: Mapping[str, torch.Tensor],
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> tuple[torch.Tensor, CachedKeys]:
        """Layer ``index`` of the model - ``layer``, its block or a copy of it - on the stream
        ``h`` (1, D, 1, T), with the call's host inputs ``named`` and the layer's valid cache
        rows (KV, S, d): the window's own block, reading and writing the cache through
        `CachedKeys`. Returns the new stream and the layer's `CachedKeys`, which hold the key
        and value rows (KV, T, d) the call writes (`parity.kv_mil` runs float64 copies of the
        layers through it)."""
        g = self.group_of[index]
        positions = Positions(named[f"rope_cos_{g}"], named[f"rope_sin_{g}"], self.io.tokens)
        # Per layer in the trace; coremltools merges the copies into one.
        write = SlotWrite.of(named["write_slots"]) if self.writes_in_place else None
        kv = CachedKeys(cache_k, cache_v, positions, self.io.cache_length, write)
        mask = named["mask" if layer.window is None else f"mask_window_{layer.window}"]
        return layer(h, mask, kv), kv


class CachedKeys:
    """One layer's keys and values in a cached call (`graph_passes.attention.KeyValues`): the
    T new tokens at host `Positions` attend to the S cache slots and to themselves; their key
    and value rows (KV, T, d) are what the call writes (`written`).

    With a `SlotWrite` (`CachedDecoder.writes_in_place`) the rows are
    first blended into the layer's cache at their slots (`held`), and the tokens attend to the
    S slots alone: one score and one weighted sum per head, as in the window program, instead
    of the new keys' scores computed apart and concatenated. Without it (style ``io``, whose
    cache is the host's) the T new keys are scored apart and concatenated on the key axis
    after the S cached ones, so the cache is not copied (see the module docstring).
    """

    def __init__(
        self,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        positions: Positions,
        slots: int,
        write: SlotWrite | None = None,
    ) -> None:
        self.cache_k, self.cache_v = cache_k, cache_v  # (KV, S, d), valid slots only
        self.positions = positions
        self.slots = slots  # S, a Python int (a traced shape read is an int cast)
        self.write = write
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # in place: (KV, S, d) each

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new key and value rows (KV, T, d), in the cache's layout."""
        if self.rows is None:
            raise RuntimeError("the layer's attention has not run on these keys")
        return self.rows

    def attend(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor,
        mask: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Per query head: scores against the cached (and, unless written in place, the new)
        keys, the softmax on the key axis, and the weighted values."""
        s, t, length = attn.spec, self.positions.length, self.slots
        d, kv = s.head_dim, s.num_kv_heads
        if k is None:  # queries and keys in one tensor
            q, k = q.split([s.num_heads * d, kv * d], dim=1)
        # Rows (KV, T, d) in the cache's layout: what is written, and the new keys transposed.
        k_rows = k.reshape(kv, d, t).transpose(1, 2)
        v_rows = v.reshape(kv, d, t).transpose(1, 2)
        self.rows = (k_rows, v_rows)
        cache_k, cache_v = self.cache_k, self.cache_v
        if self.write is not None:
            cache_k = self.write.blend(cache_k, k_rows)
            cache_v = self.write.blend(cache_v, v_rows)
            self.held = (cache_k, cache_v)
        queries = q.split(d, dim=1)
        values = v.split(d, dim=1)
        keys = cache_k.reshape(kv, length, 1, d)  # each kv head's (1, S, 1, d) for the scores
        outputs = []
        for h, query in enumerate(queries):
            g = h // s.group_size
            score = torch.einsum("bkhc,bchq->bkhq", keys[g : g + 1], query)
            if self.held is not None:  # the new tokens are in their slots
                outputs.append(_weighted_rows(cache_v[g], attn.weights(score, mask), t))
                continue
            new_k = k_rows[g].reshape(1, t, 1, d)
            score = torch.cat([score, torch.einsum("bkhc,bchq->bkhq", new_k, query)], dim=1)
            w_old, w_new = attn.weights(score, mask).split([length, t], dim=1)
            out = _weighted_rows(cache_v[g], w_old, t)
            outputs.append(out + torch.einsum("bchk,bkhq->bchq", values[g], w_new))
        return outputs


@dataclass(frozen=True)
class SlotWrite:
    """Where a call's tokens are written: ``one_hot`` (1, S, T), column t 1 at token t's slot
    (all 0 for a padding token), and ``keep`` (1, S, 1), 0 at a written slot, 1 elsewhere."""

    one_hot: torch.Tensor
    keep: torch.Tensor

    @classmethod
    def of(cls, write_slots: torch.Tensor) -> SlotWrite:
        """From the host input ``write_slots`` (1, 1, S, T)."""
        one_hot = write_slots[0]
        return cls(one_hot, 1.0 - one_hot.sum(dim=2, keepdim=True))

    def blend(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One layer's cache (KV, S, d) with each token's row (KV, T, d) at its slot, every
        other slot exactly as it was. Up to `ELEMENTWISE_WRITE` tokens one mul and one add per
        token; beyond (a prefill) one (S, T) x (T, d) matmul per kv head: a batched matmul of
        run-time operands would leave the NE (plan rule R-BATCH). The plan rules place both on
        the NE."""
        out = cache * self.keep
        tokens = rows.shape[1]
        if tokens > ELEMENTWISE_WRITE:
            slots = self.one_hot[0]  # (S, T)
            return out + torch.stack([torch.matmul(slots, r) for r in rows.unbind(0)])
        for u in range(tokens):
            out = out + self.one_hot[:, :, u : u + 1] * rows[:, u : u + 1, :]
        return out


def _weighted_rows(rows: torch.Tensor, weight: torch.Tensor, t: int) -> torch.Tensor:
    """``sum_k weight[0, k, 0, q] * rows[k]`` as (1, d, 1, T), from cache rows (S, d): one
    matmul of the weights' transpose with the rows as the cache holds them, so the cache
    itself is never transposed (only the T x S weights are)."""
    length, d = rows.shape
    out = torch.matmul(weight.reshape(length, t).transpose(0, 1), rows)  # (T, d)
    # One token: (1, d) is already the (d, 1) column in memory, so no transpose.
    return (out if t == 1 else out.transpose(0, 1)).reshape(1, d, 1, t)


def cached_functions(
    window: BC1LDecoder,
    style: CacheStyle,
    cache_length: int,
    calls: dict[str, tuple[int, str]],
    layers: tuple[int, int] | None = None,
) -> dict[str, CachedDecoder]:
    """One cached module per function (name -> (T, logits)), all on the window module's layers
    (``layers``: a chunk's [start, stop), every layer by default) and, for the ``state``
    style, one shared cache buffer (as the functions of one package share one state)."""
    modules: dict[str, CachedDecoder] = {}
    shared: torch.Tensor | None = None
    for name, (tokens, logits) in calls.items():
        io = CacheIO(style, cache_length, tokens, logits, window.io.inputs)  # type: ignore[arg-type]
        module = CachedDecoder(window, io, layers).eval()
        if style == "state":
            if shared is None:
                shared = module.kv_cache
            module.kv_cache = shared
        modules[name] = module
    return modules
