"""bench/kv_fp16_sensitivity.py: its one-call run of the cached layers reproduces the
reference in fp32, so what it prints for fp16 is fp16's doing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tiny_models import save_tiny_llama, write_tiny_recipe

from converter.checkpoints.loading import load_checkpoint
from converter.recipe.loader import load_recipe
from converter.tasks.text_generation import rewrite_decoder
from parity.reference import continuation, originals
from parity.torch_settings import parity_torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from kv_fp16_sensitivity import logit_errors, report  # noqa: E402


def test_fp32_run_matches_the_reference_and_fp16_is_measured(tmp_path: Path) -> None:
    recipe = load_recipe(write_tiny_recipe(tmp_path / "r.yaml", save_tiny_llama(tmp_path / "c")))
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    with parity_torch():
        rw = rewrite_decoder(recipe, ckpt)  # type: ignore[arg-type]
        ref = continuation(ckpt.model, originals(rw.fixtures)[1], 24)  # past the 16-token window
        fp32 = logit_errors(rw, ref, torch.float32)
        fp16 = logit_errors(rw, ref, torch.float16)
    assert fp32.shape == fp16.shape == (24 + 1,)  # the prompt's last position and every step
    assert fp32.max() < 1e-4
    assert np.isfinite(fp16).all() and fp16.max() > 10 * fp32.max()
    lines = report("fp16", fp16, len(ref.prompt) - 1, threshold=0.0)
    assert lines[0].startswith("fp16: max |logit error|")
    assert str(len(ref.prompt) - 1) in lines[1]  # every position is over a zero threshold
