"""``anec parity``: re-run every parity gate on a published artifact, for every task.

The artifact's manifest names the checkpoint (with its hash) and holds the whole recipe, so
the BC1L module, the fixtures and the reference runs are rebuilt exactly; the saved package(s)
are then run by the MIL evaluator like ``anec convert`` runs them before publishing: the task's
re-check step list is its conversion step list without converting, the manifest and the plan.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from converter.device.evidence_file import evidence_gates, read_evidence
from converter.errors import InputError
from converter.pipeline.hashing import mlpackage_content_hash
from converter.pipeline.manifest import CACHE_RULE_SINCE, Manifest, check_schema_version
from converter.pipeline.progress import Steps
from converter.pipeline.publish import write_json_atomic, write_text_atomic
from converter.pipeline.steps import run_steps
from converter.recipe import Recipe, ResolvedSource, recipe_from_dict
from converter.tasks import task_of
from converter.tasks.shared import Job, Program
from converter.tasks.text_generation import DecoderRun, mil_profiles
from parity.gate_registry import RENAMED, GateResult, gate, registered
from parity.html_report import report_to_html
from parity.kv_gates import RETIRED, RULE
from parity.mil.profiles import PROFILES
from parity.report import gate_line
from parity.result import ParityReport

GateKey = tuple[str, str]  # (gate name, implementation), as parity.json lists them


@dataclass
class RecheckResult:
    """The re-run gates, where the reports went, and the JSON document."""

    report: ParityReport
    report_dir: Path
    document: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0 when every gate passed, else 1."""
        return 0 if self.report.passed else 1

    @property
    def text(self) -> str:
        """The re-run's parity.txt."""
        return (self.report_dir / "parity.txt").read_text(encoding="utf-8")


def read_manifest(artifact: Path) -> Manifest:
    """The artifact's manifest; InputError when it is missing or not an anec manifest."""
    path = artifact / "manifest.json"
    if not path.is_file():
        raise InputError(f"{artifact}: no manifest.json; expected a directory from anec convert")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InputError(f"{path}: not JSON: {e}") from None
    check_schema_version(doc, path)
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        raise InputError(f"{path}: not an anec manifest: {e.errors()[0]['msg']}") from None


def recipe_from_manifest(manifest: Manifest) -> Recipe:
    """The recipe the artifact was converted with, as the manifest records it."""
    try:
        return recipe_from_dict(manifest.recipe)
    except ValidationError as e:
        raise InputError(f"manifest recipe: no longer a valid recipe: {e}") from None


def checkpoint_source(manifest: Manifest) -> ResolvedSource:
    """Where the checkpoint the artifact was converted from lies, as the manifest records it."""
    src = manifest.checkpoint["source"]
    return ResolvedSource(src["kind"], Path(src["directory"]), src["gguf_file"])


def published_gates(artifact: Path) -> set[GateKey]:
    """The (name, implementation) of every gate in the artifact's published parity.json, a
    gate published under a name since replaced by its new name (`RENAMED`)."""
    path = artifact / "parity.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        names = ((str(g["name"]), str(g["implementation"])) for g in doc["gates"])
        return {(RENAMED.get(name, name), implementation) for name, implementation in names}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: cannot read the published gates: {e}") from None


def cache_rule(manifest: Manifest, published: set[GateKey]) -> tuple[set[GateKey], str | None]:
    """The gates a cached decoder's re-run is expected to run, and the note saying which rule
    the artifact was judged by when that was an earlier one than this anec's (manifest schema
    before `CACHE_RULE_SINCE`): its retired gates are not re-run, the fp32 cache level is."""
    if manifest.kv_cache is None or manifest.schema_version >= CACHE_RULE_SINCE:
        return published, None
    kept = {key for key in published if key[0] not in RETIRED}
    fp32 = {(g.name, "mil-fp32") for g in registered() if g.level == "kv-cache"
            and (g.name.startswith("kv_fp32_") or g.name.startswith("fp32_"))}  # fmt: skip
    note = (f"judged by the cache rule of manifest schema {manifest.schema_version} (an absolute "
            f"fp16 logit bound: {', '.join(RETIRED)} <= 0.25); re-run by the rule of {RULE}, "
            "the retired gates reported in kv_parity.json")  # fmt: skip
    return kept | fp32, note


def gate_set_gate(
    published: set[GateKey], rerun: set[GateKey], profiles: tuple[str, ...]
) -> GateResult:
    """A gate that passes only when the re-run ran exactly the published gates.

    A re-check that silently ran fewer gates would vouch for less than the artifact claims;
    one that ran gates the artifact was never published with would compare against nothing.
    MIL profiles left out on purpose (``--profile``) drop their gates from both sides: a gate
    found without running the profile (the window's markers gate) is no extra gate.
    """
    skipped = {f"mil-{name}" for name in PROFILES if name not in profiles}
    expected = {key for key in published if key[1] not in skipped}
    rerun = {key for key in rerun if key[1] not in skipped}
    missing, extra = sorted(expected - rerun), sorted(rerun - expected)
    parts = [f"published, not re-run: {', '.join(map(' / '.join, missing))}"] if missing else []
    parts += [f"re-run, not published: {', '.join(map(' / '.join, extra))}"] if extra else []
    return gate("recheck", "same_gate_set").check(
        float(len(missing) + len(extra)),
        detail="; ".join(parts) or f"{len(expected)} gates, as published",
    )


