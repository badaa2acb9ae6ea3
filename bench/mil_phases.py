"""Where a decoder's MIL parity step spends its time: run ``anec convert ...`` in this process
and time the parts of ``parity.conversion.check_conversion`` (wall and CPU seconds, calls).

    python bench/mil_phases.py convert smollm2-135m-draft --out DIR --force --json

The parts: loading the saved package, preparing each profile's evaluator, the fp64 module
baseline of the fp32 profile, each profile's evaluation (``Evaluator.run_many``, or ``run``
in a tree without it) and the relative errors (``rel_error_np``: numpy's ``linalg.norm``, whose
``ddot`` OpenBLAS runs on all cores). It wraps them from the outside, like
``bench/step_meter.py``, so an older tree on ``PYTHONPATH`` is measured the same way. CPU time
is the process's (every thread: BLAS threads waiting for a core count too).
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def main() -> None:
    """Wrap the parts, run anec's CLI on the arguments, print the table at exit."""
    import atexit

    import converter.tasks.text_generation as task
    import parity.conversion as conversion
    import parity.mil.evaluator as evaluator
    from converter.commands import main as anec

    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])

    def timed(owner: Any, name: str, label: Callable[..., str]) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = table[label(*args)]
                row[0] += time.perf_counter() - wall
                row[1] += time.process_time() - cpu
                row[2] += 1

        setattr(owner, name, inner)

    timed(task, "check_conversion", lambda *a: "check_conversion (all)")
    timed(conversion, "load_package", lambda *a: "load_package")
    timed(conversion, "fp64_baseline", lambda *a: "fp64 module baseline")
    timed(conversion, "rel_error_np", lambda *a: "rel_error_np")
    try:  # a tree with the one fp32 check compares the fp32 profile's values there
        import parity.mil_fp32 as mil_fp32

        timed(mil_fp32, "rel_error_np", lambda *a: "rel_error_np")
    except ImportError:
        pass
    timed(evaluator.Evaluator, "_prepare", lambda ev: f"prepare {ev.profile.name}")
    runs = "run_many" if hasattr(evaluator.Evaluator, "run_many") else "run"
    timed(evaluator.Evaluator, runs, lambda ev, *a: f"evaluate {ev.profile.name}")

    def show() -> None:
        print(f"{'part':<28}{'wall s':>9}{'CPU s':>9}{'calls':>7}", file=sys.stderr)
        for name, (wall, cpu, calls) in table.items():
            print(f"{name:<28}{wall:9.2f}{cpu:9.2f}{int(calls):7d}", file=sys.stderr)

    atexit.register(show)
    anec(sys.argv[1:])  # click exits with anec's exit code


if __name__ == "__main__":
    main()
