"""A cached decoder's programs in a compressed variant: the fp16 single-function packages the
one plan is applied to, their combination into one multifunction package per chunk, whether
every function stores every weight as the window program does, and the cache's part of the
variant's reports (`converter.compression.stateful` says why it is built this way)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converter.compression.records import WeightRecord, weight_records
from converter.compression.schemes import Scheme, apply_plan
from converter.compression.sites import WeightSite, weight_sites
from converter.coreml.program import function_ops, save_package

# The cache gates that hold for a compressed variant exactly as for the fp16 package.
STRUCTURAL = (
    "kv_finite_outputs",
    "kv_extend_argmax_flips",
    "kv_stale_max_abs_diff",
    "kv_weights_stored_once",
)
HOST_FILES = ("embeddings.npy", "tokenizer.json", "rope.npy", "head_ids.npy")
WINDOW = "window"  # the window program's entry in the identical-weights comparison


@dataclass
class KvBuild:
    """What the cached task hands in: how to make the fp16 programs again (the published
    artifact holds only the combined package) and how to gate a combined package.

    ``singles(folder)`` saves one fp16 single-function package per function of each chunk
    package (one chunk without a weight budget) under ``folder``; ``window(path)`` saves the
    fp16 window program (the same weights, markers on its layer outputs) as ``path``;
    ``gates(packages, sizes, weights)`` runs, on the chunk packages in call order, the
    per-layer MIL fp32 gate of every function against the module holding ``weights`` (the
    variant's decoded weights) and the cache gates (`KvParity`);
    ``package_file(name, i)`` names chunk ``i``'s package of artifact ``name``.
    ``parameters`` are the window module's parameter names."""

    singles: Callable[[Path], list[dict[str, Path]]]
    window: Callable[[Path], Path]
    gates: Callable[[list[Path], list[dict[str, Any]], dict[str, Any]], tuple[list[Any], Any]]
    combine: Callable[[dict[str, Path], Path], dict[str, Any]]
    parameters: list[str]
    package_file: Callable[[str, int], str]


@dataclass
class CachedPrograms:
    """The fp16 functions one variant compresses beside the window program: ``models`` (fp16
    MLModels) and ``fsites`` by label (`program_labels`), ``programs`` the label's (chunk
    index, function, fp16 package), ``scratch`` where the variant's compressed functions go."""

    build: KvBuild
    scratch: Path
    models: dict[str, Any] = field(default_factory=dict)
    programs: dict[str, tuple[int, str, Path]] = field(default_factory=dict)
    fsites: dict[str, list[WeightSite]] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        """How many packages the functions are combined into."""
        return 1 + max(i for i, _, _ in self.programs.values())

    def compress(
        self, plan: dict[str, Scheme], directory: Path, vname: str
    ) -> tuple[list[Path], list[dict[str, Any]]]:
        """The plan applied to every function (each its own weights), saved in ``scratch``
        and combined into ``vname``'s packages under ``directory``: (packages, their sizes)."""
        built = {}
        for label, model in self.models.items():
            own = self.fsites[label]
            names = {s.name for s in own}  # a chunk's programs hold only its own layers
            part = {n: scheme for n, scheme in plan.items() if n in names}
            built[label] = save_package(apply_plan(model, part, own),
                                        self.scratch / f"{label}.mlpackage")  # fmt: skip
        packages, sizes = [], []
        for i in range(self.chunks):
            functions = {f: built[label] for label, (j, f, _) in self.programs.items() if j == i}
            packages.append(directory / self.build.package_file(vname, i))
            sizes.append(self.build.combine(functions, packages[-1]))
        return packages, sizes

    def stored_alike(
        self,
        window: list[WeightRecord],
        combined: list[Any],
        plan: dict[str, Scheme],
        kept: dict[str, str],
    ) -> tuple[list[str], list[dict[str, int]]]:
        """The weights some function stores otherwise than the window program (``window``:
        its records) or lacks (`differing`), and each combined package's (``combined``: MIL
        programs in call order) live ops of its default (decode) function."""
        stored = {WINDOW: payloads(window)}
        ops = []
        for i, program in enumerate(combined):
            for label, (j, f, _) in self.programs.items():
                if j == i:
                    per, _ = weight_records(program.functions[f], self.fsites[label], plan, kept)
                    stored[label] = payloads(per)
            ops.append(function_ops(program.functions["decode"]))
        chunk_of = {label: i for label, (i, _, _) in self.programs.items()}
        return differing(stored, chunk_of), ops


def program_labels(singles: list[dict[str, Path]]) -> dict[str, tuple[int, str, Path]]:
    """Each fp16 single-function package by its label in the reports: the function's name
    (``decode``) for one package, ``chunk<i>.<function>`` for each chunk of several."""
    return {
        (f if len(singles) == 1 else f"chunk{i}.{f}"): (i, f, path)
        for i, chunk in enumerate(singles)
        for f, path in chunk.items()
    }


def function_sites(function: Any, parameters: list[str]) -> list[WeightSite]:
    """The weight sites of one function under the window module's parameter names (a cached
    module holds the window module as ``window``, so its constants may carry that prefix)."""
    names = list(parameters) + [f"window.{n}" for n in parameters]
    sites = weight_sites(function, names)
    out = []
    for s in sites:
        name = s.name[len("window.") :] if s.name.startswith("window.") else s.name
        out.append(WeightSite(name, s.const, s.shape, s.dtype))
    return out


def payloads(records: list[WeightRecord]) -> dict[str, str]:
    """Each weight's stored-payload sha256."""
    return {r.weight: r.payload_sha256 for r in records}


def differing(
    stored: dict[str, dict[str, str]], chunk_of: dict[str, int] | None = None
) -> list[str]:
    """Weights whose stored payload differs between the programs in ``stored`` (program name
    -> weight -> sha256), or that a program lacks while another function of its package holds
    it (``chunk_of``: a function program's package index; one package when not given), as
    ``weight (programs)`` lines."""
    chunk_of = chunk_of or {}
    names = sorted({w for per in stored.values() for w in per})
    out = []
    for weight in names:
        holders = {program: per[weight] for program, per in stored.items() if weight in per}
        owning = {chunk_of.get(p, 0) for p in holders if p != WINDOW}
        odd = {p for p, h in holders.items() if h != holders.get(WINDOW)}
        odd |= {
            p
            for p in stored
            if p not in holders and (p == WINDOW or chunk_of.get(p, 0) in owning or not owning)
        }
        if odd:
            out.append(f"{weight} ({', '.join(sorted(odd))})")
    return out


def with_chunks(
    manifest: Any,
    packages: list[Path],
    ops: list[dict[str, int]],
    sizes: list[dict[str, Any]],
    function: str,
) -> Any:
    """The variant's manifest naming its own packages and sizes where the fp16 artifact's
    named its own: ``kv_cache.sizes`` for one package; for chunks, each chunk's package and
    sizes, the call order, ``extra_packages`` and the pieces' files; every package's default
    ``function`` as the fp16 artifact's (decode)."""
    from converter.pipeline.manifest_fields import package_entry

    kv = dict(manifest.kv_cache or {})
    manifest.package.function = function
    if len(packages) == 1:
        return manifest.model_copy(update={"kv_cache": kv | {"sizes": sizes[0]}})
    files = [p.name for p in packages]
    kv["chunks"] = [
        dict(entry) | {"package": file, "sizes": size}
        for entry, file, size in zip(kv["chunks"], files, sizes, strict=True)
    ]
    kv["chunking"] = dict(kv["chunking"]) | {"call_order": files}
    kv["sizes"] = dict(kv["sizes"]) | {
        "package_bytes": sum(s["multifunction_package_bytes"] for s in sizes),
        "weight_bytes": sum(s["multifunction_weight_bytes"] for s in sizes),
    }
    extra = [package_entry(p, o) for p, o in zip(packages[1:], ops[1:], strict=True)]
    for entry in extra:
        entry.function = function
    pieces = [
        piece.model_copy(update={"files": [file]})
        for piece, file in zip(manifest.pieces or [], files, strict=True)
    ]
    return manifest.model_copy(update={"kv_cache": kv, "extra_packages": extra, "pieces": pieces})


def cache_report(kv: Any, sizes: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The cache's part of a variant's parity.json (its ``kv_cache`` entry) and parity.txt:
    the fidelity gates reported, not gated, and how many times each package stores its
    weights."""
    reported = [g for g in kv.gates if g.name not in STRUCTURAL]
    lines = [
        "cache (MIL evaluator fp16, through the package's functions): structural gates above; "
        "reported, not gated (the fp16 program's fidelity gates; a variant changes the model):"
    ] + [f"  {g.name}: {g.value:.6g} (fp16 threshold {g.threshold:g})" for g in reported]
    for i, per in enumerate(sizes):
        where = f" (package {i})" if len(sizes) > 1 else ""
        lines.append(
            f"weights stored once{where}: multifunction weight file "
            f"{per['multifunction_weight_bytes']:,} bytes = {per['weight_ratio']:.4f}x the "
            "largest single function's"
        )
    section = {
        "reported": [g.to_json() for g in reported],
        "sizes": sizes[0] if len(sizes) == 1 else sizes,
    }
    return {"kv_cache": section}, "\n".join(lines)
