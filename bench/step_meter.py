"""Run ``anec convert ...`` in this process and record, for each pipeline step, its wall time,
its CPU time and the process's peak RSS when it ends; and the checkpoint's parameter count.

    python bench/step_meter.py OUT.json convert RECIPE --out DIR --force --json

``bench/pipeline_steps.py`` runs it once per side with that side's tree first on
``PYTHONPATH``: it wraps the pipeline's step timer (``converter.pipeline.progress.Steps.step``) and
its
preflight from the outside, so an older revision is measured the same way as the working tree.
CPU time is the process's user + system time over the step (every thread): on a shared machine
it is the firmer figure. The peak is ``ru_maxrss`` so far: a step whose value rises above the
one before it set the new peak.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def main() -> None:
    """Wrap the step timer and the preflight, then run anec's CLI on the remaining arguments."""
    out = Path(sys.argv[1])
    from converter.pipeline.runlog import route_library_output

    route_library_output()  # as the CLI does before torch: no coremltools bars on stderr
    import converter.pipeline.progress as progress
    import converter.pipeline.run as pipeline
    from converter.commands import main as anec

    doc: dict[str, Any] = {"steps": [], "n_parameters": None}
    step = progress.Steps.step
    preflight = pipeline.preflight

    def save() -> None:
        out.write_text(json.dumps(doc, indent=1) + "\n")

    @contextlib.contextmanager
    def metered(self: Any, name: str, total: int | None = None) -> Iterator[Any]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with step(self, name, total) as advance:
                yield advance
        finally:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
            doc["steps"].append(
                {
                    "step": name,
                    "wall_s": time.perf_counter() - wall,
                    "cpu_s": time.process_time() - cpu,
                    "peak_rss_gib": peak,
                }
            )
            save()

    def counted(*args: Any, **kwargs: Any) -> Any:
        report = preflight(*args, **kwargs)
        doc["n_parameters"] = getattr(report, "n_parameters", None)
        save()
        return report

    progress.Steps.step = metered  # type: ignore[method-assign]
    pipeline.preflight = counted  # type: ignore[assignment]
    anec(sys.argv[2:])  # click exits with anec's exit code


if __name__ == "__main__":
    main()
