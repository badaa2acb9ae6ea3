"""Two conversions of one recipe in separate processes publish the same package content.

coremltools serializes protobuf maps in an order that depends on the process (string hashing,
so PYTHONHASHSEED) and stamps the day into the model's metadata; in one process, or on one
day, neither shows. Each conversion here runs ``anec convert`` in its own process with its
own PYTHONHASHSEED and output directory, and the manifests' ``content_sha256`` must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_llama, write_tiny_recipe

from converter.coreml import CONVERSION_DATE_KEY, SPEC_FILE

REPO = Path(__file__).resolve().parent.parent


def convert_in_process_of_its_own(recipe: str | Path, out: Path, hash_seed: int) -> Path:
    """``anec convert RECIPE --out OUT`` in a new Python process; the artifact directory."""
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "converter.cli", "convert", str(recipe), "--out", str(out)]
        + ["--json"],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return Path(json.loads(done.stdout.splitlines()[-1])["artifact"])


def content_hash(artifact: Path) -> str:
    return str(json.loads((artifact / "manifest.json").read_text())["package"]["content_sha256"])


def spec_bytes(artifact: Path) -> bytes:
    (package,) = artifact.glob("*.mlpackage")
    return (package / SPEC_FILE).read_bytes()


def test_two_processes_with_different_hash_seeds_give_the_same_content_hash(
    tmp_path: Path,
) -> None:
    recipe = write_tiny_recipe(tmp_path / "tiny.yaml", save_tiny_llama(tmp_path / "ckpt"))
    first = convert_in_process_of_its_own(recipe, tmp_path / "out-a", hash_seed=1)
    second = convert_in_process_of_its_own(recipe, tmp_path / "out-b", hash_seed=2)
    assert spec_bytes(first) == spec_bytes(second), "model.mlmodel differs between processes"
    assert content_hash(first) == content_hash(second)
    # No day in the package (it would differ tomorrow); convert.log records it instead.
    assert CONVERSION_DATE_KEY.encode() not in spec_bytes(first)
    assert "coremltools conversion date" in (first / "convert.log").read_text()


@pytest.mark.slow
def test_smollm2_converted_again_in_another_process_gives_the_same_content_hash(
    smollm2_artifact: Path, tmp_path: Path
) -> None:
    """One extra conversion: the session's shared artifact is the other side."""
    seed = int(os.environ.get("PYTHONHASHSEED") or 0) + 1  # differs from this process's
    again = convert_in_process_of_its_own("smollm2-135m-draft", tmp_path / "out", seed)
    assert spec_bytes(again) == spec_bytes(smollm2_artifact)
    assert content_hash(again) == content_hash(smollm2_artifact)
