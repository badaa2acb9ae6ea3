"""Parity of the emitted program itself (the conversion level), for decoders.

The MIL evaluator runs the saved ``.mlpackage`` on the fixtures, in each numeric profile:

* ``mil-fp32`` against the BC1L torch module in fp32 *with the program's constants* (the
  module's parameters and buffers rounded to fp16 when the program stores fp16), per layer
  through the layer markers and on the logits: what coremltools made of the graph (lowering,
  fused ops, folded constants, clamped epsilons) must agree to ``mil_fp32_layer_rel_error``;
* ``mil-fp16`` against the original model: gated like torch fp16 (argmax agreement, max |dp|,
  finite), with KL, top-k overlap, the argmax certificate and the slices reported;
* ``mil-fp16-acc`` against the original model: the same figures, reported, not gated;
* ``mil-device-margin`` (opt-in, `parity.device_margin`): fp16-acc plus the per-op deviations
  others report for the NE, once per seed; gated on argmax agreement at the worst seed when
  the recipe sets ``gates.device_margin_argmax_agreement``;

and, on macOS only, Core ML's own predictions (the runtime level, `_runtime_level`); elsewhere
that level is marked not run.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graph_passes.decoder import BC1LDecoder
from graph_passes.logits_layout import join_logits
from graph_passes.markers import MarkerError, find_markers
from parity.decoder_fp32 import fp32_run, fp64_baseline, logit_slots
from parity.decoder_gates import module_inputs
from parity.device_margin import IMPLEMENTATION as DEVICE_MARGIN
from parity.device_margin import margin_gate
from parity.fixtures import Batch
from parity.gate_registry import Gated, GateResult, first_few, gate, worst_of
from parity.head_outputs import ChoiceCheck, run_many_capturing_logits
from parity.metrics import compare_positions, rel_error_np
from parity.mil import Evaluation, Evaluator, Profile, get_profile, load_package
from parity.mil.program import dtype_name
from parity.mil_level import Fp32Run, MilSubject, run_mil_level
from parity.profile_run import ProfileRun, device_margin_run
from parity.reference import ReferenceRun
from parity.thresholds import Thresholds

log = logging.getLogger(__name__)

DEFAULT_PROFILES = ("fp32", "fp16", "fp16-acc")
GATED_PROFILE = "fp16"
FP32_DETAIL = (
    "max over layers (and the logits) and fixtures of ||h'-h||/||h|| at real positions, "
    "against the BC1L module with the program's constants in fp64"
)


@dataclass
class ConversionReport(Gated):
    """Everything the conversion level measured, its gates, and the runtime level."""

    gates: list[GateResult]
    runs: list[ProfileRun]
    markers: list[str]
    runtime_status: str  # the Core ML level: run, or why not
    runtime: ProfileRun | None  # its run, when it ran
    length: int
    implementations: dict[str, str] = field(default_factory=dict)


def program_feed(
    dtypes: dict[str, str], module: BC1LDecoder, batch: Batch, embed_table: torch.Tensor
) -> tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]:
    """The program's inputs for a batch in their declared dtypes (``dtypes``: input name ->
    "fp16" / "fp32" / ..., in the program's order), and the same values as the torch
    module's inputs (an fp16 input reaches the module rounded to fp16 too)."""
    x, mask = module_inputs(module, batch, embed_table, torch.float32)
    (first, first_dtype), (second, second_dtype) = dtypes.items()
    feed: dict[str, np.ndarray] = {}
    if x.dtype == torch.int64:
        feed[first] = x.numpy().astype(np.int32)
    elif first_dtype == "fp16":
        feed[first] = x.half().numpy()
        x = x.half().float()
    else:
        feed[first] = x.numpy()
    if second_dtype == "fp16":
        feed[second] = mask.half().numpy()
        mask = mask.half().float()
    else:
        feed[second] = mask.numpy()
    return feed, x, mask


def input_dtypes(evaluator: Any) -> dict[str, str]:
    """An evaluator's input dtypes by name, for `program_feed`."""
    return {name: dtype for name, (dtype, _) in evaluator.inputs.items()}


