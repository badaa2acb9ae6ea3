"""Layer sensitivity and the mixed-bit search under a parity budget.

Search space (fixed, documented): every compressible weight tensor gets one candidate, method
x bits x group (``compress.candidates``): fp16 when 16 is in ``search.bits`` (default {16, 8,
6, 4}); for each of ``search.methods`` (default ``lut``) each width, per tensor and per group
of ``search.group_sizes`` output rows (``lut``: coremltools' k-means, the routine the emitted
program's palettes come from; ``skm``: sensitive k-means on the calibration text) or per row
(``gptq``, 4 and 8 bits).

1. Sensitivity, on the calibration text: for each weight and candidate, the mean
   KL(p_fp16 || p_quantized) over every real position with that one weight quantized and
   every other weight fp16 (torch fp32 arithmetic: fast, and isolates the weights).
2. Greedy path: each weight's candidates from largest to smallest stored bytes, those no
   smaller and no less sensitive than another left out; from the largest, repeatedly move the
   one weight whose next candidate costs the least sensitivity per byte saved; every step is
   a plan, ending at every weight's smallest.
3. Budget, on the held-out text (never the calibration text): top-1 agreement and mean KL
   against the fp16 model, measured on full fake-quantized models along the path by binary
   search for the smallest plan that meets it (the path's quality falls as it goes; each
   measured point is kept, so the report shows what was explored). Each uniform plan (every
   weight at one candidate) is measured too; the chosen plan is the smallest measured plan that
   meets the budget, uniform ones included (all-lut8 is not always on the greedy path).
4. The chosen plan is emitted and confirmed like any variant: torch and MIL level.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from converter.compression.methods.lut import palette  # noqa: F401  (tests import it from here)
from converter.compression.schemes import Scheme
from converter.compression.sites import WeightSite
from converter.recipe.compression_section import SearchSpace
from graph_passes.decoder import BC1LDecoder
from parity.decoder_gates import module_inputs
from parity.fixtures import Fixture, make_batches


@dataclass
class Scorer:
    """Runs the module on one batch of fixtures and compares with fixed baseline log-probs."""

    module: BC1LDecoder
    fixtures: list[Fixture]
    embed_table: torch.Tensor
    pad_id: int

    def __post_init__(self) -> None:
        length = self.module.io.length
        (self.batch,) = make_batches(self.fixtures, len(self.fixtures), length, self.pad_id)
        self.real = [
            (r, length - len(f.token_ids)) for r, f in enumerate(self.batch.fixtures)
        ]  # row, first real slot
        self.params = dict(self.module.named_parameters())
        x, key_mask = module_inputs(self.module, self.batch, self.embed_table, torch.float32)
        with torch.no_grad():
            self.masks = self.module.layer_masks(key_mask)  # a local layer's own window
            # The input of every layer with the weights as they are now: a weight of layer i
            # changes nothing before it, so a one-weight measurement starts at layer i.
            self.layer_inputs = [self.module.embed_bc1l(x)]
            for layer, mask in zip(self.module.decoder_layers()[:-1], self.masks, strict=False):
                self.layer_inputs.append(layer(self.layer_inputs[-1], mask))
        self.base = self.log_probs()

    def log_probs(self, first_layer: int = 0) -> torch.Tensor:
        """Log-softmax at every real position, (positions, V), fp32; layers before
        ``first_layer`` are taken from the cached inputs (their weights must be unchanged)."""
        with torch.no_grad():
            h = self.layer_inputs[first_layer]
            layers = self.module.decoder_layers()[first_layer:]
            for layer, mask in zip(layers, self.masks[first_layer:], strict=True):
                h = layer(h, mask)
            rows = [h[r : r + 1, :, :, start:] for r, start in self.real]
            logits = [torch.cat(self.module.head(row), dim=1)[0, :, 0].T for row in rows]
        return torch.cat(logits).log_softmax(-1)

    def compare(self, first_layer: int = 0) -> tuple[float, float]:
        """Mean KL(base || now) and top-1 agreement with the baseline."""
        now = self.log_probs(first_layer)
        kl = (self.base.exp() * (self.base - now)).sum(-1).clamp_min(0).mean()
        top1 = (now.argmax(-1) == self.base.argmax(-1)).float().mean()
        return float(kl), float(top1)

    def set(self, name: str, value: np.ndarray) -> None:
        """Put ``value`` into parameter ``name``."""
        with torch.no_grad():
            p = self.params[name]
            p.copy_(torch.from_numpy(np.asarray(value, np.float32)).reshape(p.shape))


@dataclass(frozen=True)
class Point:
    """One measured plan on the held-out slice (against the fp16 model)."""

    step: int | None  # position on the greedy path (0 = all fp16); None for a uniform plan
    weight_bytes: int  # stored bytes of the searched weights (palettes + indices)
    predicted_kl: float  # sum of the sensitivities of its choices
    mean_kl: float
    top1: float
    meets_budget: bool
    uniform_bits: int | None = None  # every weight at this width (measured for comparison)
    uniform: str | None = None  # every weight at this candidate, e.g. "lut4g32"


def smallest_meeting(points: list[Point]) -> Point:
    """The smallest measured plan that meets the budget, path and uniform plans alike (a
    uniform plan is not always on the greedy path; all-fp16, step 0, always meets it)."""
    meeting = [p for p in points if p.meets_budget]
    return min(meeting, key=lambda p: (p.weight_bytes, p.uniform is not None))  # path first


def _layer_of(name: str) -> int:
    """The decoder layer a weight belongs to (``layers.<i>.…``); 0 for anything else."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" and parts[1].isdigit() else 0


