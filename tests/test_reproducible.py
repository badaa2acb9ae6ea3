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


def test_a_conversion_does_not_depend_on_what_the_process_built_before(tmp_path: Path) -> None:
    """coremltools numbers generated op names with counters that live as long as the process
    (and resets only some of them, after a conversion): MIL ops built in between (the
    compression passes, the evaluator's tests, another conversion) must not change the next
    program's bytes. Measured before the fix: SmolLM2 converted in a test session named an op
    transpose_91, in a fresh process transpose_90."""
    from coremltools.converters.mil import Builder as mb

    from converter.pipeline import convert
    from converter.recipe import load_recipe

    recipe = load_recipe(
        write_tiny_recipe(tmp_path / "tiny.yaml", save_tiny_llama(tmp_path / "ckpt"))
    )
    first = convert(recipe, tmp_path / "a").artifact_dir

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def elsewhere(x: object) -> object:  # ops with generated names, outside any conversion
        return mb.tile(x=mb.transpose(x=x, perm=[1, 0]), reps=[2, 1])

    second = convert(recipe, tmp_path / "b").artifact_dir
    assert first is not None and second is not None
    assert spec_bytes(first) == spec_bytes(second)
    assert content_hash(first) == content_hash(second)
