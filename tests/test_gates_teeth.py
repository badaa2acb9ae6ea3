"""The parity gates have teeth: each deliberately wrong BC1L variant fails `check_decoder`, and
the report names the layer where the error enters (SPEC section 4).

Wrong variants are made here, by monkeypatching or by altering the canonical model; production
code is untouched. References always come from the unpatched transformers model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from tiny_models import Tiny, build_tiny, one_torch_thread

import graph_passes.attention as attention_module
from graph_passes.rope import Rope
from graph_passes.spec import CanonicalModel, LayerSpec, NormSpec, TransformerSpec
from parity.decoder_gates import check_decoder
from parity.result import ParityReport

PER_LAYER = "fp32_layer_rel_error"
ARGMAX = "fp16_argmax_agreement"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


_CACHE: dict[str, Tiny] = {}


def tiny(arch: str) -> Tiny:
    if arch not in _CACHE:
        _CACHE[arch] = build_tiny(arch)
    return _CACHE[arch]


def check(t: Tiny, module: torch.nn.Module | None = None) -> ParityReport:
    return check_decoder(module or t.module, t.batches, t.references, t.embed_table, t.thresholds)


def gate(report: ParityReport, name: str) -> bool:
    (g,) = [g for g in report.gates if g.name == name]
    return g.passed


def failed(report: ParityReport) -> list[str]:
    return [g.name for g in report.gates if not g.passed]


def with_norm_eps(
    spec: TransformerSpec, factor: float, layers: set[int] | None = None
) -> TransformerSpec:
    """The spec with every norm epsilon (or only those of ``layers``) multiplied by ``factor``."""

    def scale(norm: NormSpec) -> NormSpec:
        return dataclasses.replace(norm, eps=norm.eps * factor)

    def layer(i: int, ls: LayerSpec) -> LayerSpec:
        if layers is not None and i not in layers:
            return ls
        return dataclasses.replace(
            ls, attention_norm=scale(ls.input_norm), mlp_norm=scale(ls.post_attention_norm)
        )

    return dataclasses.replace(
        spec,
        layers=tuple(layer(i, ls) for i, ls in enumerate(spec.layers)),
        final_norm=scale(spec.final_norm) if layers is None else spec.final_norm,
    )


# ---- 5. the control --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_correct_module_passes_every_gate(arch: str) -> None:
    t = tiny(arch)
    report = check(t)
    assert report.passed, failed(report)
    assert all(g.passed for g in report.gates)
    assert {g.name for g in report.gates} >= {PER_LAYER, "fp32_logits_rel_error", ARGMAX}
    assert report.first_diverging_layer is None
    assert len(report.layers) == 3
    assert all(row.fp32_rel_error <= 1e-5 for row in report.layers)
    # torch's fp16 bits depend on its CPU kernels: the report names the set that ran
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"({capability} kernels)" in report.implementations["torch-fp16"]
    assert len(report.fixtures) == len(t.fixtures)
    # Both slices were checked.
    assert {row.slice for row in report.fixtures} == {"padded", "full-window"}


# ---- 1. softmax over the query axis ----------------------------------------------------------


class _TorchWithWrongSoftmax(SimpleNamespace):
    """Stands in for ``torch`` inside graph_passes.attention: softmax on axis 3 instead of 1."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def softmax(x: torch.Tensor, dim: int, **kwargs: object) -> torch.Tensor:
        assert dim == 1, "the production softmax is expected on the key axis (1)"
        return torch.softmax(x, dim=3, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_softmax_over_the_query_axis_fails_at_layer_0(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tiny(arch)
    monkeypatch.setattr(attention_module, "torch", _TorchWithWrongSoftmax())
    report = check(t)
    assert not report.passed
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0
    assert report.layers[0].fp32_rel_error > 1e-2


# ---- 2. RoPE halves split across all heads ---------------------------------------------------


def _rope_across_all_heads(
    self: Rope, x: torch.Tensor, num_heads: int, at: object = None
) -> torch.Tensor:
    """WRONG: rotate_half over all heads concatenated (first half of all channels with the
    second half), with each head's cos/sin tables tiled across the heads. Window calls only
    (``at`` is None: the module's own tables)."""
    assert at is None, "this mutant covers the window path"
    d, length = self.head_dim, self.length
    half_cos = self.cos[:, :, d // 2 :, :]
    half_sin = self.sin[:, :, d // 2 :, :]  # the unsigned sin (the table folds -sin into half 1)
    cos = torch.cat([half_cos, half_cos], dim=2).repeat(1, num_heads, 1, 1)
    sin = torch.cat([half_sin, half_sin], dim=2).repeat(1, num_heads, 1, 1)
    cos = cos.reshape(1, num_heads * d, 1, length)
    sin = sin.reshape(1, num_heads * d, 1, length)
    first, second = x.split(num_heads * d // 2, dim=1)
    rotated = torch.cat([-second, first], dim=1)
    return x * cos + rotated * sin


def test_wrong_rope_reproduces_the_right_one_for_a_single_head() -> None:
    # Guards the wrong variant: with one head it must equal the real Rope, so what the gates
    # catch below is only the split across heads.
    torch.manual_seed(0)
    rope = Rope(16, 10000.0, torch.arange(8))
    x = torch.randn(2, 16, 1, 8)
    torch.testing.assert_close(_rope_across_all_heads(rope, x, 1), rope(x, 1))
    x4 = torch.randn(2, 64, 1, 8)
    assert (_rope_across_all_heads(rope, x4, 4) - rope(x4, 4)).abs().max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_split_across_all_heads_fails_at_layer_0(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tiny(arch)
    monkeypatch.setattr(Rope, "forward", _rope_across_all_heads)
    report = check(t)
    assert not report.passed
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0


# ---- 3. RMSNorm epsilon changed --------------------------------------------------------------


@pytest.mark.parametrize(("arch", "factor"), [("llama", 100.0), ("qwen2", 100.0), ("llama", 10.0)])
def test_changed_norm_epsilon_fails_the_per_layer_gate(arch: str, factor: float) -> None:
    t = tiny(arch)
    spec = with_norm_eps(t.canonical.spec, factor)
    module = t.rebuild(CanonicalModel(spec, t.canonical.weights))
    assert module.layers[0].input_norm.eps == pytest.approx(
        t.canonical.spec.layers[0].input_norm.eps * factor
    )
    report = check(t, module)
    assert not report.passed
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0
    argmax_survived = gate(report, ARGMAX)
    print(
        f"{arch} eps x{factor:g}: failed gates {failed(report)}; argmax survived: {argmax_survived}"
    )


@pytest.mark.parametrize(("arch", "factor"), [("qwen2", 100.0), ("llama", 10.0)])
def test_changed_epsilon_is_caught_even_where_the_argmax_survives(arch: str, factor: float) -> None:
    # SPEC 4: the per-layer fp32 gate finds a wrong epsilon at its layer even when every
    # fp16 output gate (argmax, |dp|, finite, deterministic) passes.
    t = tiny(arch)
    module = t.rebuild(CanonicalModel(with_norm_eps(t.canonical.spec, factor), t.canonical.weights))
    report = check(t, module)
    fp16_gates = [g for g in report.gates if g.implementation == "torch-fp16"]
    assert fp16_gates and all(g.passed for g in fp16_gates)
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0


def test_changed_epsilon_set_on_the_built_module_is_caught() -> None:
    # The same error made on the module's buffers instead of the spec.
    t = tiny("llama")
    module = t.rebuild()
    norm = module.layers[0].input_norm
    norm.eps *= 100.0
    norm.set_prescale(norm.prescale)  # recomputes scaled_eps from eps
    report = check(t, module)
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0


@pytest.mark.parametrize("layer", [1, 2])
def test_first_diverging_layer_is_where_the_error_enters(layer: int) -> None:
    t = tiny("llama")
    spec = with_norm_eps(t.canonical.spec, 100.0, layers={layer})
    report = check(t, t.rebuild(CanonicalModel(spec, t.canonical.weights)))
    assert not report.passed
    assert report.first_diverging_layer == layer
    for row in report.layers[:layer]:
        assert row.fp32_rel_error <= t.thresholds.fp32_layer_rel_error


# ---- 4. dropped q/k/v bias on Qwen2 ----------------------------------------------------------


def test_dropped_qkv_bias_fails_at_layer_0() -> None:
    t = tiny("qwen2")
    spec = t.canonical.spec
    assert spec.layers[0].attention.qkv_bias
    weights = {
        k: v
        for k, v in t.canonical.weights.items()
        if not (k.endswith(".bias") and ".attn." in k and k.split(".")[-2] in ("q", "k", "v"))
    }
    assert len(weights) == len(t.canonical.weights) - 3 * spec.num_layers
    no_bias = dataclasses.replace(
        spec,
        layers=tuple(
            dataclasses.replace(ls, attention=dataclasses.replace(ls.attention, qkv_bias=False))
            for ls in spec.layers
        ),
    )
    module = t.rebuild(CanonicalModel(no_bias, weights))
    assert module.layers[0].attention.qkv.bias is None
    report = check(t, module)
    assert not report.passed
    assert not gate(report, PER_LAYER)
    assert report.first_diverging_layer == 0


def test_dropped_bias_is_visible_only_because_the_model_is_perturbed() -> None:
    # Guards the witness: transformers initialises these biases to 0; tiny_models perturbs them.
    t = tiny("qwen2")
    bias = t.model.model.layers[0].self_attn.q_proj.bias
    assert bias.abs().min() > 0
    norm = t.model.model.layers[0].input_layernorm.weight
    assert (norm - 1).abs().max() > 0.1
