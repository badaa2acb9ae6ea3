"""The K-token extend against K single-token decode steps of a cached decoder, on the runtime
that runs the package (``anec bench-device ARTIFACT --extend-drift``).

The `kv_extend_argmax_flips` gate makes this comparison on the program as written, in anec's MIL
evaluator. What they cannot see is drift in a device's own fp16 accumulation between the
batched and the one-token path (CoreML-LLM saw acceptance fall to 0 % from it): this runs the
same comparison, with the same margin, through Core ML per compute units.

Per prompt: the runtime's own greedy continuation of ``steps`` tokens (so no reference model is
needed on the device), then the logits of every position decoded one token per call and
absorbed K tokens per ``extend`` call; the largest |difference| and the argmax flips where the
decode step's margin exceeds the gate's (the difference is
reported, not gated: SPEC 4).

The Core ML path is NEVER RUN HERE (no macOS on the machine anec is developed on); the MIL
path runs the identical loop and is what the tests exercise.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converter.drafts.host_loop import Runtime, greedy
from converter.errors import InputError
from converter.evidence.labels import Evidence
from parity.gate_registry import Worst, first_few, gate
from parity.kv_gates import LEVEL, MARGIN, decode_steps, extend_steps, extend_vs_decode
from parity.kv_session import CacheSession
from parity.reference import Continuation

DRIFT_FORMAT = "anec-extend-drift/1"


def fixture_prompts(runtime: Runtime) -> list[tuple[str, list[int]]]:
    """The artifact's fixture prompts as token ids (named prompt[i] / token_ids[i])."""
    fixtures = runtime.manifest["recipe"].get("fixtures") or {}
    out = [(f"token_ids[{i}]", list(ids)) for i, ids in enumerate(fixtures.get("token_ids") or [])]
    if runtime.tokenizer is not None:
        out += [
            (f"prompt[{i}]", list(runtime.tokenizer.encode(text).ids))
            for i, text in enumerate(fixtures.get("prompts") or [])
        ]
    return [(name, ids) for name, ids in out if ids]


def extend_drift(
    make_session: Callable[[], CacheSession],
    prompts: list[tuple[str, list[int]]],
    steps: int,
    extend_tokens: int,
) -> dict[str, Any]:
    """Extend (K tokens per call) against decode (one per call) on every prompt's greedy
    continuation: the ``kv_extend_argmax_flips`` gate (the decode step's margin: a device has
    no reference) and the largest |difference|, reported."""
    worst = Worst(0.0)
    flips: list[str] = []
    positions = 0
    finite = True
    for name, prompt in prompts:
        new = greedy(make_session, prompt, steps).new_ids
        c = Continuation(name, tuple(prompt), tuple(prompt) + tuple(new), np.empty((0, 0)))
        single = dict(decode_steps(make_session(), c, "prefill"))
        batched = dict(extend_steps(make_session(), c, "prefill", extend_tokens))
        finite &= all(bool(np.isfinite(v).all()) for v in [*single.values(), *batched.values()])
        flips += extend_vs_decode(single, batched, name, worst)
        positions += len(batched)
    flip_gate = gate(LEVEL, "kv_extend_argmax_flips")
    results = [flip_gate.check(len(flips), implementation="runtime", where=first_few(flips, 2))]
    return {
        "prompts": len(prompts),
        "positions": positions,
        "extend_tokens": extend_tokens,
        "margin": MARGIN,
        "finite": finite,
        # fp16 drift between the two paths: reported, not gated (SPEC 4, "Cached decoders")
        "max_abs_diff": worst.value,
        "max_abs_diff_at": worst.where,
        "gates": [r.to_json() for r in results],
        "flips": flips,
        "passed": finite and all(r.passed for r in results),
    }


def record_drift(artifact: Path, units: Sequence[str], steps: int, backend: str) -> dict[str, Any]:
    """The ``--extend-drift`` document: one result per compute units (coreml, macOS only) or
    one for the MIL evaluator's fp16 profile (mil)."""
    from converter.drafts.host_loop import coreml_backend, mil_backend

    runtime = Runtime.from_artifact(artifact)
    # The gate compares logits and exempts near ties by the top-2 margin; a program that
    # returns only its choice per chunk carries neither.
    runtime.require_logits("--extend-drift compares the logits of the K-token and 1-token paths")
    prompts = fixture_prompts(runtime)
    if not prompts:
        raise InputError(f"{artifact}: the manifest's recipe has no fixture prompts to run")
    k = int(runtime.functions["extend"].shape.tokens)
    results: dict[str, Any] = {}
    if backend == "mil":
        results["mil-fp16"] = extend_drift(mil_backend(runtime), prompts, steps, k)
        evidence = "the MIL evaluator's fp16 profile (the gate's own run), not a device"
    else:  # pragma: no cover - macOS only, never run here
        if platform.system() != "Darwin":
            raise InputError(
                "--extend-drift --backend coreml runs on Apple hardware and needs macOS; "
                "use --backend mil for the MIL evaluator's run"
            )
        for unit in units:
            results[unit] = extend_drift(coreml_backend(runtime, unit), prompts, steps, k)
        evidence = Evidence.OBSERVED.value
    return {
        "format": DRIFT_FORMAT,
        "evidence": evidence,
        "artifact": artifact.name,
        "backend": backend,
        "steps": steps,
        "results": results,
    }
