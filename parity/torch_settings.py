"""How torch runs while the parity steps run the models (fixtures, references): on one thread,
and with fp16 1x1 convolutions through `parity.fp16_conv` (torch's own bits, faster).

The parity steps issue tens of thousands of small tensor ops (one attention head of a 64-token
window at a time, norms over a few hundred channels). Measured on SmolLM2 on the 2-core machine
with other work running: one BC1L fp32 forward took 1.1 s wall and 0.28 s CPU with one torch
thread, 15.2 s wall and 4.8 s CPU with two, the second thread's spin-waiting burning more than
it computes; fp16: 3.4 s against 12.0 s. The evaluator limits BLAS the same way
(``parity.mil.evaluator.BlasThreads``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

import torch

from parity.fp16_conv import fast_fp16_convs

PARITY_THREADS = 1
# Where the torch levels ran, for their reports: torch picks its CPU kernels by instruction
# set, and its fp16 kernels sum in another order on an AVX2 host than on an AVX-512 one, so a
# torch-fp16 figure (and a near tie decided by it) can differ between hosts (bench/README.md,
# "Gemma 3 270M on 2026-12-02 (afternoon)"). The MIL evaluator's levels do not depend on it.
TORCH_CPU = (
    f"torch {torch.__version__} on the CPU ({torch.backends.cpu.get_cpu_capability()} kernels)"
)

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
