"""Llama 3.x RoPE frequency rescaling (``rope_type: llama3``) against transformers.

The tiny config's ``original_max_position_embeddings`` of 64 puts the 8 frequencies of a
16-channel head in all three regimes (wavelength 6.3 kept, 20 and 63 interpolated, the rest
divided by ``factor``), and the angles at positions up to 15 differ visibly, so a wrong
boundary or a missing rescale shows at L = 16.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from tiny_models import assert_matches, build_tiny, one_torch_thread, tiny_config, tiny_hf_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from converter.errors import InputError
from graph_passes.archs import adapt
from graph_passes.rope import inverse_frequencies
from graph_passes.spec import CanonicalModel

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    yield from one_torch_thread()


def test_frequencies_are_transformers_llama3_frequencies() -> None:
    config = tiny_config("llama", rope_parameters=dict(LLAMA3))
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0
    spec = adapt(config, tiny_hf_model("llama", rope_parameters=dict(LLAMA3)).state_dict()).spec
    scaling = spec.layers[0].attention.rope_scaling
    assert scaling is not None and scaling.factor == 8.0
    got = inverse_frequencies(16, 10000.0, scaling)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    # All three regimes are present: kept (short wavelengths), divided, interpolated.
    plain = inverse_frequencies(16, 10000.0)
    wavelen = 2 * math.pi / plain
    kept, divided = wavelen < 64 / 4, wavelen > 64 / 1
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    torch.testing.assert_close(got[kept], plain[kept], rtol=0, atol=0)
    torch.testing.assert_close(got[divided], plain[divided] / 8, rtol=1e-12, atol=0)


def test_llama3_model_matches_transformers_and_plain_rope_does_not() -> None:
    t = build_tiny("llama", rope_parameters=dict(LLAMA3))
    assert_matches(t)
    plain_spec = t.canonical.spec
    layers = tuple(
        type(ls)(**{**ls.__dict__, "attention": type(ls.attention)(
            **{**ls.attention.__dict__, "rope_scaling": None})})
        for ls in plain_spec.layers
    )  # fmt: skip
    plain = t.rebuild(CanonicalModel(type(plain_spec)(**{**plain_spec.__dict__, "layers": layers}),
                                     t.canonical.weights))  # fmt: skip
    with pytest.raises(AssertionError, match="layer 0"):
        assert_matches(t, plain)


def test_legacy_rope_scaling_attribute_is_read() -> None:
    model = tiny_hf_model("llama", rope_parameters=dict(LLAMA3))
    keys = ("model_type", "hidden_act", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
            "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings")  # fmt: skip
    legacy = SimpleNamespace(**{k: getattr(model.config, k) for k in keys})
    legacy.rope_theta = 10000.0
    legacy.rope_scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    spec = adapt(legacy, model.state_dict()).spec
    assert (
        spec.layers[0].attention.rope_scaling
        == adapt(model.config, model.state_dict()).spec.layers[0].attention.rope_scaling
    )


@pytest.mark.parametrize("missing", ["factor", "original_max_position_embeddings"])
def test_incomplete_llama3_parameters_are_refused_by_key(missing: str) -> None:
    model = tiny_hf_model("llama")
    params = {k: v for k, v in LLAMA3.items() if k != missing}
    config = SimpleNamespace(**{**model.config.to_dict(), "rope_parameters": params})
    with pytest.raises(InputError, match=rf"config\.rope_parameters: .*needs {missing}"):
        adapt(config, model.state_dict())


def test_llama3_is_refused_where_the_architecture_does_not_use_it() -> None:
    model = tiny_hf_model("qwen2")
    config = SimpleNamespace(**{**model.config.to_dict(), "rope_parameters": dict(LLAMA3)})
    with pytest.raises(InputError, match=r"rope_parameters\.rope_type = 'llama3'"):
        adapt(config, model.state_dict())
