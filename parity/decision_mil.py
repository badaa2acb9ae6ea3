"""The MIL level for decision models: the island and the tail run by anec's MIL evaluator in
the fp16 profile, as a runner for `parity.decision_gates.check_decision` (the island's fp32
per-layer comparison is `parity.encoder_mil.layer_level`, unchanged)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from graph_passes.decision import OUTPUT_NAMES
from graph_passes.decision_spec import DecisionHeadSpec
from graph_passes.masks import key_mask_from_padding
from graph_passes.partition import HostEmbedding
from parity.decision_gates import batch_positions
from parity.fixtures import Batch
from parity.mil.evaluator import Evaluator
from parity.mil.profiles import get_profile
from parity.mil.program import load_package
from parity.result import Outputs, Runner


def decision_mil_runner(
    packages: dict[str, Path], host: HostEmbedding, spec: DecisionHeadSpec, dtype: str,
    profile: str = "fp16",
) -> Runner:  # fmt: skip
    """Host embedding (numpy, as the runtime) -> island program -> tail program. Raises
    `parity.mil.errors.MILError` if a program cannot be prepared."""
    island = Evaluator(load_package(packages["island"]), get_profile(profile))
    tail = Evaluator(load_package(packages["tail"]), get_profile(profile))
    np_float = np.float16 if dtype == "float16" else np.float32

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        key_mask = key_mask_from_padding(batch.attention_mask).numpy().astype(np_float)
        rows = host(batch.input_ids, None).numpy().astype(np_float)
        hidden = island.run({"inputs_embeds": rows, "key_mask": key_mask}).outputs["hidden"]
        feeds = {"hidden": hidden}
        positions = batch_positions(batch, spec)
        if positions is not None:
            feeds["candidate_positions"] = positions.numpy().astype(np.int32)
        out = tail.run(feeds).outputs
        return None, {
            k: torch.from_numpy(np.asarray(out[k], dtype=np.float32)) for k in OUTPUT_NAMES
        }

    return run


def tail_marker_rows_error(
    tail_package: Path, island_package: Path, host: HostEmbedding, spec: DecisionHeadSpec,
    batches: list[Batch], dtype: str,
) -> tuple[float, str]:  # fmt: skip
    """The tail program in the ``fp32`` profile on the island program's own output (fp32
    profile): its ``marker_rows`` against the rows gathered in numpy at the requests'
    positions, worst relative error and where. The gather is exact, so anything above
    rounding is a wrong index (an offset, a wrong batch stride) in the emitted tail."""
    island = Evaluator(load_package(island_package), get_profile("fp32"))
    tail = Evaluator(load_package(tail_package), get_profile("fp32"))
    np_float = np.float16 if dtype == "float16" else np.float32
    worst, where = 0.0, ""
    for batch in batches:
        key_mask = key_mask_from_padding(batch.attention_mask).numpy().astype(np_float)
        rows = host(batch.input_ids, None).numpy().astype(np_float)
        hidden = island.run({"inputs_embeds": rows, "key_mask": key_mask}).outputs["hidden"]
        feeds = {"hidden": np.asarray(hidden).astype(np_float)}
        positions = batch_positions(batch, spec)
        length = batch.input_ids.shape[1]
        if positions is None:
            slots = np.arange(batch.input_ids.shape[0])[:, None] * length
        else:
            feeds["candidate_positions"] = positions.numpy().astype(np.int32)
            slots = positions.numpy() + np.arange(positions.shape[0])[:, None] * length
        got = np.asarray(tail.run(feeds).outputs["marker_rows"], dtype=np.float64)
        table = feeds["hidden"].astype(np.float64)[0, :, 0, :].T  # (B*L, D)
        for r, fixture in enumerate(batch.fixtures):
            want = table[slots[r]]
            err = float(np.linalg.norm(got[r] - want) / max(float(np.linalg.norm(want)), 1e-30))
            if not np.isfinite(got[r]).all():
                err = float("inf")
            if err > worst or (err != err):
                worst, where = err, f"marker_rows, {fixture.name}"
    return worst, where
