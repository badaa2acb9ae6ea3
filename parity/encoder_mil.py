"""The MIL level for encoders: the emitted program(s) run by anec's MIL evaluator.

Two uses, like the decoder's `parity.conversion`:

* ``fp32`` profile, per layer: each ``layer_<i>_out`` marker of the single (or island) program
  against the BC1L module holding the program's constants, computed in float64 - the
  conversion itself, gated with the recipe's ``mil_fp32_layer_rel_error``;
* ``fp16`` profile, as a `Runner` for `check_encoder`: the task output gated against the
  original model like ``torch-fp16``.

A program the evaluator cannot prepare (an op without a kernel, a missing marker) raises
`MILError`; the pipeline records that as a failed gate, never as "not run".
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from graph_passes.encoder import BC1LEncoder, fold
from graph_passes.layer_norm import FP16_EPS_FLOOR
from graph_passes.markers import find_markers
from graph_passes.masks import key_mask_from_padding
from graph_passes.partition import HostEmbedding
from parity.fixtures import Batch
from parity.mil.evaluator import Evaluator
from parity.mil.profiles import get_profile
from parity.mil.program import load_package
from parity.result import OUTPUT, Outputs, Runner

# The program output holding each task output.
OUTPUT_NAMES = {
    "last-hidden-state": "last_hidden_state",
    "sentence-embedding": "sentence_embedding",
    "logits": "logits",
}


@dataclass(frozen=True)
class LayerLevel:
    """The fp32 per-layer comparison: worst relative error per layer over real slots."""

    layer_rel_error: list[float]
    finite: bool
    markers: list[str]


def encoder_feed(
    module: BC1LEncoder, host: HostEmbedding | None, batch: Batch, dtype: str
) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """The first program's inputs for ``batch`` (``host``: the host embedding of an island
    program, None for one taking token ids; ``dtype`` the program's float input type) and its
    key mask as the program receives it."""
    np_float = np.float16 if dtype == "float16" else np.float32
    key_mask = key_mask_from_padding(batch.attention_mask).numpy().astype(np_float)
    feeds: dict[str, np.ndarray] = {}
    if host is None:
        feeds["input_ids"] = batch.input_ids.numpy().astype(np.int32)
        if module.embedding.types is not None:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
    else:
        feeds["inputs_embeds"] = host(batch.input_ids, None).numpy().astype(np_float)
    feeds["key_mask"] = key_mask
    return feeds, torch.from_numpy(key_mask.astype(np.float32))


def _program_copy(module: BC1LEncoder, precision: str) -> BC1LEncoder:
    """The module with the constants the program stores (fp16-rounded, epsilon floors), fp64."""
    piece = copy.deepcopy(module).eval()
    if precision == "float16":
        piece.set_eps_floor(FP16_EPS_FLOOR)
        with torch.no_grad():
            for tensor in [*piece.parameters(), *piece.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(tensor.half().float())
    return piece.double()


def layer_level(
    package: Path,
    module: BC1LEncoder,
    host: HostEmbedding | None,
    batches: list[Batch],
    dtype: str,
    precision: str,
) -> LayerLevel:
    """Run ``package`` (the single or island program) in the ``fp32`` profile and compare each
    marked layer output with the module's, at real slots only. Raises `MarkerError` when the
    program lost a layer marker."""
    program = load_package(package)
    markers = find_markers(program.functions["main"], len(module.layers))
    evaluator = Evaluator(program, get_profile("fp32"))
    baseline = _program_copy(module, precision)
    length = module.io.length
    worst = [0.0] * len(markers)
    finite = True
    for batch in batches:
        feeds, key_mask = encoder_feed(module, host, batch, dtype)
        result = evaluator.run(feeds, capture=markers)
        with torch.no_grad():
            if host is None:
                ids = batch.input_ids
                types = torch.zeros_like(ids) if module.embedding.types is not None else None
                h = baseline.embed(ids, types)
            else:
                h = fold(torch.from_numpy(feeds["inputs_embeds"].astype(np.float64)))
            states = baseline.run_layers(h, key_mask.double())
        real = batch.attention_mask.reshape(-1).bool().numpy()  # slot b*L + l
        assert real.shape[0] == module.io.slots == length * module.io.batch
        for i, marker in enumerate(markers):
            got = np.asarray(result.captured[marker], dtype=np.float64)[0, :, 0][:, real]
            want = states[i][0, :, 0].numpy()[:, real]
            finite &= bool(np.isfinite(got).all())
            err = math.inf
            if np.isfinite(got).all():
                err = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
            worst[i] = max(worst[i], err)
    return LayerLevel(worst, finite, markers)


def output_runner(
    packages: dict[str, Path], module: BC1LEncoder, host: HostEmbedding | None, dtype: str
) -> Runner:
    """The emitted program(s) in the ``fp16`` profile as a `Runner` for `check_encoder`.

    ``packages``: ``{"main": path}`` or ``{"island": path, "tail": path}`` (``tail`` absent for
    feature extraction). Raises `parity.mil.errors.MILError` if a program cannot be prepared.
    """
    evaluators = {k: Evaluator(load_package(p), get_profile("fp16")) for k, p in packages.items()}
    out_name = OUTPUT_NAMES[module.io.output]

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        feeds, _ = encoder_feed(module, host, batch, dtype)
        if "main" in evaluators:
            out = evaluators["main"].run(feeds).outputs[out_name]
        else:
            island = evaluators["island"].run(feeds)
            if "tail" not in evaluators:
                out = island.outputs[out_name]
            else:
                tail_feeds = {"hidden": island.outputs["hidden"], "key_mask": feeds["key_mask"]}
                out = evaluators["tail"].run(tail_feeds).outputs[out_name]
        return None, {OUTPUT: torch.from_numpy(np.asarray(out, dtype=np.float32))}

    return run
