"""How many threads torch uses while the parity steps run the models (fixtures, references).

The parity steps issue tens of thousands of small tensor ops (one attention head of a 64-token
window at a time, norms over a few hundred channels). Measured on SmolLM2 on the 2-core machine
with other work running: one BC1L fp32 forward took 1.1 s wall and 0.28 s CPU with one torch
thread, 15.2 s wall and 4.8 s CPU with two, the second thread's spin-waiting burning more than
it computes; fp16: 3.4 s against 12.0 s. The evaluator limits BLAS the same way
(``parity.mil.evaluator.blas_threads``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

import torch

PARITY_THREADS = 1

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def torch_threads(count: int | None = PARITY_THREADS) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, restored afterwards (None: as is)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_torch_threads(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside ``torch_threads()`` (for a pipeline step that runs the models)."""

    @wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch_threads():
            return fn(*args, **kwargs)

    return run
