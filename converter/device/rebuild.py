"""An artifact's task run rebuilt as ``anec parity`` rebuilds it: the manifest's recipe, its
checkpoint loaded (its hash checked against the manifest) and the first steps run."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from converter.pipeline.manifest import Manifest


def rebuilt_run(manifest: Manifest, steps: Sequence[Callable[[Any, Any], Any]]) -> Any:
    """The task run of ``manifest``'s recipe after ``steps`` (each ``step(run, advance)``)."""
    from converter.evidence.recheck import checkpoint_source, recipe_from_manifest
    from converter.tasks import task_of
    from converter.tasks.shared import Job

    recipe = recipe_from_manifest(manifest)
    with tempfile.TemporaryDirectory(prefix="anec-device-") as scratch:
        job = Job(recipe, checkpoint_source(manifest), Path(scratch),
                  expected_checkpoint_sha256=manifest.checkpoint["sha256"])  # fmt: skip
        run = task_of(recipe).start(job)
        for step in steps:
            step(run, lambda: None)
    return run
