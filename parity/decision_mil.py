"""The MIL level for decision models: the island and the tail run by anec's MIL evaluator in
the fp16 profile, as a runner for `parity.decision_gates.check_decision` (the island's fp32
per-layer comparison is `parity.encoder_mil.layer_level`, unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from graph_passes.decision import OUTPUT_NAMES
from graph_passes.decision_spec import DecisionHeadSpec
from graph_passes.partition import HostEmbedding
from parity.conversion import rel_error_np
from parity.decision_gates import batch_positions
from parity.encoder_mil import Feeds, encoder_feed, pieces_runner
from parity.fixtures import Batch
from parity.gate import worst_of
from parity.mil.evaluator import Evaluator
from parity.mil.profiles import get_profile
from parity.mil.program import load_package
from parity.result import Runner


def _tail_feed(batch: Batch, spec: DecisionHeadSpec, hidden: Any) -> Feeds:
    """The tail's inputs: the island's hidden state and (marker heads) the positions."""
    feeds = {"hidden": hidden}
    positions = batch_positions(batch, spec)
    if positions is not None:
        feeds["candidate_positions"] = positions.numpy().astype(np.int32)
    return feeds


def _evaluators(packages: dict[str, Path], profile: str) -> dict[str, Any]:
    return {
        k: Evaluator(load_package(packages[k]), get_profile(profile)) for k in ("island", "tail")
    }


def decision_mil_runner(
    packages: dict[str, Path], host: HostEmbedding, spec: DecisionHeadSpec, dtype: str,
    profile: str = "fp16",
) -> Runner:  # fmt: skip
    """Host embedding (numpy, as the runtime) -> island program -> tail program. Raises
    `parity.mil.errors.MILError` if a program cannot be prepared."""
    return pieces_runner(
        _evaluators(packages, profile), lambda batch: encoder_feed(None, host, batch, dtype)[0],
        lambda batch, _, hidden: _tail_feed(batch, spec, hidden), {k: k for k in OUTPUT_NAMES},
    )  # fmt: skip


def tail_marker_rows_error(
    tail_package: Path, island_package: Path, host: HostEmbedding, spec: DecisionHeadSpec,
    batches: list[Batch], dtype: str,
) -> tuple[float, str]:  # fmt: skip
    """The tail program in the ``fp32`` profile on the island program's own output (fp32
    profile): its ``marker_rows`` against the rows gathered in numpy at the requests'
    positions, worst relative error and where. The gather is exact, so anything above
    rounding is a wrong index (an offset, a wrong batch stride) in the emitted tail."""
    programs = _evaluators({"island": island_package, "tail": tail_package}, "fp32")
    np_float = np.float16 if dtype == "float16" else np.float32
    errors = []
    for batch in batches:
        island = programs["island"].run(encoder_feed(None, host, batch, dtype)[0])
        feeds = _tail_feed(batch, spec, np.asarray(island.outputs["hidden"]).astype(np_float))
        b, length = batch.input_ids.shape
        starts = np.arange(b)[:, None] * length
        positions = feeds.get("candidate_positions")
        slots = starts if positions is None else positions + starts  # CLS: each row's first
        got = np.asarray(programs["tail"].run(feeds).outputs["marker_rows"], dtype=np.float64)
        table = feeds["hidden"].astype(np.float64)[0, :, 0, :].T  # (B*L, D)
        for r, fixture in enumerate(batch.fixtures):
            errors.append((rel_error_np(got[r], table[slots[r]]), f"marker_rows, {fixture.name}"))
    worst = worst_of(errors)
    return worst.value, worst.where
