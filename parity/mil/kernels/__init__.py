"""MIL op kernels in numpy, grouped by kind; importing this package registers them all."""

from parity.mil.kernels import (  # noqa: F401
    activations,
    compression,
    contraction,
    elementwise,
    indexing,
    normalization,
    reductions,
    shape,
    state,
)
