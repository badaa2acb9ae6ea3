"""Defect 5: the real-shape tests read configs vendored in the repository, never ../shared.

Each vendored config builds transformers' own model (on the meta device: shapes only, no
memory) with the parameter count its README row states, so a truncated or swapped file fails
here in the fast tier instead of skipping a slow test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_configs import CONFIG_DIR, config_dict

REPO = Path(__file__).resolve().parents[1]

# name -> (transformers config class, model class, parameters in millions per transformers)
EXPECTED = {
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", 494.0),
    "modernbert-base": ("ModernBertConfig", "ModernBertModel", 149.0),
    "mmbert-base-shape": ("ModernBertConfig", "ModernBertModel", 306.9),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", 596.0),
    "gemma-3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", 268.1),
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", 1235.8),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_vendored_config_builds_at_its_stated_size(name: str) -> None:
    import transformers

    config_cls, model_cls, millions = EXPECTED[name]
    data = config_dict(name)
    data.pop("architectures", None)
    config = getattr(transformers, config_cls)(**data)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    count = sum(p.numel() for p in model.parameters())
    assert count / 1e6 == pytest.approx(millions, abs=0.05)


def test_every_vendored_config_is_listed_and_tested() -> None:
    names = {p.stem for p in CONFIG_DIR.glob("*.json")}
    assert names == set(EXPECTED)
    readme = (CONFIG_DIR / "README.md").read_text()
    assert all(f"`{n}.json`" in readme for n in names)


def test_no_test_reads_outside_the_repository() -> None:
    # ../shared/configs was reached as Path(__file__).parents[2] / "shared" / "configs".
    offenders = [
        p.name
        for p in (REPO / "tests").glob("*.py")
        if p.name != Path(__file__).name and "parents[2]" in p.read_text()
    ]
    assert offenders == []
