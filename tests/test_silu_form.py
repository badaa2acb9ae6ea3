"""Recipe silu_form: mul-sigmoid: the saved program spells SiLU as x * sigmoid(x), no silu op
(issue: the NE's silu is reported inexact near 0), with every gate passing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_module, convert_tiny_llama, tiny_hf_model

from converter.coreml.program import TensorIO, live_ops, to_mlprogram, trace
from converter.errors import InputError
from graph_passes.archs import adapt
from graph_passes.mlp import ACTIVATIONS, spelled_mul_sigmoid


class _Act(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[name]  # type: ignore[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


def _ops(name: str) -> dict[str, int]:
    import coremltools as ct

    io = [TensorIO("x", (1, 8, 1, 4), "float16", "x")]
    out = [TensorIO("y", (1, 8, 1, 4), "float16", "y")]
    mlmodel = to_mlprogram(trace(_Act(name), io), io, out, ct.target.macOS14, "float16")
    return dict(live_ops(mlmodel))


def test_the_conversion_keeps_each_spelling() -> None:
    """coremltools' backend would fold mul(x, sigmoid(x)) into silu: the conversion keeps it."""
    assert _ops("silu").get("silu") == 1
    spelled = _ops("silu_mul_sigmoid")
    assert "silu" not in spelled and spelled.get("sigmoid") == 1 and spelled.get("mul") == 1


def test_the_spelling_is_the_same_function_on_the_module() -> None:
    model = tiny_hf_model("llama")
    canonical = adapt(model.config, model.state_dict())
    spelled = spelled_mul_sigmoid(canonical)
    assert {layer.mlp.act for layer in spelled.spec.layers} == {"silu_mul_sigmoid"}
    assert {layer.mlp.act for layer in canonical.spec.layers} == {"silu"}  # not mutated
    ids = torch.randint(0, 300, (3, 16))
    a, b = build_module(canonical, length=16), build_module(spelled, length=16)
    mask = torch.zeros(3, 16)
    with torch.no_grad():
        ya, yb = a(ids, mask), b(ids, mask)
    for x, y in zip(ya, yb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_a_model_without_silu_is_refused_naming_the_key() -> None:
    model = tiny_hf_model("gemma3")
    canonical = adapt(model.config, model.state_dict())
    with pytest.raises(InputError, match=r"silu_form: mul-sigmoid: .*gelu_tanh.*remove silu_form"):
        spelled_mul_sigmoid(canonical)


def test_a_tiny_llama_converts_with_no_silu_op_and_records_the_spelling(tmp_path: Path) -> None:
    from parity.mil import load_package

    result, out = convert_tiny_llama(tmp_path, "silu_form: mul-sigmoid\n")
    assert result.exit_code == 0, result.output + result.stderr
    artifact = out / "tiny"
    manifest = json.loads((artifact / "manifest.json").read_text())
    program = load_package(artifact / manifest["package"]["file"])
    types = {op.op_type for f in program.functions.values() for op in f.operations}
    assert "silu" not in types and "sigmoid" in types
    assert manifest["package"]["live_ops"].get("sigmoid") == 3  # one per layer
    (spelling,) = [d for d in manifest["deviations"] if d["original"] == "silu"]
    assert spelling["effective"] == "mul(x, sigmoid(x))" and "3 of 3 layers" in spelling["where"]
    assert manifest["recipe"]["silu_form"] == "mul-sigmoid"
    parity = json.loads((artifact / "parity.json").read_text())
    assert parity["passed"] is True
