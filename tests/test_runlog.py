"""Library output is recorded, not printed and not discarded (converter/pipeline/runlog.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_llama, write_tiny_recipe

from converter.pipeline.runlog import (
    RunLog,
    route_library_output,
    session_log_text,
    warnings_to_log,
)

REPO = Path(__file__).resolve().parent.parent
RENAMED = "model.layers.1.mlp.up_proj.weight"
RESHAPED = "model.layers.0.self_attn.q_proj.weight"


def test_library_warnings_are_recorded_and_errors_stay_visible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    route_library_output()  # what the anec command does first
    library = logging.getLogger("coremltools")
    library.warning("anec-test: a note on import")
    library.error("anec-test: a library error")
    err = capsys.readouterr().err
    assert "a note on import" not in err
    assert "a library error" in err
    log = session_log_text()
    assert "WARNING coremltools: anec-test: a note on import" in log
    assert "ERROR coremltools: anec-test: a library error" in log


def test_warnings_raised_in_a_block_go_to_the_run_log_once_each() -> None:
    route_library_output()
    with RunLog("test") as run, warnings_to_log("a test step"):
        for _ in range(3):
            warnings.warn("anec-test: repeated", UserWarning, stacklevel=1)
        warnings.warn("anec-test: once", DeprecationWarning, stacklevel=1)
    text = run.text()
    # Three records: the UserWarning once, its repeat count, the DeprecationWarning.
    assert text.count("WARNING py.warnings: (during a test step)") == 3
    assert "(during a test step) UserWarning repeated 3 times: anec-test: repeated" in text
    assert "(during a test step)" in text and "DeprecationWarning: anec-test: once" in text


def test_a_bad_checkpoint_names_its_tensors_and_the_load_report_goes_to_the_log(
    tmp_path: Path,
) -> None:
    """A real ``anec`` process (transformers' own stderr handler writes to the process's
    stderr, which an in-process runner does not capture): one tensor renamed, one cut to the
    wrong shape. The terminal gets anec's error naming all three tensors, without ANSI
    codes; transformers' load report goes to the log, also without them. Before the fix the
    report reached the terminal with ``\\x1b[1m``."""
    ckpt = save_tiny_llama(tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors[RENAMED + "_renamed"] = tensors.pop(RENAMED)
    tensors[RESHAPED] = torch.zeros(64, 32)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    recipe = write_tiny_recipe(tmp_path / "bad.yaml", ckpt, "bad")
    log = tmp_path / "libraries.log"
    done = subprocess.run(
        [sys.executable, "-m", "converter.commands", "--log", str(log), "convert", str(recipe)]
        + ["--out", str(tmp_path / "out"), "--json"],
        # CI=true: transformers then also makes its logger propagate to the root logger
        # (whose stderr fallback printed the report in CI); its own handler is there either way.
        env=dict(os.environ, PYTHONPATH=str(REPO), CI="true"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    assert "\x1b" not in done.stderr and "LOAD REPORT" not in done.stderr, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "the config and the weights disagree" in error
    assert f"missing tensor(s) the config needs: {RENAMED};" in error
    assert f"extra tensor(s) the config has no place for: {RENAMED}_renamed;" in error
    assert f"tensor {RESHAPED} has shape [64, 32] in the file, the config expects [64, 64]" in error
    text = log.read_text()
    assert "WARNING transformers.modeling_utils: LlamaForCausalLM LOAD REPORT" in text
    assert "MISSING" in text and "UNEXPECTED" in text and "MISMATCH" in text
    assert "\x1b" not in text


def test_the_cli_imports_no_library_that_prints_progress_before_routing_its_output() -> None:
    # tqdm reads TQDM_DISABLE when it is imported: imported with the CLI (through torch),
    # coremltools' pass-pipeline bars reached the terminal during every conversion.
    code = "import sys, converter.commands; print(sorted({'torch', 'tqdm'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
