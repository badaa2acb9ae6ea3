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
from parity.decision_gates import DecisionRunner, Outputs, batch_positions
from parity.fixtures import Batch
from parity.mil.evaluator import Evaluator
from parity.mil.profiles import get_profile
from parity.mil.program import load_package


def decision_mil_runner(
    packages: dict[str, Path], host: HostEmbedding, spec: DecisionHeadSpec, dtype: str,
    profile: str = "fp16",
) -> DecisionRunner:  # fmt: skip
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