def check_conversion(
    package: Path,
    module: BC1LDecoder,
    batches: list[Batch],
    references: dict[str, ReferenceRun],
    embed_table: torch.Tensor,
    thresholds: Thresholds,
    precision: str,
    profiles: Sequence[str | Profile] = DEFAULT_PROFILES,
    progress: Callable[[], None] = lambda: None,
) -> ConversionReport:
    """Run the emitted program in each profile (by name, or a `Profile` such as the
    device-margin profile with some of its deviations) and gate it; ``progress`` is called per
    batch."""
    program = load_package(package)
    specs = {name: dtype_name(var) for name, var in program.functions["main"].inputs.items()}
    n_layers = len(module.layers)
    try:
        markers = find_markers(program.functions["main"], n_layers)
        marker_problem = ""
    except MarkerError as e:
        markers, marker_problem = [], str(e)
    feeds = [program_feed(specs, module, batch, embed_table) for batch in batches]
    level = _Level(module, batches, feeds, markers, references, progress)
    runs: list[ProfileRun] = []
    first: list[Evaluator] = []  # the first profile's constants serve the others (same bits)

    def run_profile(profile: Profile) -> ProfileRun:
        evaluator = Evaluator(program, profile, like=first[0] if first else None)
        first[:] = first or [evaluator]
        # mil-fp32 against the module in fp64, every other profile against the reference
        if profile.name == "fp32":
            baseline = fp64_baseline(module, precision, [(x, mask) for _, x, mask in feeds])
            run = level.measure(evaluator, baseline)
        elif profile.deviations:  # once per seed, the worst seed per position kept
            ran = {r.implementation: r.positions for r in runs}
            measure = partial(level.measure, evaluator, None)
            fp16, acc = ran.get(f"mil-{GATED_PROFILE}", []), ran.get("mil-fp16-acc", [])
            run = device_margin_run(evaluator, measure, fp16, acc)
        else:
            run = level.measure(evaluator, None)
        runs.append(run)
        # In convert.log, not the reports: a time would make them differ run to run.
        log.info(
            "MIL evaluator, profile %s: %.1f s, %d batches", profile.name, run.seconds, len(batches)
        )
        return run

    chosen = [get_profile(name) if isinstance(name, str) else name for name in profiles]
    found = f"layer_0_out..layer_{n_layers - 1}_out found in the program"

    def fp32(tick: Callable[[], None]) -> Fp32Run:
        asked = [p for p in chosen if p.name == "fp32"]
        check = run_profile(asked[0]).fp32 if asked else None
        return Fp32Run(check, FP32_DETAIL, marker_problem, found)

    def fp16() -> list[GateResult]:
        for profile in chosen:
            if profile.name != "fp32":
                run_profile(profile)
        return _gates(runs, thresholds)

    mil = run_mil_level(MilSubject(fp32, fp16, thresholds.mil_fp32_layer_rel_error))
    first.clear()
    status, runtime_run = _runtime_level(package, module, batches, references, feeds)
    implementations = {run.implementation: run.description for run in runs}
    if mil.error:
        implementations["mil-fp32"] = f"failed: {mil.error}"
    if runtime_run is not None:
        implementations[RUNTIME] = runtime_run.description
    return ConversionReport(
        mil.gates, runs, markers, status, runtime_run, module.io.length, implementations
    )


