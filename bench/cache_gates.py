"""The cache gates alone, on an emitted cached decoder, in the MIL evaluator: time and peak.

    python bench/cache_gates.py ARTIFACT [--fixtures N] [--one-after-other [--rounds R]]

Rebuilds the artifact's reference continuations from its checkpoint (as ``anec device-check``
does), then runs `parity.kv_gates.check_kv` through the MIL evaluator's fp16 profile, as the
conversion's "parity through the cache" step does (the continuations side by side, their calls
in lockstep: `parity.lockstep`), without the conversion around it. Prints the wall time of the
gates, the process's resident memory before them and its largest value while they ran
(sampled every 50 ms from /proc/self/status, so a shorter spike can be missed), and every
gate's value: the same values as the artifact's kv_parity.json. ``--one-after-other`` runs the
gates with the continuations one after the other (each call alone) before each side-by-side
run, ``--rounds`` times (the host's speed drifts between runs: alternating shows it), in the
same process, and says whether every gate, flip and row is the same.

For issue 25 item 5 (the 5-minute SmolLM2 KV conversion): the evaluator's per-call costs,
measured on the cache gates' own calls, in one process, apart from the conversion's memory.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from memory_census import resident_gib

T = TypeVar("T")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--fixtures", type=int, help="only the first N fixtures")
    parser.add_argument(
        "--one-after-other", action="store_true", help="also run them one after the other"
    )
    parser.add_argument("--rounds", type=int, default=1, help="with --one-after-other")
    args = parser.parse_args()

    from converter.device.cached_check import continuations
    from converter.drafts.host_loop import Runtime, mil_backend
    from parity.kv_gates import KvParity, check_kv
    from parity.lockstep import Lockstep

    runtime = Runtime.from_artifact(args.artifact)
    references = continuations(runtime)[: args.fixtures]
    extend = int(runtime.functions["extend"].shape.tokens)

    def side_by_side() -> KvParity:
        lockstep = Lockstep()
        make = mil_backend(runtime, lockstep=lockstep)
        return check_kv(make, references, "prefill", extend, "mil-fp16", 0.03, lockstep)

    def one_after_other() -> KvParity:
        return check_kv(mil_backend(runtime), references, "prefill", extend, "mil-fp16", 0.03)

    n = len(references)
    for _ in range(args.rounds if args.one_after_other else 1):
        alone = timed(one_after_other, f"{n} fixtures one after the other") \
            if args.one_after_other else None  # fmt: skip
        result = timed(side_by_side, f"{n} fixtures side by side")
        if alone is not None:
            same = [g.to_json() for g in result.gates] == [g.to_json() for g in alone.gates]
            same &= (result.flips, result.rows) == (alone.flips, alone.rows)
            print(f"every gate, flip and row the same: {same}")
    for g in result.gates:
        print(f"  {g.text()}")


def timed(run: Callable[[], T], label: str) -> T:
    """``run()``, printing its wall time and the resident memory before and at most during."""
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_gib())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    before = resident_gib()
    sampler.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    print(f"{label}: {seconds:.1f} s; resident {before:.2f} GiB before, "
          f"{peak[0]:.2f} GiB at most while the gates ran")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
