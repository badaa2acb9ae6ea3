"""How a cached decoder's functions are packaged (recipe ``cache.layout``), and the weight
bytes each layout is predicted to hold resident per set of loaded functions.

``multifunction`` (the default) combines prefill, decode and extend into one package whose
weights are stored once (`converter.tasks.text_generation_kv.emit_functions`).
``per-function`` publishes each function as its own package (``<name>.<function>.mlpackage``,
its function ``main``), each storing its own weights once: for runtimes where loading several
functions of one multifunction package holds a weight copy per loaded function (Anemll forge,
M6 on macOS 27, ../shared/research/anchors_runtime.md section 6: a 0.69 GB chunk took 1.05 GB
of wired memory with one function loaded and 2.09 GB with two), a host loads only the
packages it calls. The cache crosses packages through the host: the ``io`` style passes it in
every call; the ``state`` style's host copies the state of the package it called last into the
next one's (MLState read_state / write_state, `converter.drafts.host_loop.coreml_backend`).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from converter.tasks.kv_contract import DEFAULT_FUNCTION
from converter.tasks.shared import Program

PER_FUNCTION = "per-function"
WEIGHTS = Path("Data") / "com.apple.CoreML" / "weights" / "weight.bin"
# Where the prediction's one unknown comes from: whether loaded functions share weights.
_SHARING = (
    "unverified: coremltools stores a multifunction package's shared weights once; Anemll "
    "forge reports (M6, macOS 27) each loaded function holding its own copy; anec "
    "device-check measures footprint and wired memory per set of loaded functions"
)


def package_bytes(path: Path) -> int:
    """Bytes of every file under a package."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def function_package_file(name: str, function: str) -> str:
    """The package file of one function in the per-function layout."""
    return f"{name}.{function}.mlpackage"


def publish_singles(
    singles: dict[str, Path], programs: dict[str, Program], directory: Path, name: str
) -> dict[str, Program]:
    """Move each single-function package into ``directory`` under its published name; each
    function's program, at its package."""
    published = {}
    for function, path in singles.items():
        target = directory / function_package_file(name, function)
        shutil.move(str(path), str(target))
        published[function] = replace(programs[function], path=target)
    return published


def per_function_sizes(packages: dict[str, Path]) -> dict[str, Any]:
    """Bytes of each function's package and of its weight file."""
    return {
        "layout": PER_FUNCTION,
        "package_bytes": {f: package_bytes(p) for f, p in packages.items()},
        "weight_bytes": {f: (p / WEIGHTS).stat().st_size for f, p in packages.items()},
    }


def loaded_sets(functions: list[str]) -> list[list[str]]:
    """The sets of loaded functions a host uses: each alone, decode with each other, all."""
    others = [f for f in functions if f != DEFAULT_FUNCTION]
    sets = [[f] for f in functions] + [[DEFAULT_FUNCTION, f] for f in others]
    return sets + ([functions] if len(functions) > 2 else [])


def resident_predicted(sizes: dict[str, Any], functions: list[str]) -> dict[str, Any]:
    """Weight bytes resident per set of loaded functions, predicted from the stored weight
    files: per-function, the loaded packages' files; multifunction, the one file if loaded
    functions share it, one copy per loaded function if they do not (both given)."""
    rows = []
    for loaded in loaded_sets(functions):
        if sizes.get("layout") == PER_FUNCTION:
            row = {"bytes": sum(sizes["weight_bytes"][f] for f in loaded)}
        else:
            stored = sizes["multifunction_weight_bytes"]
            row = {"if_shared": stored, "if_copied_per_function": stored * len(loaded)}
        rows.append({"functions": "+".join(loaded), **row})
    return {
        "evidence": "predicted",
        "what": "weight bytes resident with these functions loaded (the stored weight files; "
        "activations, the KV cache and Core ML's own buffers not counted)",
        "sharing": _SHARING
        if sizes.get("layout") != PER_FUNCTION
        else "none: one package per function, each loaded on its own",
        "rows": rows,
    }


def add_to_plan(directory: Path, resident: dict[str, Any]) -> None:
    """The resident prediction in the artifact's plan.json and plan.txt (a section of each)."""
    import json

    from converter.pipeline.publish import write_json_atomic, write_text_atomic
    from converter.placement.artifact_gate import PLAN_JSON, PLAN_TXT

    doc = json.loads((directory / PLAN_JSON).read_text(encoding="utf-8"))
    doc["resident_predicted"] = resident
    write_json_atomic(directory / PLAN_JSON, doc)
    lines = [f"resident weight bytes per set of loaded functions (evidence: "
             f"{resident['evidence']}; sharing: {resident['sharing']}):"]  # fmt: skip
    for row in resident["rows"]:
        figures = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in row.items() if k != "functions")
        lines.append(f"  {row['functions']}: {figures}")
    text = (directory / PLAN_TXT).read_text(encoding="utf-8").rstrip("\n")
    write_text_atomic(directory / PLAN_TXT, text + "\n" + "\n".join(lines) + "\n")