def search_plan(
    module: BC1LDecoder,
    sites: list[WeightSite],
    space: SearchSpace,
    calibration: list[Fixture],
    held_out: list[Fixture],
    embed_table: torch.Tensor,
    pad_id: int,
    log: Any = print,
    advance: Callable[[], None] = lambda: None,
) -> tuple[dict[str, Scheme], dict[str, Any]]:
    """Search a per-weight plan; returns it and the report (sensitivities, path, frontier).
    ``advance`` is called after each of the len(sites) x candidates sensitivity measurements."""
    from converter.compression.candidates import candidates, label

    start = time.perf_counter()
    options = candidates(space)
    lowered = [c for c in options if c is not None]
    tried = _quantize(module, sites, lowered, calibration, embed_table, pad_id)
    quantize_seconds = time.perf_counter() - start
    # the fp16 model (fp16-rounded weights, fp32 arithmetic) every candidate is judged against
    work = copy.deepcopy(module).eval()
    params = dict(work.named_parameters())
    with torch.no_grad():
        for name, value in tried.fp16.items():
            params[name].copy_(torch.from_numpy(value.astype(np.float32)))
    calib = Scorer(work, calibration, embed_table, pad_id)
    tried.sensitivity = _sensitivities(calib, sites, [label(c) for c in lowered], tried, advance)
    log(f"sensitivity: {len(sites)} weights x {len(lowered)} candidates measured")

    path = _greedy_path(sites, [label(c) for c in options], tried)
    scorer = Scorer(work, held_out, embed_table, pad_id)
    points = _measure_path(scorer, path, tried, space.budget, log)
    uniform, plans = _measure_uniform(scorer, sites, lowered, tried, space.budget, log)
    pick = smallest_meeting([*points.values(), *uniform.values()])
    if pick.uniform is not None:
        chosen = plans[pick.uniform]
    else:
        assert pick.step is not None  # a path point
        chosen = path[pick.step]
    plan = {n: tried.scheme_of[(n, c)] for n, c in chosen.items() if c != "fp16"}
    explored = sorted([*points.values(), *uniform.values()], key=lambda p: p.weight_bytes)
    doc = {
        **_space_doc(space, [label(c) for c in options], len(sites)),
        "sensitivity": {
            "measured_on": "calibration text, every real position; one weight quantized, the "
            "rest fp16; mean KL(p_fp16 || p_quantized), nats",
            "table": tried.sensitivity,
        },
        "path_length": len(path),
        "explored": [vars(p) for p in explored],
        "frontier": [vars(p) for p in _frontier(explored)],
        "uniform": {
            tag: {"weight_bytes": u.weight_bytes, "mean_kl": u.mean_kl, "top1": u.top1}
            for tag, u in uniform.items()
        },
        "chosen": {
            "step": pick.step,
            "uniform": pick.uniform,
            "weight_bytes": tried.size(chosen),
            "counts": dict(Counter(chosen.values())),
            "bits": chosen,
            "meets_budget": pick.meets_budget,
        },
    }
    # In convert.log, not the reports (a time would make them differ run to run).
    total = time.perf_counter() - start
    log(f"mixed-bit search: palettes {quantize_seconds:.1f} s, {total:.1f} s in all")
    return plan, doc


