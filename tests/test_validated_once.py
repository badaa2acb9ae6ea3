"""coremltools' whole-program validation runs once per conversion, after its pass pipeline
(converter.coreml.fast_paths.validated_once), and still refuses an invalid program."""

from __future__ import annotations

from typing import Any

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.block import InvalidBlockStateError
from coremltools.converters.mil.mil.program import Program

from converter.coreml.fast_paths import validated_once


def _program() -> Any:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x: Any) -> Any:
        return mb.relu(x=mb.transpose(x=x, perm=[1, 0]))

    return prog


def test_each_program_is_checked_once_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[Any] = []
    monkeypatch.setattr(Program, "validate", lambda self, **_: checked.append(self))
    first, second = _program(), _program()
    with validated_once():
        for prog in (first, second, first, first):  # what a pass pipeline does after each pass
            prog.validate()
        assert checked == []
    assert [id(p) for p in checked] == [id(first), id(second)]


def test_an_invalid_program_is_still_refused() -> None:
    prog = _program()
    refused = pytest.raises(InvalidBlockStateError, match="should be consumed by op relu")
    with refused, validated_once():
        prog.validate()  # deferred
        transpose, relu = list(prog.functions["main"].operations)[1:]
        transpose.outputs[0]._child_ops.append(relu)  # a pass that broke a link
    real = Program.validate
    with validated_once():
        pass
    assert Program.validate is real
