"""The MIL level for encoders and decision models: the emitted program(s) run by anec's MIL
evaluator.

Two uses, like the decoder's `parity.conversion`:

* ``fp32`` profile, per layer: each ``layer_<i>_out`` marker of the single (or island) program
  against the BC1L module holding the program's constants, computed in float64 - the
  conversion itself, gated with the recipe's ``mil_fp32_layer_rel_error`` (`program_level`);
* ``fp16`` profile, as a `Runner` for `check_encoder` (`output_runner`) / `check_decision`
  (`decision_mil_runner`): the task output gated against the original model like
  ``torch-fp16``;
* a decision tail's gather, fp32, against numpy on the island's own output
  (`tail_marker_rows_error`).

A program the evaluator cannot prepare (an op without a kernel, a missing marker) raises
`MILError` (`MarkerError`); `run_mil_level` records that as a failed gate, never as "not run".
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graph_passes.decision import OUTPUT_NAMES as DECISION_OUTPUTS
from graph_passes.decision_spec import DecisionHeadSpec
from graph_passes.encoder import BC1LEncoder, fold
from graph_passes.layer_norm import FP16_EPS_FLOOR
from graph_passes.markers import MarkerError, find_markers
from graph_passes.masks import key_mask_from_padding
from graph_passes.partition import ISLAND_OUTPUT, HostEmbedding
from parity.decision_gates import batch_positions
from parity.encoder_gates import embed
from parity.fixtures import Batch
from parity.mil.evaluator import Evaluator
from parity.mil.profiles import get_profile
from parity.mil.program import load_package
from parity.mil_fp32 import Fp32Check, Pair
from parity.model_copies import program_constants
from parity.result import OUTPUT, Outputs, Runner

# The program output holding each task output.
OUTPUT_NAMES = {
    "last-hidden-state": "last_hidden_state",
    "sentence-embedding": "sentence_embedding",
    "logits": "logits",
}
Feeds = dict[str, np.ndarray]


def encoder_feed(
    module: BC1LEncoder | None, host: HostEmbedding | None, batch: Batch, dtype: str
) -> tuple[Feeds, torch.Tensor]:
    """The first program's inputs for ``batch`` (``host``: the host embedding of an island
    program, None for one taking token ids, then ``module`` says whether it takes token
    types; ``dtype`` the program's float input type) and its key mask as the program
    receives it."""
    np_float = np.float16 if dtype == "float16" else np.float32
    key_mask = key_mask_from_padding(batch.attention_mask).numpy().astype(np_float)
    feeds: Feeds = {}
    if host is None:
        assert module is not None  # a program taking token ids: the module says which
        feeds["input_ids"] = batch.input_ids.numpy().astype(np.int32)
        if module.embedding.types is not None:
            feeds["token_type_ids"] = batch.segments.numpy().astype(np.int32)
    else:
        feeds["inputs_embeds"] = host(batch.input_ids, batch.segments).numpy().astype(np_float)
    feeds["key_mask"] = key_mask
    return feeds, torch.from_numpy(key_mask.astype(np.float32))


def _program_copy(module: BC1LEncoder, precision: str) -> BC1LEncoder:
    """The module with the constants the program stores (epsilon floors, fp16-rounded), fp64."""
    piece = copy.deepcopy(module)
    if precision == "float16":
        piece.set_eps_floor(FP16_EPS_FLOOR)  # before rounding: the floors are buffers too
    return program_constants(piece, precision).double()


def layer_level(
    package: Path,
    module: BC1LEncoder,
    host: HostEmbedding | None,
    batches: list[Batch],
    dtype: str,
    precision: str,
    layer_name: Callable[[int], str] = "layer {}".format,
) -> Fp32Check:
    """Run ``package`` (the single or island program) in the ``fp32`` profile and compare each
    marked layer output (named by ``layer_name``) with the module's, at real slots only.
    Raises `MarkerError` when the program lost a layer marker."""
    program = load_package(package)
    markers = _layer_outputs(program.functions["main"], module, host)
    evaluator = Evaluator(program, get_profile("fp32"))
    baseline = _program_copy(module, precision)

    def pairs() -> Iterator[Pair]:
        for batch in batches:
            feeds, key_mask = encoder_feed(module, host, batch, dtype)
            result = evaluator.run(feeds, capture=markers)
            with torch.no_grad():
                if host is None:
                    h = embed(baseline, batch)
                else:
                    h = fold(torch.from_numpy(feeds["inputs_embeds"].astype(np.float64)))
                states = baseline.run_layers(h, key_mask.double())
            real = batch.attention_mask.reshape(-1).bool().numpy()  # slot b*L + l
            assert real.shape[0] == module.io.slots == module.io.length * module.io.batch
            for i, marker in enumerate(markers):
                got = np.asarray(result.captured[marker], dtype=np.float64)[0, :, 0][:, real]
                yield Pair(got, states[i][0, :, 0].numpy()[:, real], layer_name(i), i)

    return Fp32Check.of(len(markers), pairs())


def _layer_outputs(function: Any, module: BC1LEncoder, host: HostEmbedding | None) -> list[str]:
    """The names of each layer's output in ``function``. A post-norm encoder's island (no final
    norm) returns its last layer's output itself: the program calls that value by its output
    name, ``hidden``, not by its marker."""
    count = len(module.layers)
    try:
        return find_markers(function, count)
    except MarkerError:
        outputs = [var.name for var in function.outputs]
        if host is None or module.final_norm is not None or outputs != [ISLAND_OUTPUT]:
            raise
    return find_markers(function, count - 1) + [ISLAND_OUTPUT]


def evaluators(packages: dict[str, Path], profile: str) -> dict[str, Any]:
    """An evaluator per piece (``main``, or ``island`` and ``tail``) in ``profile``. Raises
    `parity.mil.errors.MILError` if a program cannot be prepared."""
    return {k: Evaluator(load_package(p), get_profile(profile)) for k, p in packages.items()}


def pieces_runner(
    evaluators: dict[str, Any], feed: Callable[[Batch], Feeds],
    tail_feed: Callable[[Batch, Feeds, Any], Feeds] | None, names: dict[str, str],
) -> Runner:  # fmt: skip
    """The ``main`` program, or ``island`` then (when there is one) ``tail`` on
    ``tail_feed(batch, feeds, island's hidden)``, as a `Runner` whose outputs are the
    programs' ``names`` (runner name -> program output), fp32."""

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        feeds = feed(batch)
        out = (evaluators.get("main") or evaluators["island"]).run(feeds).outputs
        if tail_feed is not None and "tail" in evaluators:
            out = evaluators["tail"].run(tail_feed(batch, feeds, out[ISLAND_OUTPUT])).outputs
        return None, {k: torch.from_numpy(np.asarray(out[v], np.float32)) for k, v in names.items()}

    return run


def output_runner(
    packages: dict[str, Path],
    module: BC1LEncoder,
    host: HostEmbedding | None,
    dtype: str,
    pieces: dict[str, Any] | None = None,
) -> Runner:
    """An encoder's emitted program(s) in the ``fp16`` profile as a `Runner` for
    `check_encoder`: ``{"main": path}`` or ``{"island": path, "tail": path}`` (``tail``
    absent for feature extraction). ``pieces``: something else that runs each piece
    (``run(feeds).outputs``, e.g. Core ML's predictions) instead of the evaluator."""
    return pieces_runner(
        pieces if pieces is not None else evaluators(packages, "fp16"),
        lambda batch: encoder_feed(module, host, batch, dtype)[0],
        lambda _, feeds, hidden: {ISLAND_OUTPUT: hidden, "key_mask": feeds["key_mask"]},
        {OUTPUT: OUTPUT_NAMES[module.io.output]},
    )


# ---- decision models: host embedding -> island -> tail ---------------------------------------


def _tail_feed(batch: Batch, spec: DecisionHeadSpec, hidden: Any) -> Feeds:
    """A decision tail's inputs: the island's hidden state and (marker heads) the positions."""
    feeds = {ISLAND_OUTPUT: hidden}
    positions = batch_positions(batch, spec)
    if positions is not None:
        feeds["candidate_positions"] = positions.numpy().astype(np.int32)
    return feeds


def decision_mil_runner(
    packages: dict[str, Path],
    host: HostEmbedding,
    spec: DecisionHeadSpec,
    dtype: str,
    pieces: dict[str, Any] | None = None,
) -> Runner:
    """A decision model's island and tail programs in the ``fp16`` profile, fed the host
    embedding (numpy, as the runtime), as a `Runner` for `check_decision` (``pieces``: as
    `output_runner`'s)."""
    return pieces_runner(
        pieces if pieces is not None else evaluators(packages, "fp16"),
        lambda batch: encoder_feed(None, host, batch, dtype)[0],
        lambda batch, _, hidden: _tail_feed(batch, spec, hidden), {k: k for k in DECISION_OUTPUTS},
    )  # fmt: skip


def tail_marker_rows_error(
    tail_package: Path, island_package: Path, host: HostEmbedding, spec: DecisionHeadSpec,
    batches: list[Batch], dtype: str,
) -> tuple[float, str]:  # fmt: skip
    """The tail program in the ``fp32`` profile on the island program's own output (fp32
    profile): its ``marker_rows`` against the rows gathered in numpy at the requests'
    positions, worst relative error and where. The gather is exact, so anything above
    rounding is a wrong index (an offset, a wrong batch stride) in the emitted tail."""
    programs = evaluators({"island": island_package, "tail": tail_package}, "fp32")
    np_float = np.float16 if dtype == "float16" else np.float32
    check = Fp32Check([])
    for batch in batches:
        island = programs["island"].run(encoder_feed(None, host, batch, dtype)[0])
        feeds = _tail_feed(batch, spec, np.asarray(island.outputs[ISLAND_OUTPUT]).astype(np_float))
        b, length = batch.input_ids.shape
        starts = np.arange(b)[:, None] * length
        positions = feeds.get("candidate_positions")
        slots = starts if positions is None else positions + starts  # CLS: each row's first
        got = np.asarray(programs["tail"].run(feeds).outputs["marker_rows"], dtype=np.float64)
        table = feeds[ISLAND_OUTPUT].astype(np.float64)[0, :, 0, :].T  # (B*L, D)
        for r, fixture in enumerate(batch.fixtures):
            check.see(Pair(got[r], table[slots[r]], f"marker_rows, {fixture.name}"))
    return check.output.value, check.output.where
