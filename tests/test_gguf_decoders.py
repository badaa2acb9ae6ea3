"""A GGUF file of each decoder anec supports converts; GGUF architecture names are what
transformers loads them as; values a GGUF does not carry are recorded as deviations.

The files are tiny perturbed models written with the `gguf` library as llama.cpp writes them
(tests/tiny_gguf.py). transformers itself is the reference for the name mapping and for the
weights: anec's own GGUF reader (converter.checkpoints.gguf_weights) must give its model bit for
bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import GGUF_ARCH, write_decoder_gguf
from tiny_models import run_anec, tiny_hf_model

from converter.checkpoints import gguf_config, gguf_weights

# anec architecture -> overrides: Qwen 3's GGUF table has no head_dim row, so transformers
# reads every Qwen 3 GGUF with its default head_dim, 128 (Qwen3-0.6B's own).
DECODERS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}, "gemma3": {}}

RECIPE = """\
name: {name}
task: text-generation
source:
  kind: gguf
  path: {path}
shapes:
  batch: 1
  sequence_length: 16
io:
  lm_head_chunk: 128
fixtures:
  token_ids: [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny GGUF per decoder architecture (matrices Q8_0)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, overrides in DECODERS.items():
        folder = root / arch
        folder.mkdir()
        out[arch] = write_decoder_gguf(tiny_hf_model(arch, **overrides), folder / "model.gguf")
    return out


@pytest.fixture(scope="module")
def converted(
    files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, str, Path]]:
    """Each file through ``anec convert``: (exit code, output, artifact folder)."""
    out = {}
    for arch, path in files.items():
        root = tmp_path_factory.mktemp(f"convert-{arch}")
        recipe = root / "recipe.yaml"
        recipe.write_text(RECIPE.format(name=f"tiny-{arch}-gguf", path=path), encoding="utf-8")
        result = run_anec("convert", recipe, "--out", root / "out", "--json")
        out[arch] = (result.exit_code, result.output, root / "out" / f"tiny-{arch}-gguf")
    return out


@pytest.mark.parametrize("arch", DECODERS)
def test_the_architecture_maps_as_transformers_loads_it(arch: str, files: dict[str, Path]) -> None:
    from transformers import AutoConfig

    path = files[arch]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert gguf_config.model_type(GGUF_ARCH[config.model_type]) == config.model_type
    if arch == "gemma3":
        assert config.model_type == "gemma3_text"


def test_architectures_transformers_does_not_load_from_gguf_map_to_none() -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert gguf_config.model_type("rwkv6") is None
    assert gguf_config.model_type("tokenizer") is None  # a section of the table, not a model
    assert gguf_config.model_type("llama", "mistral") == "mistral"
    for arch in GGUF_SUPPORTED_ARCHITECTURES:
        if arch not in ("general", "tokenizer"):
            assert gguf_config.model_type(arch) is not None, arch


@pytest.mark.parametrize("arch", DECODERS)
def test_anec_reads_the_weights_transformers_reads(arch: str, files: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = files[arch]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    assert gguf_weights.supported(path)
    ours, info = gguf_weights.load_model(path, config, AutoModelForCausalLM)
    assert not any(info.values()), info
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_gemma_norms_lose_the_one_llama_cpp_added(files: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = files["gemma3"]
    original = tiny_hf_model("gemma3").state_dict()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ours, _ = gguf_weights.load_model(path, config, AutoModelForCausalLM)
    norms = [n for n in original if "norm.weight" in n]
    assert len(norms) == 6 * 3 + 1  # four a layer, q and k norms, the final norm
    for name in norms:  # stored F32 as 1 + w: exact after the subtraction up to fp32 rounding
        np.testing.assert_allclose(ours.state_dict()[name], original[name], atol=1e-6)


@pytest.mark.parametrize("arch", DECODERS)
def test_a_gguf_of_each_decoder_converts(
    arch: str, converted: dict[str, tuple[int, str, Path]]
) -> None:
    code, output, artifact = converted[arch]
    assert code == 0, output
    manifest = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["checkpoint"]["source"]["kind"] == "gguf"
    assert manifest["tokenizer"] is None  # the file has no tokenizer metadata


def _assumed(artifact: Path) -> dict[str, object]:
    manifest = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
    return {
        d["where"].removeprefix("config."): d["effective"]
        for d in manifest["deviations"]
        if d["where"].startswith("config.")
    }


def test_values_gemma_gguf_does_not_carry_are_recorded(
    converted: dict[str, tuple[int, str, Path]],
) -> None:
    assumed = _assumed(converted["gemma3"][2])
    # transformers' defaults, not the checkpoint's (its query_pre_attn_scalar is 64).
    assert assumed["query_pre_attn_scalar"] == 256.0
    assert "sliding_attention" in str(assumed["layer_types"])
    assert "10000.0" in str(assumed["rope_parameters"])  # the local RoPE base
    # Carried by the file, so not recorded.
    assert not {"hidden_size", "sliding_window", "head_dim", "vocab_size"} & set(assumed)
    assert _assumed(converted["qwen3"][2])["head_dim"] == 128.0
    assert "rope_parameters" not in _assumed(converted["llama"][2])  # one base, carried


def test_an_architecture_transformers_does_not_load_from_gguf_exits_2(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(name="rwkv", path=path), encoding="utf-8")
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "'rwkv6': transformers does not load this architecture from GGUF" in result.output
