"""The fp32 cache level separates the conversion's cache faults from fp16's own drift (SPEC 4,
"Cached decoders"; `parity.kv_fp32`).

One tiny Gemma 3 (two local layers with a window of 4, one global layer) is converted once, as
one state-style package and as a chain of three one-layer packages. Unmutated, every gate of
the fp32 cache level passes far inside its bounds. Each mutant of the host loop - the code a
runtime engine reimplements from the manifest - fails the fp32 level naming the fixture, the
function and its call, the layer and the position where it first went wrong; `FP16_CATCHES`
records which fp16 gate, if any, would have caught it alone (the mutant table of
docs/draft-decoders.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_models import Tiny, build_tiny, one_torch_thread

import converter.pipeline.beside as beside
import converter.tasks.kv_parity as kv_parity
import graph_passes.cache_host as cache_host
import parity.kv_session as kv_session
from converter.coreml.targets import TARGETS
from converter.tasks.kv_contract import function_calls
from converter.tasks.kv_convert import convert_singles
from converter.tasks.kv_parity import CacheBounds, function_gates
from converter.tasks.text_generation_kv import combine_measured
from graph_passes.cached_decoder import CachedDecoder, cached_functions
from parity.gate_registry import GateResult
from parity.kv_gates import KvParity
from parity.mil import Evaluator
from parity.reference import Continuation, continuation, originals

CACHE, PREFILL, EXTEND, STEPS = 32, 8, 4, 12
BOUNDS = CacheBounds("float16", 1e-5, 1e-4, 1e-4, 0.03)
SPLIT = [(0, 1), (1, 2), (2, 3)]


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


class Built:
    """The tiny model, its continuations and both layouts' packages."""

    def __init__(self, root: Path) -> None:
        self.tiny: Tiny = build_tiny("gemma3", "embeddings", batch=1)
        calls = function_calls(PREFILL, EXTEND)
        target = TARGETS["macOS15"].ct_target()
        self.table = self.tiny.embed_table.numpy()
        self.conts: list[Continuation] = [
            continuation(self.tiny.model, f, STEPS) for f in originals(self.tiny.fixtures)[:2]
        ]
        self.layouts: dict[str, tuple[list[Path], list[dict[str, CachedDecoder]], list[Any]]] = {}
        for layout, split in (("one", [(0, 3)]), ("chain", SPLIT)):
            chunks = [cached_functions(self.tiny.module, "state", CACHE, calls, r) for r in split]
            packages, sizes = [], []
            for i, functions in enumerate(chunks):
                folder = root / layout / f"chunk{i}"
                singles, _ = convert_singles(functions, "float16", "float16", target, folder)
                packages.append(folder / "package.mlpackage")
                sizes.append(combine_measured(singles, packages[-1]))
            self.layouts[layout] = (packages, chunks, sizes)

    def gates(self, layout: str = "one") -> tuple[list[GateResult], KvParity]:
        packages, chunks, sizes = self.layouts[layout]
        return function_gates(packages, chunks, self.conts, EXTEND, self.table, sizes, BOUNDS)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("kvfp32"))


def fp32_level(layers: list[GateResult]) -> dict[str, GateResult]:
    return {g.name: g for g in layers if g.level == "kv-cache"}


@pytest.mark.parametrize("layout", ["one", "chain"])
def test_the_unmutated_functions_pass_the_fp32_cache_level_far_inside_it(
    built: Built, layout: str
) -> None:
    layers, kv = built.gates(layout)
    level = fp32_level(layers)
    assert set(level) == {
        "fp32_layer_rel_error", "fp32_logits_rel_error", "kv_fp32_max_abs_logit_error",
        "kv_fp32_extend_max_abs_diff", "kv_fp32_stale_max_abs_diff",
    }  # fmt: skip
    print("\n".join(g.text() for g in layers + kv.gates))
    assert all(g.passed for g in layers + kv.gates), [g.text() for g in layers + kv.gates]
    assert level["fp32_layer_rel_error"].value < 1e-5
    assert level["kv_fp32_max_abs_logit_error"].value < 1e-4
    # every call of every function over both whole continuations
    detail = level["fp32_layer_rel_error"].detail
    assert f"decode {2 * STEPS}" in detail and "extend 6" in detail


# ---- mutants of the host loop ----------------------------------------------------------------


def _patch_inputs(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[Any, int, int, dict[str, Any]], None]
) -> None:
    """Every call's host inputs changed by ``change(shape, position, n, inputs)``."""
    original = cache_host.call_inputs

    def mutated(shape, position, n, rope):  # type: ignore[no-untyped-def]
        out = original(shape, position, n, rope)
        change(shape, position, n, out)
        return out

    monkeypatch.setattr(kv_session, "call_inputs", mutated)


def decode_writes_one_slot_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def change(shape: Any, position: int, n: int, out: dict[str, Any]) -> None:
        if shape.tokens == 1:
            out["write_slots"] = np.roll(out["write_slots"], 1, axis=2)

    _patch_inputs(monkeypatch, change)


def stale_row_not_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    original = cache_host.attention_mask

    def leaky(pos, position, cache, window, in_place=False):  # type: ignore[no-untyped-def]
        mask = original(pos, position, cache, window, in_place)
        stale = int(pos.max()) + 1  # the first slot past the call's tokens: stale or empty
        if stale < cache:
            mask[0, stale, 0, pos >= 0] = 0.0
        return mask

    monkeypatch.setattr(cache_host, "attention_mask", leaky)


def local_layers_given_the_global_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    def change(shape: Any, position: int, n: int, out: dict[str, Any]) -> None:
        for w in shape.windows:
            out[f"mask_window_{w}"] = out["mask"].copy()

    _patch_inputs(monkeypatch, change)