@dataclass
class _Level:
    """What every profile's run reads: the module, fixtures, feeds, markers and references."""

    module: BC1LDecoder
    batches: list[Batch]
    feeds: list[tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]]
    markers: list[str]
    references: dict[str, ReferenceRun]
    progress: Callable[[], None]
    norms: dict[Any, float] = field(default_factory=dict)  # the reference's, for every profile

    def measure(
        self,
        evaluator: Evaluator,
        baseline: list[tuple[list[torch.Tensor], torch.Tensor]] | None,
        seed: int | None = None,
    ) -> ProfileRun:
        """Run ``evaluator`` on every batch and compare (with ``baseline``: against the
        module in fp64); ``seed`` names a device-margin run's seed."""
        module, profile = self.module, evaluator.profile
        no_choice = baseline is not None or module.io.output == "logits"
        choice = None if no_choice else ChoiceCheck(module.chunk_sizes)
        wheres = [", ".join(f.name for f in batch.fixtures) for batch in self.batches]
        start = time.perf_counter()
        inputs = [feed for feed, _, _ in self.feeds]
        results = run_many_capturing_logits(evaluator, inputs, self.markers, choice, wheres)
        seconds = time.perf_counter() - start
        description = f"anec MIL evaluator on the emitted program, profile {profile.name}: "
        implementation = f"mil-{profile.name}" + ("" if seed is None else f" seed {seed}")
        description += profile.description
        if baseline is None:
            run = _compare(implementation, description, module, self.batches, results,
                           self.markers, self.references, self.norms, self.progress)  # fmt: skip
        else:
            run = fp32_run(implementation, description, module, self.batches, results,
                            self.markers, baseline, self.progress)  # fmt: skip
        run.seconds, run.choice = seconds, choice
        return run


def _compare(
    implementation: str,
    description: str,
    module: BC1LDecoder,
    batches: list[Batch],
    results: list[Evaluation],
    markers: list[str],
    references: dict[str, ReferenceRun],
    norms: dict[Any, float],
    progress: Callable[[], None] = lambda: None,
) -> ProfileRun:
    """Each batch's outputs and captured layer markers against the reference; ``norms`` (the
    reference's, by fixture and layer) are filled by the first profile and read by the
    next."""
    length, n_logits = module.io.length, module.io.logit_positions
    run = ProfileRun(implementation, "reference", description, [0.0] * len(module.layers),
                     0.0, True)  # fmt: skip
    for batch, result in zip(batches, results, strict=True):
        joined = join_logits(result.outputs)  # (B, n, V)
        run.see(result, joined, markers)
        logits = torch.from_numpy(joined)
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            real = slice(length - n, length)
            positions, out_slice = logit_slots(n, length, n_logits)
            for i, marker in enumerate(markers):
                h = result.captured[marker][r, :, 0, real].T / module.spec.stream_scale
                want = references[fixture.name].hidden[i].numpy()
                error = rel_error_np(h, want, norms, (fixture.name, i))
                run.layer_rel_error[i] = max(run.layer_rel_error[i], error)
            cand = logits[r, out_slice]
            want_logits = references[fixture.name].logits[positions]
            run.positions += compare_positions(
                fixture.name, fixture.slice, n, positions, cand, want_logits
            )
            error = rel_error_np(cand, want_logits.numpy(), norms, (fixture.name, "logits"))
            run.logits_rel_error = max(run.logits_rel_error, error)
        progress()
    if not markers:
        run.layer_rel_error = [math.inf] * len(module.layers)
    return run


def _choice_gate(choice: ChoiceCheck | None) -> list[GateResult]:
    """The argmax / top-k program's gate (none for a logits program)."""
    if choice is None:
        return []
    return [
        gate("mil-fp16", "head_choice_mismatches").check(
            float(len(choice.mismatches)),
            where=first_few(choice.mismatches),
            detail=f"{choice.positions} positions: the ids the host combines from the argmax / "
            "top-k outputs against the top ids of the program's own logits",
        )
    ]


def _gates(runs: list[ProfileRun], thresholds: Thresholds) -> list[GateResult]:
    """The fp16 profiles' gates."""
    gates = []
    by_name = {run.implementation: run for run in runs}
    gated = by_name.get(f"mil-{GATED_PROFILE}")
    if gated is not None:
        gates += output_gates(gated, thresholds)
        gates.append(
            gate("mil-fp16", "finite_values").check(
                float(len(gated.non_finite_values)),
                where=first_few(gated.non_finite_values),
                detail="values computed by any op of the program, padded positions included",
            )
        )
    # Opt-in: recorded only when the recipe set the threshold (and so ran the profile).
    margin = by_name.get(DEVICE_MARGIN)
    threshold = thresholds.device_margin_argmax_agreement
    if margin is not None and margin.device_margin is not None and threshold is not None:
        gates.append(margin_gate(margin.device_margin, threshold))
    return gates


