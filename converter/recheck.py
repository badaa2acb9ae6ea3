"""``anec parity``: re-run every parity gate on a published artifact.

The artifact's manifest names the checkpoint (with its hash) and holds the whole recipe, so
the BC1L module, the fixtures and the reference runs are rebuilt exactly; the saved package is
then run by the MIL evaluator like ``anec convert`` runs it before publishing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from converter.checkpoint import load_checkpoint
from converter.errors import InputError
from converter.hashing import mlpackage_content_hash
from converter.manifest import Manifest
from converter.pipeline import reference_runs, rewrite_decoder
from converter.progress import Steps
from converter.recipe import DecoderRecipe, Recipe, ResolvedSource, recipe_from_dict
from parity.conversion import DEFAULT_PROFILES, ConversionReport, check_conversion
from parity.gates import ParityReport, Thresholds, check_decoder
from parity.report_files import merge, write_parity_reports


@dataclass
class RecheckResult:
    """The re-run gates, where the reports went, and the JSON document."""

    report: ParityReport
    conversion: ConversionReport
    report_dir: Path
    document: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0 when every gate passed, else 1."""
        return 0 if self.report.passed else 1


def read_manifest(artifact: Path) -> Manifest:
    """The artifact's manifest; InputError when it is missing or not an anec manifest."""
    path = artifact / "manifest.json"
    if not path.is_file():
        raise InputError(f"{artifact}: no manifest.json; expected a directory from anec convert")
    try:
        return Manifest.model_validate_json(path.read_text(encoding="utf-8"))
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


def recheck(
    artifact: Path,
    out: Path | None = None,
    profiles: tuple[str, ...] = DEFAULT_PROFILES,
    allow_pickle: bool = False,
    steps: Steps | None = None,
) -> RecheckResult:
    """Re-run the torch and MIL gates of a decoder artifact against its original checkpoint.

    Reports go to ``out`` (default: ``<artifact>.parity`` beside the artifact, so the
    published files and their hashes stay as they are).
    """
    steps = steps or Steps(quiet=True)
    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    if manifest.task != "text-generation":
        raise InputError(
            f"{artifact}: anec parity re-checks decoder artifacts (task text-generation); "
            f"this one is {manifest.task}"
        )
    recipe = recipe_from_manifest(manifest)
    if not isinstance(recipe, DecoderRecipe):  # the recipe's task disagrees with the manifest's
        raise InputError(f"{artifact}: manifest recipe: task {recipe.task} is not text-generation")
    package = artifact / manifest.package.file
    if not package.is_dir():
        raise InputError(f"{package}: the package the manifest names is missing")
    if mlpackage_content_hash(package) != manifest.package.content_sha256:
        raise InputError(f"{package}: its content differs from the hash in manifest.json")
    source = checkpoint_source(manifest)

    with steps.step("load checkpoint"):
        ckpt = load_checkpoint(source, recipe.task, allow_pickle=allow_pickle)
    if ckpt.sha256 != manifest.checkpoint["sha256"]:
        raise InputError(
            f"{source.directory}: the checkpoint differs from the one {artifact.name} was "
            f"converted from (sha256 {ckpt.sha256[:12]}..., manifest "
            f"{manifest.checkpoint['sha256'][:12]}...)"
        )
    with steps.step("rewrite to BC1L"):
        rewrite = rewrite_decoder(recipe, ckpt)
    thresholds = Thresholds(**recipe.gates.parity_thresholds())
    total = len(rewrite.fixtures) + len(rewrite.batches)
    with steps.step("parity (torch fp32, fp16)", total=total) as advance:
        references = reference_runs(ckpt, rewrite, advance)
        report = check_decoder(
            rewrite.module, rewrite.batches, references, rewrite.embed_table, thresholds, advance
        )
    del ckpt.model
    total = len(profiles) * len(rewrite.batches)
    with steps.step(f"parity (MIL: {', '.join(profiles)})", total=total) as advance:
        conversion = check_conversion(
            package,
            rewrite.module,
            rewrite.batches,
            references,
            rewrite.embed_table,
            thresholds,
            recipe.precision,
            profiles,
            advance,
        )
    merge(report, conversion)
    report_dir = out or artifact.parent / f"{artifact.name}.parity"
    report_dir.mkdir(parents=True, exist_ok=True)
    document = write_parity_reports(
        report_dir, report, conversion, {"recipe": recipe.name, "artifact": str(artifact)}
    )
    return RecheckResult(report, conversion, report_dir, document)