def _space_doc(space: SearchSpace, tags: list[str], weights: int) -> dict[str, Any]:
    """The report's search space and budget: what was searched, judged against what."""
    return {
        "search_space": {
            "bits": list(space.bits),
            "methods": list(space.methods),
            "group_sizes": list(space.group_sizes),
            "candidates": tags,
            "unit": "one candidate (method x bits x group) per weight tensor; " + _summaries(),
            "weights": weights,
        },
        "budget": {
            "against": "the fp16 model (torch fp32 arithmetic, fp16-rounded weights) on the "
            "held-out slice",
            "min_top1_agreement": space.budget.min_top1_agreement,
            "max_mean_kl": space.budget.max_mean_kl,
        },
    }


@dataclass
class _Tried:
    """Every weight's values under each candidate that fits it (keyed by weight name and
    candidate label), their schemes and stored bytes, and (once measured) their sensitivity."""

    fp16: dict[str, np.ndarray]
    quantized: dict[tuple[str, str], np.ndarray]
    scheme_of: dict[tuple[str, str], Scheme]  # a grid candidate's scheme is per weight
    size_of: dict[tuple[str, str], int]
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)

    def values(self, name: str, tag: str) -> np.ndarray:
        return self.fp16[name] if tag == "fp16" else self.quantized[(name, tag)]

    def size(self, plan: dict[str, str]) -> int:
        return sum(self.size_of[(n, c)] for n, c in plan.items())

    def predicted(self, plan: dict[str, str]) -> float:
        return sum(self.sensitivity[n][c] for n, c in plan.items())


def _quantize(
    module: BC1LDecoder,
    sites: list[WeightSite],
    lowered: list[Any],
    calibration: list[Fixture],
    embed_table: torch.Tensor,
    pad_id: int,
) -> _Tried:
    """Every site's values under every candidate that fits it."""
    from converter.compression.candidates import candidate_values, fits, label, stored_bytes

    by_name = {s.name: s for s in sites}
    # fp16-rounded weights, as the fp16 program holds them (fp32 arithmetic)
    fp16 = {s.name: module.get_parameter(s.name).detach().half().numpy() for s in sites}
    quantized: dict[tuple[str, str], np.ndarray] = {}
    scheme_of: dict[tuple[str, str], Scheme] = {}
    for c in lowered:
        fitting = [s for s in sites if fits(s, c)]
        values = candidate_values(c, fitting, fp16, module, calibration, embed_table, pad_id)
        for n, (scheme, v) in values.items():
            quantized[(n, label(c))] = v
            scheme_of[(n, label(c))] = scheme
    size_of = {(s.name, "fp16"): stored_bytes(s, None) for s in sites}
    size_of |= {(n, tag): stored_bytes(by_name[n], c) for (n, tag), c in scheme_of.items()}
    return _Tried(fp16, quantized, scheme_of, size_of)


def _sensitivities(
    calib: Scorer,
    sites: list[WeightSite],
    tags: list[str],
    tried: _Tried,
    advance: Callable[[], None],
) -> dict[str, dict[str, float]]:
    """Mean KL on the calibration text with one weight at a candidate, the rest fp16."""
    sensitivity: dict[str, dict[str, float]] = {}
    for site in sites:
        sensitivity[site.name] = {"fp16": 0.0}
        for tag in tags:
            if (site.name, tag) in tried.quantized:
                calib.set(site.name, tried.quantized[(site.name, tag)])
                sensitivity[site.name][tag] = calib.compare(_layer_of(site.name))[0]
            advance()
        calib.set(site.name, tried.fp16[site.name])
    return sensitivity


