"""Behaviour fingerprint of a tiny recipe of every kind, for a refactor's before / after
(issue 38 item 6): a window decoder with eight variants (one meant to fail), a cached decoder
with three and a chunked cached decoder with one (the recipes of
tests/test_compress_pipeline.py, test_kv_compress.py, test_kv_chunks_pipeline.py); a
ModernBERT classifier (one program, tests/test_reproducible.py), a BERT sentence encoder with
three variants (tests/test_compress_encoder.py), the same as a host-embedding island and tail,
a decision model (tests/test_reproducible.py) and a cross-encoder on text pairs with an int8
variant (tests/test_compress_encoder.py).

    python bench/fingerprint.py WORKDIR OUT.json         # convert and record
    python bench/fingerprint.py --recipe recipes/R.yaml [--recipe ...] WORKDIR OUT.json
    python bench/fingerprint.py --compare BEFORE.json AFTER.json

``--recipe`` converts those recipes (shipped ones, at full size) instead of the tiny ones.

Per artifact it records each package's content hash, every other file's sha256 (the log
left out) and every gate value. ``--compare`` prints what differs; the recipe files (and so
each manifest's recipe hash) name WORKDIR, so use the same WORKDIR twice (empty: move the first
run's aside) or expect those two.
Run the "before" from a git worktree of the old commit (``PYTHONPATH`` at it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"


def record(workdir: Path, recipes: list[Path]) -> dict[str, Any]:
    """Convert ``recipes`` (or, none given, the tiny ones) under ``workdir``: artifact -> what
    it holds."""
    sys.path.insert(0, str(TESTS))
    if recipes:
        return _holdings([(r.stem, _convert(r, workdir / r.stem)) for r in recipes])
    return _holdings(_tiny(workdir))


def _convert(recipe: Path, out: Path) -> Path:
    from tiny_models import run_anec

    result = run_anec("convert", recipe, "--out", out, "--json")
    print(f"{recipe}: anec convert exit {result.exit_code}", flush=True)
    return out


def _tiny(workdir: Path) -> list[tuple[str, Path]]:
    """Convert the tiny recipes under ``workdir``: (key, out folder) each."""
    import test_compress_encoder as encoder
    import test_compress_pipeline as window
    import test_kv_chunks_pipeline as chunks
    import test_kv_compress as cached
    import test_reproducible as kinds
    from tiny_models import convert_tiny_llama

    cases = {
        "win": (window.COMPRESSION, "tiny"),
        "tkv": (cached.CACHE + cached.COMPRESSION, "tkv"),
        "tch": (chunks.CACHE + chunks.COMPRESSION, "tch"),
    }
    folders = []
    for key, (extra, name) in cases.items():
        result, folder = convert_tiny_llama(workdir / key, extra, name)
        print(f"{key}: anec convert exit {result.exit_code}", flush=True)
        folders.append((key, folder))
    (workdir / "enc").mkdir(parents=True, exist_ok=True)
    island = encoder._recipe(workdir / "enc", "sentence-similarity", [], "ti")
    doc = json.loads(island.read_text())  # the same encoder as a host embedding, island, tail
    doc["encoder"] = {"partition": "host-embedding"}
    del doc["compression"]
    island.write_text(json.dumps(doc))
    recipes = {
        "cls": kinds._encoder(workdir / "enc"),
        "sim": encoder._recipe(workdir / "enc", "sentence-similarity", encoder.VARIANTS),
        "isl": island,
        "dec": kinds._decision(workdir / "enc"),
        "rer": encoder.reranker_recipe(workdir / "enc"),  # text pairs, an int8 variant
    }
    return folders + [(key, _convert(recipe, workdir / key)) for key, recipe in recipes.items()]


def _holdings(folders: list[tuple[str, Path]]) -> dict[str, Any]:
    """Each artifact of each folder: its packages' content hashes, other files' sha256 and
    gate values."""
    from converter.pipeline.hashing import mlpackage_content_hash

    out: dict[str, Any] = {}
    for key, folder in folders:
        for artifact in sorted(p for p in folder.iterdir() if p.is_dir()):
            doc: dict[str, Any] = {}
            for f in sorted(artifact.rglob("*")):
                rel = str(f.relative_to(artifact))
                if f.suffix == ".mlpackage":
                    doc[f"{rel} content"] = mlpackage_content_hash(f)
                elif f.is_file() and ".mlpackage" not in rel and f.name != "convert.log":
                    doc[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
            parity = artifact / "parity.json"
            if parity.is_file():
                gates = json.loads(parity.read_text())["gates"]
                doc["gates"] = {f"{g['name']} [{g.get('implementation')}]": g["value"]
                                for g in gates}  # fmt: skip
            out[f"{key}/{artifact.name}"] = doc
    return out


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs, one line each."""
    lines = [f"only in one: {a}" for a in sorted(set(before) ^ set(after))]
    for artifact in sorted(set(before) & set(after)):
        b, a = before[artifact], after[artifact]
        for key in sorted(set(b) | set(a)):
            if key == "gates":
                for gate in sorted(set(b.get(key, {})) | set(a.get(key, {}))):
                    if b[key].get(gate) != a[key].get(gate):
                        lines.append(f"{artifact}: gate {gate}: {b[key].get(gate)} -> "
                                     f"{a[key].get(gate)}")  # fmt: skip
            elif b.get(key) != a.get(key):
                lines.append(f"{artifact}: {key} differs")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs=2, type=Path)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--recipe", type=Path, action="append", default=[])
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.paths)
        lines = compare(before, after)
        print("\n".join(lines) if lines else "identical")
        return
    workdir, out = args.paths
    if workdir.exists() and any(workdir.iterdir()):  # a second run would refuse every out dir
        parser.error(f"WORKDIR {workdir} is not empty: move the last run's aside first")
    out.write_text(json.dumps(record(workdir, args.recipe), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
