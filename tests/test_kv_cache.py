"""The cached BC1L decoder (graph_passes/cached_decoder.py) in torch against transformers.

Prefill then sequential decode (and K-token extends) through the cache must give, at every
position, the logits transformers computes by full recompute in fp32; stale and large
entries beyond the position must change nothing. A layer feature written once, in the block
or its attention, changes the window module and the cached functions alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny, one_torch_thread, random_sequences

from graph_passes.attention import Attention, KeyValues
from graph_passes.cache_host import CallShape
from graph_passes.cached_decoder import cached_functions
from graph_passes.decoder import BC1LDecoder
from graph_passes.masks import MASKED
from graph_passes.model import Block
from parity.kv_session import CacheSession, FunctionShape, rope_rows, torch_runner

ARCHS = ("llama", "qwen3", "gemma3")
CACHE = 32
PREFILL = 8
EXTEND = 4
TOLERANCE = 1e-4  # relative, fp32 against fp32


@pytest.fixture(autouse=True)
def _single_thread():
    yield from one_torch_thread()


def session(tiny, style: str, dtype=torch.float32) -> CacheSession:
    return session_and_modules(tiny, style, dtype)[0]


def session_and_modules(tiny, style: str, dtype=torch.float32):
    calls = {"prefill": (PREFILL, "last"), "decode": (1, "last"), "extend": (EXTEND, "all")}
    modules = cached_functions(tiny.module, style, CACHE, calls)
    first = modules["decode"]
    windows = tuple(first.windows)
    functions = {
        name: FunctionShape(name, CallShape(CACHE, t, windows, style, m.writes_in_place), logits)
        for name, (t, logits) in calls.items()
        for m in [modules[name]]
    }
    table = tiny.embed_table.numpy()
    return CacheSession(
        functions,
        rope_rows(first),
        first.cache_shape(),
        torch_runner(modules, dtype),
        "input_ids" if tiny.module.io.inputs == "token-ids" else "inputs_embeds",
        lambda ids: table[ids],
    ), modules


def reference_logits(tiny, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return tiny.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("style", ["state", "io"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_full_recompute(arch: str, style: str) -> None:
    tiny = build_tiny(arch, "embeddings", batch=1)
    ids = random_sequences(7, (24,))[0]
    ref = reference_logits(tiny, ids)
    s = session(tiny, style)
    prompt = 5  # shorter than the prefill: left padding inside the call
    got = {prompt - 1: s.call("prefill", ids[:prompt])[:, -1]}
    for p in range(prompt, len(ids)):
        got[p] = s.call("decode", [ids[p]])[:, -1]
    for p, logits in got.items():
        assert rel(logits, ref[p]) <= TOLERANCE, f"{arch} {style} position {p}"


@pytest.mark.parametrize("arch", ARCHS)
def test_extend_equals_single_steps_and_reference(arch: str) -> None:
    tiny = build_tiny(arch, "embeddings", batch=1)
    ids = random_sequences(8, (20,))[0]
    ref = reference_logits(tiny, ids)
    s = session(tiny, "state")
    s.call("prefill", ids[:8])
    p = 8
    while p + EXTEND <= len(ids):
        logits = s.call("extend", ids[p : p + EXTEND])
        for u in range(EXTEND):
            assert rel(logits[:, u], ref[p + u]) <= TOLERANCE, f"{arch} position {p + u}"
        p += EXTEND


@pytest.mark.parametrize("style", ["state", "io"])
def test_rejected_drafts_and_large_stale_values_change_nothing(style: str) -> None:
    tiny = build_tiny("llama", "embeddings", batch=1)
    ids = random_sequences(9, (16,))[0]
    ref = reference_logits(tiny, ids)
    s, modules = session_and_modules(tiny, style)
    s.call("prefill", ids[:8])
    # A draft of four wrong tokens, then rejected: the position moves back.
    s.call("extend", [3, 3, 3, 3])
    s.rollback(8)
    # Large finite values in every slot beyond the position (a score from them would
    # overflow fp16; they must contribute exactly nothing).
    large = 3.0e4
    if style == "state":
        modules["decode"].kv_cache[:, :, 8:] = large
    else:
        assert s.cache is not None
        s.cache[:, :, 8:] = large
    for p in range(8, 16):
        logits = s.call("decode", [ids[p]])[:, -1]
        assert rel(logits, ref[p]) <= TOLERANCE, f"{style} position {p}"


class SoftcappedAttention(Attention):
    """A layer feature written once, in `Attention`: attention logit soft-capping (Gemma 2's
    ``c * tanh(score / c)``), here with a cap low enough to change every layer."""

    def weights(self, score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().weights(0.5 * torch.tanh(score / 0.5), mask)


class LayerScaledBlock(Block):
    """A layer feature written once, in `Block`: each layer's update to the stream halved."""

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keys: KeyValues | None = None
    ) -> torch.Tensor:
        return x + 0.5 * (super().forward(x, mask, keys) - x)


def softcap(layer: Block) -> None:
    layer.attention.__class__ = SoftcappedAttention


def layer_scale(layer: Block) -> None:
    layer.__class__ = LayerScaledBlock


def window_logits(module: BC1LDecoder, ids: list[int]) -> np.ndarray:
    """The window module's logits (n, V) at every position of ``ids`` (left-padded to L),
    read from the last stream through the final norm and LM head."""
    pad = module.io.length - len(ids)
    x = module.host_embedding_table()[[0] * pad + ids][None]
    key_mask = torch.zeros(1, module.io.length)
    key_mask[:, :pad] = MASKED
    with torch.no_grad():
        h = module.run_layers(x, key_mask)[-1]
        logits = torch.cat(module.head(h), dim=1)  # (1, V, 1, L)
    return logits[0, :, 0, pad:].T.numpy()


@pytest.mark.parametrize("feature", [softcap, layer_scale])
def test_a_layer_feature_written_once_reaches_the_window_and_the_cache(feature) -> None:
    tiny = build_tiny("gemma3", "embeddings", batch=1)
    ids = random_sequences(10, (12,))[0]
    before = window_logits(tiny.module, ids)
    for layer in tiny.module.decoder_layers():
        feature(layer)
    after = window_logits(tiny.module, ids)
    assert rel(after, before) > 0.05  # the feature changes the function
    s = session(tiny, "state")
    got = {PREFILL - 1: s.call("prefill", ids[:PREFILL])[:, -1]}
    for p in range(PREFILL, len(ids)):
        got[p] = s.call("decode", [ids[p]])[:, -1]
    for p, logits in got.items():
        assert rel(logits, after[p]) <= TOLERANCE, f"position {p}"
