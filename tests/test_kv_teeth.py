"""The cache gates have teeth: each mutant fails a named gate at a named step (fixture and
position), and the unmutated loop passes them all. Run through the torch modules (fp32) so
no conversion is needed: the fp16 gates (`check_kv`) and the fp32 cache level's logit gates
(`cached_fp32_level`, against the window module in fp64 with no cache), as they gate the
emitted program in the pipeline (tests/test_kv_fp32_level.py runs them on programs)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from tiny_models import Tiny, build_tiny, one_torch_thread

import graph_passes.cache_host as cache_host
import graph_passes.cached_decoder as cached_decoder
from converter.tasks.kv_contract import function_calls
from graph_passes.cached_decoder import cached_functions
from parity.gate_registry import GateResult
from parity.kv_fp32 import cached_fp32_level, reference
from parity.kv_gates import check_kv
from parity.kv_session import CacheSession, session_for, torch_runner
from parity.reference import continuation


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return build_tiny("llama", "embeddings", batch=1)


def run_gates(tiny: Tiny, style: str = "state", prefill: int = 8) -> list[GateResult]:
    calls = function_calls(prefill, 4)
    functions = cached_functions(tiny.module, style, 64, calls)  # type: ignore[arg-type]
    table = tiny.embed_table.numpy()
    conts = [continuation(tiny.model, f, 24) for f in tiny.fixtures[:2]]

    def make_session() -> CacheSession:
        for m in functions.values():
            m.reset_cache()
        states = {"kv_cache": functions["decode"].kv_cache} if style == "state" else None
        session = session_for(functions, torch_runner(functions, torch.float32), None,
                              lambda ids: table[ids])  # fmt: skip
        if states is not None:
            session.states = {k: v.numpy() for k, v in states.items()}  # a view: poison writes
        return session

    fp32 = cached_fp32_level(
        make_session, [], conts, lambda c: reference(functions, c, table, "float32", None), 4,
        (1e-4, 1e-4),
    )  # fmt: skip
    return fp32 + check_kv(make_session, conts, "prefill", 4, "torch-fp32", 0.03).gates


def failed(gates: list[GateResult]) -> dict[str, str]:
    return {g.name: g.where for g in gates if not g.passed}


@pytest.mark.parametrize("style", ["state", "io"])
def test_the_unmutated_loop_passes_every_cache_gate(tiny: Tiny, style: str) -> None:
    gates = run_gates(tiny, style)
    assert all(g.passed for g in gates), [g.text() for g in gates if not g.passed]
    logits = next(g for g in gates if g.name == "kv_fp32_max_abs_logit_error")
    assert logits.value < 1e-4  # fp32 against fp64


def test_an_off_by_one_write_position_fails(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    original = cache_host.call_inputs

    def off_by_one(shape, position, n, rope):  # type: ignore[no-untyped-def]
        out = original(shape, position, n, rope)
        if "write_slots" in out:
            out["write_slots"] = np.roll(out["write_slots"], 1, axis=2)  # slot + 1
        return out

    monkeypatch.setattr("parity.kv_session.call_inputs", off_by_one)
    bad = failed(run_gates(tiny))
    assert "kv_fp32_max_abs_logit_error" in bad and "position" in bad["kv_fp32_max_abs_logit_error"]


@pytest.mark.parametrize("prefill", [8, 16])  # written elementwise, or by matmul
def test_a_cache_update_on_the_wrong_axis_fails(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch, prefill: int
) -> None:
    # Every layer's rows land on the kv-head axis's mirror: head g's rows go to head KV-1-g.
    blend = cached_decoder.SlotWrite.blend

    def wrong_blend(self, cache, rows):  # type: ignore[no-untyped-def]
        return blend(self, cache, rows.flip(0))

    monkeypatch.setattr(cached_decoder.SlotWrite, "blend", wrong_blend)
    bad = failed(run_gates(tiny, prefill=prefill))
    assert "kv_fp32_max_abs_logit_error" in bad and "position" in bad["kv_fp32_max_abs_logit_error"]


def test_a_mask_that_lets_a_future_slot_through_fails(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = cache_host.attention_mask

    def leaky(pos, position, cache, window, in_place=False):  # type: ignore[no-untyped-def]
        mask = original(pos, position, cache, window, in_place)
        t = len(pos)
        for u in range(t - 1):  # query u also sees the new token u + 1
            if pos[u] >= 0:
                mask[0, pos[u] + 1 if in_place else cache + u + 1, 0, u] = 0.0
        return mask

    monkeypatch.setattr(cache_host, "attention_mask", leaky)
    bad = failed(run_gates(tiny))
    assert "kv_fp32_max_abs_logit_error" in bad
    assert "position" in bad["kv_fp32_max_abs_logit_error"]


def test_stale_values_that_leak_fail(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    original = cache_host.call_inputs

    def all_valid(shape, position, n, rope):  # type: ignore[no-untyped-def]
        out = original(shape, position, n, rope)
        out["cache_valid"] = np.ones_like(out["cache_valid"])  # stale slots not zeroed
        return out

    monkeypatch.setattr("parity.kv_session.call_inputs", all_valid)
    bad = failed(run_gates(tiny))
    assert "kv_stale_max_abs_diff" in bad
