"""Converting a cached decoder's functions, every other one in a child beside this process
(`converter.tasks.kv_convert`), gives the same packages (every file's bytes but the
package manifest's random ids) and the same programs as converting them all here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import build_tiny, one_torch_thread

import converter.pipeline.beside as beside
import converter.tasks.kv_convert as kv_convert
from converter.coreml.targets import TARGETS
from converter.pipeline.hashing import mlpackage_content_files
from converter.tasks.kv_contract import function_calls
from graph_passes.cached_decoder import cached_functions


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    yield from one_torch_thread()


@pytest.mark.skipif(not beside.can_fork(), reason="converts beside on Linux, 2+ cores")
def test_functions_converted_beside_are_the_functions_converted_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = build_tiny("llama", batch=1)
    functions = cached_functions(tiny.module, "state", 32, function_calls(8, 4))
    names = list(functions)
    assert len(names) == 3
    target = TARGETS["macOS15"].ct_target()
    here_calls: list[str] = []
    convert_function = kv_convert.convert_function

    def noted(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        here_calls.append(name)  # a child's call is not seen here
        return convert_function(name, *args, **kwargs)

    monkeypatch.setattr(kv_convert, "convert_function", noted)
    ticks: list[int] = []
    side = kv_convert.convert_singles(functions, "float16", "float16", target, tmp_path / "b",
                                      lambda: ticks.append(1))  # fmt: skip
    groups = kv_convert._groups(functions)
    assert len(groups) > 1 and here_calls == groups[0] and len(ticks) == 3
    here_calls.clear()
    monkeypatch.setattr(kv_convert, "can_fork", lambda: False)
    alone = kv_convert.convert_singles(functions, "float16", "float16", target, tmp_path / "a")
    assert here_calls == names
    assert list(side[0]) == list(alone[0]) == names
    for name in names:
        assert mlpackage_content_files(side[0][name]) == mlpackage_content_files(alone[0][name])
        a, b = side[1][name], alone[1][name]
        assert (a.inputs, a.outputs, a.ops) == (b.inputs, b.outputs, b.ops)
        assert (a.plan_table is None) == (b.plan_table is None)
    decode_side, decode_alone = side[1]["decode"].plan_table, alone[1]["decode"].plan_table
    assert decode_side is not None and decode_side == decode_alone
