"""bench/device_margin.py: each deviation alone and all together, only those whose op the
program holds, and its table lists a position that flips under some set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parity.device_margin import DeviceMargin, MarginRow
from parity.mil.deviations import DEVIATIONS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from device_margin import deviation_sets, print_tables  # noqa: E402


def test_each_deviation_alone_then_all_and_none_without_their_op() -> None:
    sets = deviation_sets({"silu"})
    assert [label for label, _ in sets] == [d.name for d in DEVIATIONS] + ["all together"]
    assert [len(p.deviations) for _, p in sets] == [1] * len(DEVIATIONS) + [len(DEVIATIONS)]
    assert deviation_sets({"gelu"}) == []  # no silu in the program: nothing to run


def test_the_table_lists_a_flip_under_any_set(capsys: pytest.CaptureFixture[str]) -> None:
    def found(kept: bool, seed: int) -> DeviceMargin:
        row = MarginRow("prompt[1]", 12, 0.2, kept, seed, 0.3, 0.01, 0.2)
        return DeviceMargin((0, 1, 2), DEVIATIONS, [row], ["op"], {"silu": 30})

    print_tables({"a": found(True, 0), "b": found(False, 2), "all together": found(True, 1)},
                 {"silu": 30})  # fmt: skip
    out = capsys.readouterr().out
    assert "prompt[1]@12" in out and "flips (seed 2)" in out
    assert "0/1" in out and "1/1" in out
    print_tables({}, {"silu": 0})
    assert "no deviation applies" in capsys.readouterr().out