def extend_rope_one_position_off(monkeypatch: pytest.MonkeyPatch) -> None:
    original = cache_host.call_inputs

    def shifted(shape, position, n, rope):  # type: ignore[no-untyped-def]
        if shape.tokens != EXTEND:
            return original(shape, position, n, rope)
        ahead = [(np.roll(c, -1, axis=1), np.roll(s, -1, axis=1)) for c, s in rope]
        return original(shape, position, n, ahead)

    monkeypatch.setattr(kv_session, "call_inputs", shifted)


def chunk_handed_its_own_input(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(fed, returned):  # type: ignore[no-untyped-def]
        # a chunk after the first hands on what it read: the next chunk skips its layer
        return fed.get("hidden_in", returned["hidden_out"])

    monkeypatch.setattr(kv_session, "handoff", wrong)


Patch = Callable[[pytest.MonkeyPatch], None]
# mutant -> (its patch, the layout, the call and layer the fp32 level must name first, the fp16
# gates that fail too on this tiny model: what each would have caught alone)
MUTANTS: dict[str, tuple[Patch, str, str, set[str]]] = {
    "decode writes its key one slot off":
        (decode_writes_one_slot_off, "one", "decode call 0, layer 0",
         {"kv_max_abs_dprob", "kv_argmax_flips", "kv_extend_argmax_flips"}),
    "a stale row not masked":
        (stale_row_not_masked, "one", "prefill call 0, layer 0",
         {"kv_max_abs_dprob", "kv_argmax_flips"}),
    "local layers given the global mask":
        (local_layers_given_the_global_mask, "one", "prefill call 0, layer 0",
         {"kv_max_abs_dprob", "kv_argmax_flips"}),
    "extend's RoPE one position off":
        (extend_rope_one_position_off, "one", "extend call 0, layer 0", set()),
    "a chunk hands on its own input":
        (chunk_handed_its_own_input, "chain", "prefill call 0, layer 2",
         {"kv_max_abs_dprob", "kv_argmax_flips"}),
}  # fmt: skip


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_the_fp32_cache_level_naming_function_layer_and_position(
    built: Built, monkeypatch: pytest.MonkeyPatch, mutant: str
) -> None:
    patch, layout, first, fp16 = MUTANTS[mutant]
    patch(monkeypatch)
    layers, kv = built.gates(layout)
    level = fp32_level(layers)
    failed = {name: g for name, g in level.items() if not g.passed}
    assert "fp32_layer_rel_error" in failed, [g.text() for g in level.values()]
    where = failed["fp32_layer_rel_error"].where
    assert f"first over at token_ids[0] {first}, position " in where, where
    # the fp16 gates alone catch some of them, on this model, by how far its logits move
    assert {g.name for g in kv.gates if not g.passed} == fp16


class OneAfterOther(kv_parity.Lockstep):
    """The continuations one after the other, each call run alone: the path the lockstep
    must not change."""

    def run(self, bodies):  # type: ignore[no-untyped-def]
        return [body() for body in bodies]


def _everything(layers: list[GateResult], kv: KvParity) -> Any:
    return ([g.to_json() for g in layers + kv.gates], kv.flips, kv.rows,
            kv.drift.to_json() if kv.drift else None)  # fmt: skip


@pytest.mark.parametrize("layout", ["one", "chain"])
@pytest.mark.parametrize("mutant", [None, "decode writes its key one slot off"])
def test_the_continuations_side_by_side_find_what_they_find_one_after_the_other(
    built: Built, monkeypatch: pytest.MonkeyPatch, layout: str, mutant: str | None
) -> None:
    if mutant is not None:  # failing gates too: each names where it first went over
        MUTANTS[mutant][0](monkeypatch)
    monkeypatch.setattr(beside, "can_fork", lambda: False)  # every call counted here
    groups: list[int] = []
    run_many = Evaluator.run_many

    def counted(self, feeds, *args, **kwargs):  # type: ignore[no-untyped-def]
        groups.append(len(feeds))
        return run_many(self, feeds, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "run_many", counted)
    side_by_side = _everything(*built.gates(layout))
    assert max(groups) == len(built.conts)  # the continuations' calls ran together
    groups.clear()
    monkeypatch.setattr(kv_parity, "Lockstep", OneAfterOther)
    alone = _everything(*built.gates(layout))
    assert max(groups) == 1
    assert side_by_side == alone


@pytest.mark.skipif(not beside.can_fork(), reason="the fp32 levels run beside on Linux, 2+ cores")
@pytest.mark.parametrize("layout", ["one", "chain"])
@pytest.mark.parametrize("mutant", [None, "decode writes its key one slot off"])
def test_the_fp32_levels_in_a_child_find_what_they_find_here(
    built: Built, monkeypatch: pytest.MonkeyPatch, layout: str, mutant: str | None
) -> None:
    if mutant is not None:  # the child runs the patched host loop too
        MUTANTS[mutant][0](monkeypatch)
    ran_in: list[int] = []
    level = kv_parity.cache_fp32_level

    def noted(*args, **kwargs):  # type: ignore[no-untyped-def]
        ran_in.append(os.getpid())
        return level(*args, **kwargs)

    monkeypatch.setattr(kv_parity, "cache_fp32_level", noted)
    beside_ = _everything(*built.gates(layout))
    assert ran_in == []  # the child's call is not seen here: it ran in the child
    # no room in the memory budget for what the child adds: the levels run here
    monkeypatch.setattr(kv_parity, "children_with_room", lambda each, count: 0)
    here = _everything(*built.gates(layout))
    assert ran_in == [os.getpid()]
    assert beside_ == here
    if mutant is not None:
        assert any(not g["passed"] for g in beside_[0]), beside_[0]
