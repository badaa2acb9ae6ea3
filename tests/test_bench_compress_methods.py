"""bench/compress_methods.py's pure logic: the recipes it writes are valid recipes (one variant
each, every text-generation method covered, calibration only where a method reads it), and the
step times of a run are split into the fp16 artifact's and the variant's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from converter.compression import methods
from converter.recipe import load_recipe

BENCH = Path(__file__).resolve().parent.parent / "bench" / "compress_methods.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compress_methods", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_case_writes_a_valid_recipe_with_at_most_one_variant(tmp_path: Path) -> None:
    bench = _bench()
    used = set()
    for case, spec in bench.VARIANTS.items():
        path = tmp_path / f"{case}.yaml"
        path.write_text(bench.recipe_text(case, tmp_path / "ckpt", 151936), encoding="utf-8")
        recipe = load_recipe(path)  # schema and cross-field rules (calibration, target)
        if spec is None:
            assert recipe.compression is None
            continue
        assert recipe.compression is not None
        (variant,) = recipe.compression.variants
        assert variant.suffix == case and variant.method == spec["method"]
        used.add(variant.method)
    # every method implemented for text-generation has a case
    decoder = {
        n for n, m in methods.METHODS.items() if m.tasks is None or "text-generation" in m.tasks
    }
    assert decoder <= used


def test_token_slices_are_disjoint_and_inside_the_vocabulary() -> None:
    texts = _bench().token_texts(151936)
    rows = [tuple(t) for part in texts.values() for t in part]
    assert len(set(rows)) == len(rows)
    assert all(3 <= i < 151936 for row in rows for i in row)


def test_step_times_split_into_the_fp16_artifact_and_the_variant() -> None:
    bench = _bench()
    row = {
        "case": "gptq4",
        "timings_s": {
            "load checkpoint": 2.0,
            "convert to ML Program": 10.0,
            "compression: fp16 baselines": 3.0,
            "gptq4: compress": 40.0,
            "gptq4: parity (torch, MIL)": 5.0,
        },
    }
    assert bench.variant_steps(row) == {
        "gptq4: compress": 40.0,
        "gptq4: parity (torch, MIL)": 5.0,
        "compression: fp16 baselines": 3.0,
    }
    assert bench.fp16_steps_s(row) == 12.0


def test_each_step_gets_the_highest_memory_sampled_while_it_ran() -> None:
    bench = _bench()
    lines = [
        "BENCH-STEP 10.000 step load checkpoint: started",
        "some library line",
        "BENCH-STEP 12.500 step load checkpoint: done after 2.50 s (peak RSS so far 1 GiB)",
        "BENCH-STEP 12.600 step int8: compress: started",
    ]
    samples = [(9.0, 0.1), (11.0, 1.5), (12.0, 2.0), (13.0, 5.0), (14.0, 13.2)]
    peaks, seconds, running = bench.step_peaks(lines, samples)
    assert peaks == {"load checkpoint": 2.0, "int8: compress": 13.2}
    assert seconds == {"load checkpoint": 2.5}
    assert running == "int8: compress"