def output_gates(
    run: ProfileRun, thresholds: Thresholds, implementation: str | None = None
) -> list[GateResult]:
    """The fp16 gates on a run's outputs (argmax agreement, |dp|, finite, the in-program
    choice), under ``implementation`` (None: the gated MIL profile's own)."""
    summary = run.summary()
    kept = sum(r.argmax_kept for r in run.positions)
    flipped = sorted({r.fixture for r in run.positions if not r.argmax_kept})
    dprob = worst_of((r.abs_dprob, f"{r.fixture} position {r.position}") for r in run.positions)
    return [
        gate("mil-fp16", "fp16_argmax_agreement").check(
            summary.argmax_agreement if summary.positions else math.nan,
            thresholds.fp16_argmax_agreement,
            implementation=implementation,
            where=first_few(flipped),
            detail=f"{kept}/{summary.positions} real positions the program returns logits for",
        ),
        gate("mil-fp16", "fp16_max_abs_dprob").check(
            summary.max_abs_dprob,
            thresholds.fp16_max_abs_dprob,
            implementation=implementation,
            where=dprob.where,
            detail="softmax at T=1 over the whole vocabulary, real positions",
        ),
        gate("mil-fp16", "finite_outputs").check(
            float(run.finite),
            implementation=implementation,
            detail="every layer output and logit, padded positions included",
        ),
        *_choice_gate(run.choice),
    ]


# ---- the Core ML runtime level: predictions of the emitted package with CPU_AND_NE, macOS only --
# On any other platform it reports "not run on this platform" and produces no figures, never a
# substitute. Requesting CPU_AND_NE does not show where ops ran (SPEC section 5): these outputs
# say what Core ML computed, not which engine computed it.

NOT_RUN = "not run on this platform"
RUNTIME = "coreml-cpu-and-ne"  # the runtime level's implementation


def availability() -> tuple[bool, str]:
    """Whether Core ML can run here, and why not when it cannot."""
    system = f"{platform.system()} {platform.machine()}"
    if platform.system() != "Darwin":
        return False, f"{NOT_RUN} ({system}): Core ML predictions need macOS"
    try:
        import coremltools.libcoremlpython  # noqa: F401
    except ImportError as e:
        return False, f"{NOT_RUN} ({system}): coremltools cannot load Core ML: {e}"
    return True, f"Core ML on {system}, compute units CPU_AND_NE"


def _runtime_level(
    package: Path,
    module: BC1LDecoder,
    batches: list[Batch],
    references: dict[str, ReferenceRun],
    feeds: list[tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]],
) -> tuple[str, ProfileRun | None]:
    available, status = availability()
    if not available:
        return status, None
    if module.io.output != "logits":  # Core ML returns the outputs only: no logits to compare
        return f"{status}; not compared: io.output {module.io.output} returns no logits", None
    import coremltools as ct

    model: Any = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.CPU_AND_NE)
    description = f"Core ML predictions ({status}); placement not observed"
    return status, predicted_run(RUNTIME, description, model, module, batches, references, feeds)


def predicted_run(
    implementation: str,
    description: str,
    model: Any,
    module: BC1LDecoder,
    batches: list[Batch],
    references: dict[str, ReferenceRun],
    feeds: list[tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]],
) -> ProfileRun:
    """``model``'s predictions (anything with Core ML's ``predict``) on the program's feeds,
    against the reference as a profile run (outputs only: Core ML returns no layer values)."""
    start = time.perf_counter()
    predicted = [model.predict(feed) for feed, _, _ in feeds]
    results = [Evaluation({k: np.asarray(v) for k, v in p.items()}, {}) for p in predicted]
    seconds = time.perf_counter() - start
    run = _compare(implementation, description, module, batches, results, [], references, {})
    run.layer_rel_error, run.seconds = [], seconds
    return run