def _greedy_path(sites: list[WeightSite], tags: list[str], tried: _Tried) -> list[dict[str, str]]:
    """Plans from every weight at its largest candidate to every weight at its smallest,
    moving one weight a step at a time: the one whose next step costs the least sensitivity
    per byte saved."""
    sensitivity, size_of = tried.sensitivity, tried.size_of

    def ladder(name: str) -> list[str]:
        """The weight's candidates from largest to smallest, dominated ones left out (a
        candidate no smaller and no less sensitive than another never helps)."""
        mine = [t for t in tags if t in sensitivity[name]]
        mine.sort(key=lambda t: (-size_of[(name, t)], sensitivity[name][t]))
        kept: list[str] = []
        for t in reversed(mine):  # smallest first: keep what beats every smaller one
            if not kept or sensitivity[name][t] < min(sensitivity[name][k] for k in kept):
                kept.append(t)
        return kept[::-1]

    ladders = {s.name: ladder(s.name) for s in sites}
    choice = {n: steps[0] for n, steps in ladders.items()}
    path = [dict(choice)]
    while True:
        best: tuple[float, str, str] | None = None
        for name, now in choice.items():
            steps = ladders[name]
            i = steps.index(now)
            if i + 1 >= len(steps):
                continue
            nxt = steps[i + 1]
            saved = size_of[(name, now)] - size_of[(name, nxt)]
            sens = sensitivity[name]
            cost = max(sens[nxt] - sens[now], 0.0) / max(saved, 1)
            if best is None or cost < best[0]:
                best = (cost, name, nxt)
        if best is None:
            return path
        choice[best[1]] = best[2]
        path.append(dict(choice))


def _measure_path(
    scorer: Scorer, path: list[dict[str, str]], tried: _Tried, budget: Any, log: Any
) -> dict[int, Point]:
    """Binary search along the path for the last step that meets the budget on the held-out
    text (step 0, all fp16, always does), then a few more points for the report's frontier."""
    points: dict[int, Point] = {}

    def measure(step: int) -> Point:
        if step not in points:
            for name, c in path[step].items():
                scorer.set(name, tried.values(name, c))
            kl, top1 = scorer.compare()
            ok = kl <= budget.max_mean_kl and top1 >= budget.min_top1_agreement
            plan = path[step]
            points[step] = Point(step, tried.size(plan), tried.predicted(plan), kl, top1, ok)
            log(
                f"  step {step:>4}: {points[step].weight_bytes / 2**20:7.2f} MiB  "
                f"KL {kl:.4f}  top-1 {top1:.3f}  {'meets' if ok else 'misses'} the budget"
            )
        return points[step]

    lo, hi = 0, len(path) - 1
    if measure(hi).meets_budget:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid).meets_budget:
            lo = mid
        else:
            hi = mid
    measure(0)
    for frac in (0.25, 0.5, 0.75):
        measure(int(frac * (len(path) - 1)))
    return points


def _measure_uniform(
    scorer: Scorer,
    sites: list[WeightSite],
    lowered: list[Any],
    tried: _Tried,
    budget: Any,
    log: Any,
) -> tuple[dict[str, Point], dict[str, dict[str, str]]]:
    """Every weight at one candidate, for each candidate every weight can take."""
    from converter.compression.candidates import label

    uniform: dict[str, Point] = {}
    plans: dict[str, dict[str, str]] = {}
    for c in lowered:
        tag = label(c)
        if not all((s.name, tag) in tried.quantized for s in sites):
            continue  # a group size some weight cannot take: no uniform plan
        plans[tag] = {s.name: tag for s in sites}
        for name in plans[tag]:
            scorer.set(name, tried.quantized[(name, tag)])
        kl, top1 = scorer.compare()
        ok = kl <= budget.max_mean_kl and top1 >= budget.min_top1_agreement
        width = c.bits or None  # grid: each weight's own
        plan = plans[tag]
        point = Point(None, tried.size(plan), tried.predicted(plan), kl, top1, ok, width, tag)
        uniform[tag] = point
        log(
            f"  uniform {tag:>9}: {point.weight_bytes / 2**20:7.2f} MiB  KL {kl:.4f}  "
            f"top-1 {top1:.3f}  {'meets' if ok else 'misses'} the budget"
        )
    return uniform, plans


def _frontier(explored: list[Point]) -> list[Point]:
    """Pareto frontier (bytes vs KL) of points sorted by bytes: a plan stays if every smaller
    plan has a higher KL."""
    frontier, best_kl = [], float("inf")
    for p in explored:
        if p.mean_kl < best_kl:
            best_kl = p.mean_kl
            frontier.append(p)
    return frontier


def _summaries() -> str:
    """``lut: k-means palettes (coremltools), ...``: what each search method's candidate is."""
    from converter.compression import methods

    return ", ".join(f"{n}: {methods.get(n).search_summary}" for n in methods.search_methods())