def _add_gate_to_reports(
    report_dir: Path, report: ParityReport, result: GateResult, title: str
) -> None:
    """Add ``result`` to the report and to the re-run's parity.json, .txt and .html."""
    report.gates.append(result)
    path = report_dir / "parity.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["gates"].append(result.to_json())
    doc["passed"] = bool(doc.get("passed", True)) and result.passed
    write_json_atomic(path, doc)
    line = gate_line(result)
    text = (report_dir / "parity.txt").read_text(encoding="utf-8")
    write_text_atomic(
        report_dir / "parity.txt", text.replace("Parity gates:\n", f"Parity gates:\n{line}\n", 1)
    )
    write_text_atomic(report_dir / "parity.html", report_to_html(doc, title))


def _note_rule(report_dir: Path, note: str) -> None:
    """Say in the re-run's parity.json (``judged_by``) and parity.txt which cache rule the
    published artifact was judged by."""
    path = report_dir / "parity.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    write_json_atomic(path, doc | {"judged_by": note})
    text = (report_dir / "parity.txt").read_text(encoding="utf-8")
    write_text_atomic(report_dir / "parity.txt", f"{text}\nThe published artifact was {note}.\n")


def published_programs(artifact: Path, manifest: Manifest) -> list[Program]:
    """The artifact's packages in call order, each checked against its manifest hash."""
    entries = [manifest.package, *(manifest.extra_packages or [])]
    for entry in entries:
        package = artifact / entry.file
        if not package.is_dir():
            raise InputError(f"{package}: the package the manifest names is missing")
        if mlpackage_content_hash(package) != entry.content_sha256:
            raise InputError(f"{package}: its content differs from the hash in manifest.json")
    if (manifest.kv_cache or {}).get("layout") == "per-function":
        # the task reads the other functions' packages from kv_cache.functions
        entries = entries[:1]
    pieces = [p.name for p in manifest.pieces or [] if p.runs_on != "host"] or ["main"]
    return [
        Program(piece, [], [], artifact / entry.file, None, collections.Counter())
        for piece, entry in zip(pieces, entries, strict=True)
    ]


def recheck(
    artifact: Path,
    out: Path | None = None,
    profiles: tuple[str, ...] | None = None,
    allow_pickle: bool = False,
    steps: Steps | None = None,
    device_evidence: Path | None = None,
) -> RecheckResult:
    """Re-run the torch and MIL gates of an artifact against its original checkpoint.

    Reports go to ``out`` (default: ``<artifact>.parity`` beside the artifact, so the
    published files and their hashes stay as they are). ``profiles`` selects the MIL
    evaluator profiles of a decoder (None: the recipe's, `mil_profiles`; encoders run fp32 per
    layer and fp16). ``device_evidence``: an ``anec device-check`` file of this artifact whose
    Core ML gates join the report (checked before anything runs: InputError for another
    artifact's).
    """
    progress = steps or Steps(quiet=True)
    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    if manifest.compression is not None:
        # Its package is not the fp16 program the recipe's gates judge: re-running them would
        # report failures that say nothing about the variant.
        raise InputError(
            f"{artifact}: a compressed variant (manifest.json: compression); anec parity "
            "re-runs the gates of an fp16 artifact only. The variant's own gates (level "
            "compression, against the fp16 model and the original) are in its parity.json; "
            "re-running them is not implemented"
        )
    device = read_evidence(device_evidence, artifact) if device_evidence else None
    recipe = recipe_from_manifest(manifest)
    published, rule_note = cache_rule(manifest, published_gates(artifact))
    if recipe.task != manifest.task:
        raise InputError(
            f"{artifact}: manifest recipe: task {recipe.task} disagrees with the manifest's "
            f"task {manifest.task}"
        )
    task = task_of(recipe)
    programs = published_programs(artifact, manifest)
    report_dir = out or artifact.parent / f"{artifact.name}.parity"
    report_dir.mkdir(parents=True, exist_ok=True)
    job = Job(
        recipe,
        checkpoint_source(manifest),
        report_dir,
        allow_pickle,
        expected_checkpoint_sha256=manifest.checkpoint["sha256"],
        expected_head_ids=(
            artifact / manifest.draft_vocabulary["head_ids"]["file"]
            if manifest.draft_vocabulary
            else None
        ),
    )
    run = task.start(job)
    run.programs = programs
    if isinstance(run, DecoderRun):
        run.profiles = mil_profiles(recipe, profiles)
    run_steps(task.recheck_steps, run, progress)
    report = run.report or ParityReport([], [], [], None, {})
    # Decoders run the chosen MIL profiles; encoders always run fp32 and fp16.
    ran = run.profiles if isinstance(run, DecoderRun) else tuple(PROFILES)
    rerun = {(g.name, g.implementation) for g in report.gates}
    if report.torch_fp16 != "run":  # on demand (a decoder whose program's fp16 gates passed)
        published = {key for key in published if key[1] != "torch-fp16"}
    if (report_dir / "parity.json").is_file():
        same_set = gate_set_gate(published, rerun, ran)
        _add_gate_to_reports(report_dir, report, same_set, f"anec parity report: {recipe.name}")
        for result in evidence_gates(device) if device else []:
            _add_gate_to_reports(report_dir, report, result, f"anec parity report: {recipe.name}")
    if rule_note is not None and (report_dir / "parity.json").is_file():
        _note_rule(report_dir, rule_note)
    document = json.loads((report_dir / "parity.json").read_text(encoding="utf-8"))
    document["artifact"] = str(artifact)
    return RecheckResult(report, report_dir, document)
