"""The tests the placement rules run on one op: each returns why its rule applies, or None.

The table in ``converter.placement.rules`` refers to them; a rule with a new kind of condition adds
its test here. The thresholds the rules' conditions quote live here with their tests.
"""

from __future__ import annotations

from converter.placement.chips import Chip
from converter.placement.ops import FLOAT_DTYPES, Op, Tensor
from converter.placement.rule_model import Context, Test

COMPUTE_LAYER_TYPES = frozenset({"conv", "conv_transpose", "linear", "matmul", "einsum"})
TINY_GRAPH_LAYERS = 2  # "only 1-2 layer graphs stay on the CPU" (stablehlo-coreml PR #110)
MAX_RANK = 5
# Integer and bool activations leave the NE; int8/uint8 activations are the W8A8 path.
NE_INT_DTYPES = frozenset({"int8", "uint8"})
NON_NE_DTYPES = frozenset({"int16", "uint16", "int32", "uint32", "int64", "bool"})


def _runtime(op: Op) -> list[Tensor]:
    return [*op.inputs, *op.outputs]


def op_types(*names: str) -> Test:
    """A test matching ops of these MIL types (R-/O- rules on op families)."""
    wanted = frozenset(names)

    def test(op: Op, ctx: Context) -> str | None:
        return f"{op.op_type}" if op.op_type in wanted else None

    return test


def compute_units(op: Op, ctx: Context) -> str | None:
    """R-CU: compute units that exclude the NE."""
    if ctx.compute_units == "CPU_ONLY":
        return "compute units CPU_ONLY"
    if ctx.compute_units == "CPU_AND_GPU":
        return "compute units CPU_AND_GPU exclude the NE"
    return None


def model_size(op: Op, ctx: Context) -> str | None:
    """R-SIZE: stored weights over the chip's per-model NE budget."""
    size, budget = ctx.program.weight_bytes_stored, ctx.chip.model_budget_bytes
    if size > budget:
        where = f"the {budget / 1e9:.0f} GB NE budget on {ctx.chip.name}"
        return f"{size / 1e9:.2f} GB of weights exceed {where}"
    return None


def tiny_graph(op: Op, ctx: Context) -> str | None:
    """R-TINY: too few compute layers in the function for the NE to pay."""
    n = ctx.program.compute_layers
    if n <= TINY_GRAPH_LAYERS:
        return f"the program has {n} conv/linear/matmul op(s); 1-2 layer graphs stay on the CPU"
    return None


def control_flow(op: Op, ctx: Context) -> str | None:
    """R-CTRL: control flow (cond, while_loop) and what it holds."""
    if op.op_type in ("cond", "while_loop"):
        return f"{op.op_type} is control flow"
    if op.in_block_of in ("cond", "while_loop"):
        return f"inside a {op.in_block_of} block"
    return None


def dynamic(op: Op, ctx: Context) -> str | None:
    """R-DYN: a tensor with a symbolic dimension."""
    for t in _runtime(op):
        if not t.static:
            return f"{t.name} has a symbolic shape {_fmt(t.shape)}"
    return None


def fp32(op: Op, ctx: Context) -> str | None:
    """R-FP32: an op computing in fp32."""
    for t in _runtime(op):
        if t.dtype in FLOAT_DTYPES and t.dtype != "fp16":
            return f"{t.name} is {t.dtype}"
    return None


def integer(op: Op, ctx: Context) -> str | None:
    """R-INT: integer or bool activations (int8 / uint8 excepted)."""
    for t in _runtime(op):
        if t.dtype in NON_NE_DTYPES:
            return f"{t.name} is {t.dtype}"
    return None


def rank(op: Op, ctx: Context) -> str | None:
    """R-RANK: a tensor of rank above ``MAX_RANK``."""
    for t in _runtime(op):
        if t.rank > MAX_RANK:
            return f"{t.name} has rank {t.rank} > {MAX_RANK}"
    return None


def _axis_over_limit(t: Tensor, chip: Chip) -> str | None:
    """The first axis of ``t`` over the chip's limit (axis 0 is the batch and not limited)."""
    for axis, extent in enumerate(t.shape):
        if extent is None or (axis == 0 and t.rank > 1):
            continue
        limit = chip.max_channels if (t.rank == 4 and axis == 1) else chip.max_spatial
        if extent > limit:
            return f"{t.name} axis {axis} is {extent} > {limit} on {chip.name}"
    return None


_PROJECTIONS = frozenset({"conv", "linear", "matmul"})


def lm_head(op: Op, ctx: Context) -> str | None:
    """R-LMHEAD: a projection whose output axis is over the chip's limit."""
    if op.op_type not in _PROJECTIONS or not op.weight_bytes:
        return None
    for t in op.outputs:
        over = _axis_over_limit(t, ctx.chip)
        if over:
            return f"a projection to a wide axis: {over}"
    return None


def dims(op: Op, ctx: Context) -> str | None:
    """R-DIM: a tensor axis over the chip's limit."""
    for t in _runtime(op):
        over = _axis_over_limit(t, ctx.chip)
        if over:
            return over
    return None


def batched_activation_matmul(op: Op, ctx: Context) -> str | None:
    """R-BATCH: an activation x activation matmul with a leading batch above 1."""
    if op.op_type not in ("matmul", "einsum") or len(op.inputs) < 2:
        return None  # one operand is a constant: an ordinary projection
    for t in op.inputs:
        if t.rank >= 3 and t.shape[0] is not None and t.shape[0] > 1:
            return f"activation x activation matmul with batch {t.shape[0]} ({t.name})"
    return None


def block_weights(op: Op, ctx: Context) -> str | None:
    """O-BLOCKW: a compute layer whose weight is per-block integers (plan.streamed S-BLOCK)."""
    if op.op_type in COMPUTE_LAYER_TYPES and "S-BLOCK" in op.weight_formats:
        return "weight is per-block integers (constexpr_blockwise_shift_scale, blocks of inputs)"
    return None


def conv_kernel(limit: int) -> Test:
    """A test matching convolutions whose kernel is wider than ``limit``."""

    def test(op: Op, ctx: Context) -> str | None:
        w = op.consts.get("weight")
        if op.op_type not in ("conv", "conv_transpose") or w is None or w.rank < 3:
            return None
        width = w.shape[-1] or 0
        return f"kernel width {width} > {limit}" if width > limit else None

    return test


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
