"""A chunked cached decoder run as one chain (`parity.kv_session`), in torch (fp32): the same
logits as the unchunked functions at every position, every cache gate passing through the
chain, and mutants of the chain (a chunk fed its predecessor's input instead of its output,
chunks called out of order) failing a named gate at a named position."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from tiny_models import Tiny, build_tiny, one_torch_thread, random_sequences

import parity.kv_session as kv_session
from converter.tasks.kv_chunks import chunk_meta
from converter.tasks.kv_contract import function_calls
from graph_passes.cached_decoder import CachedDecoder, cached_functions
from parity.gate_registry import GateResult
from parity.kv_fp32 import cached_fp32_level, reference
from parity.kv_gates import check_kv
from parity.kv_session import CacheSession, session_for, torch_runner
from parity.reference import continuation

CACHE = 64
SPLIT = [(0, 1), (1, 2), (2, 3)]


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return build_tiny("llama", "embeddings", batch=1)


def chained(tiny: Tiny, style: str, split: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
    """A session maker over the chunks ``split`` run by their torch modules."""
    calls = function_calls(8, 4)
    chunks = [
        cached_functions(tiny.module, style, CACHE, calls, layers)  # type: ignore[arg-type]
        for layers in split
    ]
    table = tiny.embed_table.numpy()

    def make() -> CacheSession:
        runners = []
        for functions in chunks:
            for m in functions.values():
                m.reset_cache()
            runners.append(torch_runner(functions, torch.float32))
        metas = [chunk_meta(c["decode"]) for c in chunks]
        session = session_for(
            chunks[0], kv_session.chain_runner(metas, runners), None, lambda ids: table[ids]
        )
        if style == "state":  # numpy views of the buffers: poison writes into them
            session.states = {f"c{i}": c["decode"].kv_cache.numpy() for i, c in enumerate(chunks)}
        return session

    return make


def gates(tiny: Tiny, style: str, split: list[tuple[int, int]] = SPLIT) -> list[GateResult]:
    """The fp32 cache level's logit gates (no layer captures in torch) and the fp16 gates."""
    conts = [continuation(tiny.model, f, 24) for f in tiny.fixtures[:2]]
    make, table = chained(tiny, style, split), tiny.embed_table.numpy()
    whole = cached_functions(tiny.module, style, CACHE, function_calls(8, 4))  # type: ignore[arg-type]
    fp32 = cached_fp32_level(
        make, [], conts, lambda c: reference(whole, c, table, "float32", None), 4, (1e-4, 1e-4)
    )
    return fp32 + check_kv(make, conts, "prefill", 4, "torch-fp32", 0.03).gates


@pytest.mark.parametrize("style", ["state", "io"])
def test_every_cache_gate_passes_through_the_chain(tiny: Tiny, style: str) -> None:
    result = gates(tiny, style)
    assert all(g.passed for g in result), [g.text() for g in result if not g.passed]
    logits = next(g for g in result if g.name == "kv_fp32_max_abs_logit_error")
    assert logits.value < 1e-4  # fp32 against fp64


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_chain_computes_what_one_package_computes(arch: str) -> None:
    # Gemma 3's chunks read different host inputs (local layers 0-1, a global layer 2).
    t = build_tiny(arch, "embeddings", batch=1)
    ids = random_sequences(5, (20,))[0]
    outs = []
    for split in ([(0, 3)], [(0, 2), (2, 3)]):
        s = chained(t, "io", split)()
        got = [s.call("prefill", ids[:8])[:, -1]]
        got += [s.call("decode", [i])[:, -1] for i in ids[8:14]]
        got += list(s.call("extend", ids[14:18]).T)
        outs.append(np.stack(got))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-4)


def test_a_chunk_fed_its_predecessors_input_fails_naming_the_position(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrong(fed, returned):  # type: ignore[no-untyped-def]
        # chunk 2 reads what chunk 1 read (chunk 0's output): chunk 1's layer is skipped
        return fed.get("hidden_in", returned["hidden_out"])

    monkeypatch.setattr(kv_session, "handoff", wrong)
    bad = {g.name: g.where for g in gates(tiny, "state") if not g.passed}
    assert "kv_fp32_max_abs_logit_error" in bad
    assert "position" in bad["kv_fp32_max_abs_logit_error"]


def test_chunks_called_out_of_order_fail_naming_the_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    four = build_tiny("llama", "embeddings", batch=1, num_hidden_layers=4)
    original = kv_session.chain_runner

    def swapped(chunks, runners):  # type: ignore[no-untyped-def]
        # layers 2 then 1: the two middle chunks' packages called in the wrong order
        return original(chunks, [runners[0], runners[2], runners[1], runners[3]])

    monkeypatch.setattr(kv_session, "chain_runner", swapped)
    result = gates(four, "io", [(0, 1), (1, 2), (2, 3), (3, 4)])
    bad = {g.name: g.where for g in result if not g.passed}
    assert "kv_fp32_max_abs_logit_error" in bad
    assert "position" in bad["kv_fp32_max_abs_logit_error"]


def test_a_chain_must_cover_every_layer_in_order(tiny: Tiny) -> None:
    calls = function_calls(8, 4)
    parts = [cached_functions(tiny.module, "io", CACHE, calls, r) for r in [(0, 1), (2, 3)]]
    metas = [chunk_meta(p["decode"]) for p in parts]
    with pytest.raises(ValueError, match=r"\[0, 1\) and \[2, 3\) do not meet"):
        kv_session.chain_runner(metas, [torch_runner(p, torch.float32) for p in parts])
    with pytest.raises(ValueError, match="layers"):
        CachedDecoder(tiny.module, parts[0]["decode"].io, (2, 2))
