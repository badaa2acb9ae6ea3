"""How torch runs while the parity steps run the models (fixtures, references): on one thread,
and with fp16 1x1 convolutions through `parity.fp16_conv` (torch's own bits, faster).

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

from parity.fp16_conv import fast_fp16_convs

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


@contextmanager
def parity_torch() -> Iterator[None]:
    """Torch as the parity steps run it: `torch_threads()` and `fast_fp16_convs()`."""
    with torch_threads(), fast_fp16_convs():
        yield


def with_parity_torch(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside ``parity_torch()`` (for a pipeline step that runs the models)."""

    @wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with parity_torch():
            return fn(*args, **kwargs)

    return run
