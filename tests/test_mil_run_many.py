"""`Evaluator.run_many`: several inputs op by op, each with its own `run`'s bits, and
`run_many_capturing_logits`' groups."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mil_ops import program, rand

import parity.head_outputs as head_outputs
from parity.mil import Evaluator


def _build(x: Any) -> Any:
    from coremltools.converters.mil import Builder as mb

    weight = (rand(40, 24, seed=5) * 0.1).astype(np.float16)  # a packed fp16 constant
    h = mb.cast(x=x, dtype="fp16")
    y = mb.matmul(x=h, y=weight, name="product")
    return mb.reduce_sum(x=mb.mul(x=y, y=y), axes=[-1], keep_dims=False, name="out")


@pytest.mark.parametrize("profile", ["fp32", "fp16", "fp16-acc"])
def test_run_many_gives_each_input_its_own_runs_bits(profile: str) -> None:
    feeds = [{"x": rand(3, 40, seed=s, scale=10.0 ** (s - 3))} for s in range(6)]
    prog = program(_build, feeds[0]["x"])
    evaluator = Evaluator(prog, profile)
    alone = [evaluator.run(feed, capture=["product"]) for feed in feeds]
    together = evaluator.run_many(feeds, capture=["product"])
    for one, many in zip(alone, together, strict=True):
        for got, want in [(many.outputs, one.outputs), (many.captured, one.captured)]:
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == want[name].dtype
                np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))
        assert many.non_finite == one.non_finite


def test_results_are_grouped_under_the_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    feeds = [{"x": rand(3, 40, seed=s)} for s in range(5)]
    evaluator = Evaluator(program(_build, feeds[0]["x"]), "fp16")
    per_input = evaluator.result_bytes(["product"])
    assert per_input == 4 * (3 + 3 * 24)  # out (3,) and product (3, 24), fp32
    calls: list[int] = []
    run_many = evaluator.run_many

    def counted(batch: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(batch))
        return run_many(batch, *args, **kwargs)

    monkeypatch.setattr(evaluator, "run_many", counted)
    monkeypatch.setattr(head_outputs, "RESULTS_BYTES", 2 * per_input)
    grouped = head_outputs.run_many_capturing_logits(evaluator, feeds, ["product"])
    assert calls == [2, 2, 1]
    for feed, result in zip(feeds, grouped, strict=True):
        want = evaluator.run(feed, capture=["product"])
        np.testing.assert_array_equal(result.outputs["out"], want.outputs["out"])
