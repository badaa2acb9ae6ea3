"""``method: grid``: a checkpoint de-quantized from a block format is stored on its own grid.

Unit tests of the grid finder on values made by gguf's own Q4_0 / Q4_1 / Q8_0 quantizers, and
one conversion of the tiny Llama whose weights were passed through those quantizers (one weight
left off every grid), with a grid variant: the program stores each weight at its grid's bits,
decodes to the checkpoint's values up to fp16, and a weight on no grid stays fp16 with why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import Result
from tiny_models import run_anec, tiny_hf_model, write_tiny_recipe

from converter.compression.grid_fit import TOLERANCE, Grid, find_grid

OFF_GRID = "model.layers.2.mlp.down_proj.weight"


def _gguf(w: np.ndarray, kind: str) -> np.ndarray:
    """``w`` quantized and de-quantized by the gguf package (what a GGUF loader yields)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    return np.asarray(dequantize(quantize(w.astype(np.float32), qtype), qtype), np.float32)


def _fp16(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize(
    ("kind", "grid"),
    [("Q4_0", Grid(4, True)), ("Q4_1", Grid(4, False)), ("Q8_0", Grid(8, True))],
)
def test_a_gguf_block_format_is_found_and_reproduced(kind: str, grid: Grid) -> None:
    w = _fp16(_gguf(np.random.default_rng(1).standard_normal((48, 96)), kind))
    for scale in (1.0, 2.0**-5):  # anec's stream scaling multiplies weights by powers of two
        found = find_grid(w * scale, 32)
        assert found is not None and found[0] == grid
        ints = found[1]
        assert ints.q.shape == w.shape and ints.scale.shape == (48, 3)
        assert (ints.offset is None) == grid.symmetric
        top = 2 ** (grid.bits - 1)
        assert ints.q.min() >= -top and ints.q.max() <= top - 1
        blocks = np.abs(w * scale).reshape(48, 3, 32).max(-1, keepdims=True)
        err = np.abs(ints.decode() - w * scale).reshape(48, 3, 32)
        assert np.all(err <= TOLERANCE * blocks)


def test_values_on_no_grid_are_refused() -> None:
    rng = np.random.default_rng(2)
    assert find_grid(_fp16(rng.standard_normal((48, 96))), 32) is None
    q41 = _fp16(_gguf(rng.standard_normal((48, 96)), "Q4_1"))
    assert find_grid(q41[:, :80], 32) is None  # 80 inputs are not whole blocks of 32
    moved = q41.copy()
    moved[5, 40] += 0.3 * (q41[5, 32:64].max() - q41[5, 32:64].min()) / 15  # 0.3 of a step
    assert find_grid(moved, 32) is None
    assert find_grid(q41.reshape(48, 32, 3), 32) is None  # not a 1x1 conv / matrix


GRID = """\
target: macOS15
compression:
  keep_fp16: ["*norm*", "embed*"]
  held_out: [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41, 42, 43, 44, 45]]
  acceptance: {depths: [1, 3], prompts: 2, prompt_tokens: 6, new_tokens: 8}
  variants:
    - suffix: grid
      method: grid
      granularity: per-block
      group_size: 32
      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.0001}
    - suffix: mixed
      method: mixed
      search:
        methods: [grid, lut]
        bits: [16, 4]
        budget: {min_top1_agreement: 0.9, max_mean_kl: 0.0001}
      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.0001}
  calibration: [[60, 61, 62, 63, 64, 65, 66, 67], [80, 81, 82, 83, 84, 85, 86]]
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("grid")
    model = tiny_hf_model("llama", seed=4)
    weights = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and name != OFF_GRID:
                kind = "Q8_0" if "embed" in name else "Q4_1"
                p.copy_(torch.from_numpy(_gguf(p.numpy(), kind)))
            weights[name] = p.detach().numpy().copy()
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    recipe = write_tiny_recipe(root / "tiny.yaml", root / "ckpt", extra=GRID)
    return run_anec("convert", recipe, "--out", root / "out", "--json"), root / "out", weights


def _manifest(out: Path, suffix: str = "grid") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / f"tiny-{suffix}" / "manifest.json").read_text())
    return doc


def test_each_weight_is_stored_on_its_own_grid(run: tuple[Result, Path, Any]) -> None:
    result, out, _ = run
    assert result.exit_code == 0, result.output
    records = {r["weight"]: r for r in _manifest(out)["compression"]["weights"]}
    off = records.pop("layers.2.mlp.down.weight")
    assert off["method"] == "fp16" and "on no int4 / int8 grid" in off["kept_reason"]
    stored = [r for r in records.values() if r["method"] == "grid"]
    heads = [r for r in stored if r["weight"].startswith("lm_head")]
    # every other projection (q/k/v and gate/up fused) and the LM head chunks of the tied table
    assert len(heads) == 3 and len(stored) == len(records) == 3 * 4 - 1 + 3
    for r in stored:
        assert r["op"] == "constexpr_blockwise_shift_scale"
        assert r["granularity"] == "per-block" and r["group_size"] == 32
        # Q8_0 -> int8 + an fp16 scale per 32; Q4_1 -> uint4 + fp16 scale and offset per 32
        bits, extra = (8, 16) if r in heads else (4, 32)
        assert r["bits"] == bits and r["symmetric"] == (bits == 8)
        assert bits + extra / 32 <= r["bits_per_weight"] <= (bits + extra / 32) * 1.05, r


def test_the_variant_keeps_the_checkpoint_and_passes_its_gates(
    run: tuple[Result, Path, Any],
) -> None:
    result, out, _ = run
    assert result.exit_code == 0, result.output
    parity = json.loads((out / "tiny-grid" / "parity.json").read_text())
    assert parity["passed"] is True
    # the checkpoint kept up to fp16: as a draft for the fp16 model it is nearly always
    # accepted (the tiny random model has near ties, where 2**-10 of a weight can flip a token)
    acceptance = parity["acceptance"]
    assert [d["k"] for d in acceptance["depths"]] == [1, 3]
    for d in acceptance["depths"]:
        assert min(d["acceptance_per_position"]) >= 0.75 and d["cycles"] > 0
    assert "Acceptance as a draft" in (out / "tiny-grid" / "parity.txt").read_text()
    # per-block integers are expanded to fp16 at load (rule S-BLOCK, a prediction): the NE
    # would read every grid weight's dense bytes per call, far more than the file stores
    main = parity["ne_weight_stream"]["tiny-grid"]["functions"]["main"]
    block = main["by_rule"]["S-BLOCK"]
    records = _manifest(out)["compression"]["weights"]
    dense = sum(r["fp16_bytes"] for r in records if r["method"] == "grid")
    assert block["weights"] == 14 and block["streamed"] == dense > 2 * block["stored"]
    assert main["weight_bytes_read_per_call"] > main["weight_bytes_stored"]


def test_the_mixed_search_takes_each_weight_s_own_grid_where_it_has_one(
    run: tuple[Result, Path, Any],
) -> None:
    """grid as a search candidate: exact where a weight lies on a grid, absent where not; the
    plan within a budget no palette meets keeps every grid weight on its grid and the off-grid
    weight fp16, and is stored as the grid variant stores it."""
    result, out, _ = run
    assert result.exit_code == 0, result.output
    manifest = _manifest(out, "mixed")
    search = manifest["compression"]["search"]
    assert search["search_space"]["candidates"] == ["fp16", "grid", "lut4"]
    table = search["sensitivity"]["table"]
    assert "grid" not in table["layers.2.mlp.down.weight"]  # OFF_GRID, by its BC1L name
    assert all(row["grid"] < 1e-5 for name, row in table.items() if "grid" in row)
    assert "grid" not in search["uniform"]  # one weight has no grid: no uniform grid plan
    chosen = search["chosen"]["bits"]
    assert chosen["layers.2.mlp.down.weight"] == "fp16"
    assert {c for n, c in chosen.items() if n != "layers.2.mlp.down.weight"} == {"grid"}
    records = {r["weight"]: r for r in manifest["compression"]["weights"]}
    grid_records = {r["weight"]: r for r in _manifest(out)["compression"]["weights"]}
    for name, tag in chosen.items():
        if tag == "grid":
            mine, theirs = records[name], grid_records[name]
            assert mine["op"] == "constexpr_blockwise_shift_scale"
            assert mine["stored_bytes"] == theirs["stored_bytes"]
            assert mine["decoded_sha256"] == theirs["decoded_sha256"]
    parity = json.loads((out / "tiny-mixed" / "parity.json").read_text())
    assert parity["passed"] is True


def test_a_checkpoint_on_no_grid_is_an_error_naming_the_variant(tmp_path: Path) -> None:
    tiny_hf_model("llama").save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    recipe = write_tiny_recipe(tmp_path / "tiny.yaml", tmp_path / "ckpt", extra=GRID)
    result = run_anec("convert", recipe, "--out", tmp_path / "out")
    assert result.exit_code != 0
    assert "variant grid" in result.output and "does not quantize" in result.output
