"""The architecture registry and the generic checks every decoder architecture gets.

Every row of `tiny_models.DECODERS` is checked against transformers' own ``*ForCausalLM``
(randomly initialised, then every parameter perturbed: SPEC section 4): every tensor mapped,
every layer's state and the logits within 1e-5 with left padding, for token-id and embedding
inputs, fp16 padded rows finite, and unmapped or missing tensors refused by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from tiny_models import (
    DECODERS,
    LENGTH,
    Tiny,
    assert_matches,
    build_tiny,
    one_torch_thread,
    run_anec,
    tiny_hf_model,
)

from converter.errors import InputError
from graph_passes.archs import (
    ADAPTERS,
    ENCODER_ADAPTERS,
    HEAD_ADAPTERS,
    REGISTRY,
    adapt,
    architectures,
    find,
)
from graph_passes.archs.table import Row, Skip, map_weights
from graph_passes.archs.weights import WeightReader
from parity.decoder_gates import module_inputs


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


# ---- the registry ---------------------------------------------------------------------------


def test_every_architecture_is_registered_by_model_type_and_class() -> None:
    names = [a.name for a in architectures()]
    assert len(names) == len(set(names))
    for arch in architectures():
        for model_type in arch.model_types:
            assert REGISTRY[model_type] is arch
        for cls in arch.classes:
            assert find(SimpleNamespace(model_type="unknown", architectures=[cls])) is arch
        assert arch.tasks and arch.refuses
        table = {"decoder": ADAPTERS, "encoder": ENCODER_ADAPTERS, "head": HEAD_ADAPTERS}[
            arch.family
        ]
        assert all(table[t] is arch.adapt for t in arch.model_types)
    assert set(DECODERS) <= {a.name for a in architectures() if a.family == "decoder"}


def test_anec_archs_lists_architectures_tasks_and_refusals() -> None:
    result = run_anec("archs", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {a.name for a in architectures()}
    assert rows["llama"]["tasks"] == ["text-generation"]
    assert "text-classification" in rows["bert"]["tasks"]
    assert any("sliding" in r for r in rows["qwen2"]["refuses"])
    table = run_anec("archs")
    assert table.exit_code == 0 and "modernbert" in table.stdout


def test_an_encoder_model_type_is_not_a_decoder() -> None:
    with pytest.raises(InputError, match=r"config\.model_type: architecture 'bert'"):
        adapt(SimpleNamespace(model_type="bert"), {})


# ---- the weight-mapping table ----------------------------------------------------------------


def test_table_maps_splits_and_skips_and_refuses_the_rest() -> None:
    table = (
        Row("embed", "{p}tok", ("V", "D")),
        Row(("layers.{i}.a", "layers.{i}.b"), "{p}l.{i}.ab", ("2D", "D"), bias="ab_bias"),
        Row("layers.{i}.n", "{p}l.{i}.n", ("D",), when="has_n"),
        Skip("{p}ids"),
    )
    sd = {
        "m.tok.weight": torch.randn(5, 2),
        "m.l.0.ab.weight": torch.randn(4, 2),
        "m.l.0.ab.bias": torch.randn(4),
        "m.l.1.ab.weight": torch.randn(4, 2),
        "m.l.1.ab.bias": torch.randn(4),
        "m.l.1.n.weight": torch.randn(2),
        "m.ids": torch.arange(3),
    }

    def run(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        reader = WeightReader(state, "toy")
        weights = map_weights(
            table,
            reader,
            dims={"V": 5, "D": 2, "2D": 4},
            flags={"ab_bias": True, "has_n": lambda i: i == 1},
            num_layers=2,
            prefix="m.",
        )
        reader.finish()
        return weights

    w = run(sd)
    assert torch.equal(w["layers.1.a.weight"], sd["m.l.1.ab.weight"][:2])
    assert torch.equal(w["layers.1.b.bias"], sd["m.l.1.ab.bias"][2:])
    assert "layers.0.n.weight" not in w and "layers.1.n.weight" in w
    with pytest.raises(InputError, match=r"not mapped .*m\.l\.0\.n\.weight"):
        run({**sd, "m.l.0.n.weight": torch.randn(2)})  # unmapped: layer 0 has no n
    with pytest.raises(InputError, match=r"'m\.l\.1\.ab\.bias' is missing"):
        run({k: v for k, v in sd.items() if k != "m.l.1.ab.bias"})
    with pytest.raises(InputError, match=r"'m\.tok\.weight' has shape \(5, 3\)"):
        run({**sd, "m.tok.weight": torch.randn(5, 3)})


# ---- every decoder architecture against transformers ---------------------------------------

_CACHE: dict[tuple[str, str], Tiny] = {}


def tiny(arch: str, inputs: str = "token-ids") -> Tiny:
    if (arch, inputs) not in _CACHE:
        _CACHE[arch, inputs] = build_tiny(arch, inputs)  # type: ignore[arg-type]
    return _CACHE[arch, inputs]


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_every_tensor_is_mapped_once(arch: str) -> None:
    model = tiny_hf_model(arch)
    canonical = adapt(model.config, model.state_dict())
    # named_parameters lists a tied head once; splits and fusions keep the element count.
    expected = sum(p.numel() for p in model.parameters())
    assert sum(w.numel() for w in canonical.weights.values()) == expected
    assert all(w.dtype == torch.float32 for w in canonical.weights.values())


@pytest.mark.parametrize("inputs", ["token-ids", "embeddings"])
@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_layers_and_logits_match_transformers(arch: str, inputs: str) -> None:
    t = tiny(arch, inputs)
    assert min(len(f.token_ids) for f in t.fixtures) < LENGTH  # left padding is exercised
    assert_matches(t)


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_fp16_padded_rows_stay_finite(arch: str) -> None:
    t = tiny(arch)
    half = t.rebuild().half()
    for batch in t.batches:
        x, key_mask = module_inputs(half, batch, t.embed_table, torch.float16)
        with torch.no_grad():
            states = half.run_layers(x, key_mask)
            logits = half.head(states[-1])
        assert all(torch.isfinite(s).all() for s in states)
        assert all(torch.isfinite(c).all() for c in logits)


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_unmapped_and_missing_tensors_are_refused_by_name(arch: str) -> None:
    model = tiny_hf_model(arch)
    sd = dict(model.state_dict())
    with pytest.raises(InputError, match=r"model\.layers\.0\.mystery\.weight"):
        adapt(model.config, {**sd, "model.layers.0.mystery.weight": torch.zeros(3)})
    key = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(InputError, match=re.escape(repr(key)) + " is missing"):
        adapt(model.config, {k: v for k, v in sd.items() if k != key})
