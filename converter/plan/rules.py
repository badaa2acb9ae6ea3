"""The placement rules as data: the single table to change when new evidence arrives.

Each rule has an id (as in docs/placement-rules.md where one exists), the stage it
belongs to, its condition in words, the device it predicts, its confidence, its sources, what
to change in the model or recipe, the chips it applies to, and a test on one op. The static
predictor (``predict.py``) tries the stages in order — program, global, op — and the first
rule whose test returns a reason decides; then the neighbour rule runs on the result.

Confidence follows docs/placement-rules.md: high = Apple documentation or several real
dumps agree; medium = one dump or consistent community reports; low = inference or
direct-path evidence. The published dumps the sources cite as D1-D5 are described, with
where each comes from, in that file's section 3.

``CALIBRATIONS`` lists the real compute-plan dumps of anec artifacts this table has been
compared with. It is empty: no dump of an anec artifact exists yet, so every static report
says ``uncalibrated``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from converter.plan.chips import Chip
from converter.plan.ops import FLOAT_DTYPES, Op, Tensor

Device = Literal["NE", "CPU", "GPU", "none"]
Stage = Literal["program", "global", "op", "neighbour", "default"]
Confidence = Literal["high", "medium", "low"]
ComputeUnits = Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"]
COMPUTE_UNITS: tuple[ComputeUnits, ...] = ("ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY")
CONFIDENCE_ORDER: dict[Confidence, int] = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class ProgramFacts:
    """What program-level rules look at, computed once per function."""

    compute_layers: int  # conv / linear / matmul / einsum ops
    weight_bytes_stored: int
    symbolic_inputs: tuple[str, ...]


@dataclass(frozen=True)
class Context:
    """Everything a rule may read besides the op: chip, compute units, program facts."""

    chip: Chip
    compute_units: ComputeUnits
    program: ProgramFacts


Test = Callable[[Op, Context], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One placement rule. ``test`` returns the reason it applies to an op, or None."""

    id: str
    stage: Stage
    condition: str
    device: Device
    confidence: Confidence
    sources: str
    fix: str
    test: Test
    chips: frozenset[str] | None = None  # None: every chip

    def applies_on(self, chip: Chip) -> bool:
        """True when the rule holds on this chip."""
        return self.chips is None or chip.name in self.chips


@dataclass(frozen=True)
class Calibration:
    """A real MLComputePlan dump of an anec artifact that this table was compared with."""

    package_content_sha256: str
    chip: str
    macos: str
    compute_units: ComputeUnits
    agreement: float  # share of dispatchable ops whose device matched
    note: str


CALIBRATIONS: tuple[Calibration, ...] = ()


def calibration_status() -> str:
    """``uncalibrated`` until a real dump of an anec artifact has been compared and recorded."""
    return "calibrated" if CALIBRATIONS else "uncalibrated"


# ------------------------------------------------------------------------------ the tests

COMPUTE_LAYER_TYPES = frozenset({"conv", "conv_transpose", "linear", "matmul", "einsum"})
TINY_GRAPH_LAYERS = 2  # "only 1-2 layer graphs stay on the CPU" (stablehlo-coreml PR #110)
MAX_RANK = 5
# Integer and bool activations leave the NE; int8/uint8 activations are the W8A8 path.
NE_INT_DTYPES = frozenset({"int8", "uint8"})
NON_NE_DTYPES = frozenset({"int16", "uint16", "int32", "uint32", "int64", "bool"})


def _runtime(op: Op) -> list[Tensor]:
    return [*op.inputs, *op.outputs]


def _types(*names: str) -> Test:
    wanted = frozenset(names)

    def test(op: Op, ctx: Context) -> str | None:
        return f"{op.op_type}" if op.op_type in wanted else None

    return test


def _compute_units(op: Op, ctx: Context) -> str | None:
    if ctx.compute_units == "CPU_ONLY":
        return "compute units CPU_ONLY"
    if ctx.compute_units == "CPU_AND_GPU":
        return "compute units CPU_AND_GPU exclude the NE"
    return None


def _model_size(op: Op, ctx: Context) -> str | None:
    size, budget = ctx.program.weight_bytes_stored, ctx.chip.model_budget_bytes
    if size > budget:
        where = f"the {budget / 1e9:.0f} GB NE budget on {ctx.chip.name}"
        return f"{size / 1e9:.2f} GB of weights exceed {where}"
    return None


def _tiny_graph(op: Op, ctx: Context) -> str | None:
    n = ctx.program.compute_layers
    if n <= TINY_GRAPH_LAYERS:
        return f"the program has {n} conv/linear/matmul op(s); 1-2 layer graphs stay on the CPU"
    return None


def _control_flow(op: Op, ctx: Context) -> str | None:
    if op.op_type in ("cond", "while_loop"):
        return f"{op.op_type} is control flow"
    if op.in_block_of in ("cond", "while_loop"):
        return f"inside a {op.in_block_of} block"
    return None


def _dynamic(op: Op, ctx: Context) -> str | None:
    for t in _runtime(op):
        if not t.static:
            return f"{t.name} has a symbolic shape {_fmt(t.shape)}"
    return None


def _fp32(op: Op, ctx: Context) -> str | None:
    for t in _runtime(op):
        if t.dtype in FLOAT_DTYPES and t.dtype != "fp16":
            return f"{t.name} is {t.dtype}"
    return None


def _integer(op: Op, ctx: Context) -> str | None:
    for t in _runtime(op):
        if t.dtype in NON_NE_DTYPES:
            return f"{t.name} is {t.dtype}"
    return None


def _rank(op: Op, ctx: Context) -> str | None:
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


def _lm_head(op: Op, ctx: Context) -> str | None:
    if op.op_type not in _PROJECTIONS or not op.weight_bytes:
        return None
    for t in op.outputs:
        over = _axis_over_limit(t, ctx.chip)
        if over:
            return f"a projection to a wide axis: {over}"
    return None


def _dims(op: Op, ctx: Context) -> str | None:
    for t in _runtime(op):
        over = _axis_over_limit(t, ctx.chip)
        if over:
            return over
    return None


def _batched_activation_matmul(op: Op, ctx: Context) -> str | None:
    if op.op_type not in ("matmul", "einsum") or len(op.inputs) < 2:
        return None  # one operand is a constant: an ordinary projection
    for t in op.inputs:
        if t.rank >= 3 and t.shape[0] is not None and t.shape[0] > 1:
            return f"activation x activation matmul with batch {t.shape[0]} ({t.name})"
    return None


def _conv_kernel(limit: int) -> Test:
    def test(op: Op, ctx: Context) -> str | None:
        w = op.consts.get("weight")
        if op.op_type not in ("conv", "conv_transpose") or w is None or w.rank < 3:
            return None
        width = w.shape[-1] or 0
        return f"kernel width {width} > {limit}" if width > limit else None

    return test


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


# ------------------------------------------------------------------------------ the table
# Order matters inside a stage: the first matching rule decides.

_EW = (
    "add sub mul real_div floor_div maximum minimum pow square sqrt rsqrt inverse exp exp2 log "
    "abs clip neg sign floor ceil round threshold"
)
_ACT = (
    "relu relu6 silu sigmoid sigmoid_hard tanh leaky_relu softplus softsign gelu erf elu prelu "
    "scaled_tanh linear_activation clamped_relu thresholded_relu"
)
_NORM = (
    "layer_norm batch_norm instance_norm l2_norm local_response_norm reduce_mean reduce_sum "
    "reduce_max reduce_min reduce_sum_square reduce_l2_norm reduce_l1_norm reduce_log_sum "
    "reduce_log_sum_exp"
)
_SHAPE = (
    "reshape transpose concat split slice_by_index slice_by_size expand_dims squeeze stack tile "
    "pad identity space_to_depth depth_to_space pixel_shuffle"
)
_NOPATH = (
    "scatter scatter_nd scatter_along_axis one_hot band_part non_zero reverse_sequence mod "
    "logical_and logical_or logical_xor logical_not reduce_prod random_bernoulli "
    "random_categorical random_normal random_uniform range_1d shape sliding_windows tan asin "
    "acos atan atanh asinh acosh sinh cosh non_maximum_suppression make_list list_read "
    "list_write list_gather list_scatter list_length fill fill_like"
)
_SOURCES_INT = (
    "anemll-profile README (Unsupported tensor data type: int32); dumps D1, D2 (cast, select, "
    "greater_equal, int gather on the CPU); coreai neural_engine_rules (fp16/int8/int16 only)"
)

RULES: tuple[Rule, ...] = (
    # --- program: decide every op of the function at once
    Rule(
        "R-CU",
        "program",
        "compute units CPU_ONLY or CPU_AND_GPU",
        "CPU",
        "high",
        "coremltools docs-guides load-and-convert-model.md; dump D1",
        "load the model with compute units ALL or CPU_AND_NE",
        _compute_units,
    ),
    Rule(
        "R-SIZE",
        "program",
        "stored weights above the per-model NE budget (about 1 GB on iPhone, 2 GB on macOS)",
        "CPU",
        "medium",
        "coremltools mlmodel-utilities.md (1 GB on iPhone); Anemll manual_conversion.md "
        "(~2 GB on macOS); smpanaro NOTES",
        "compress the weights (palettization or int8 per channel) or split the model into "
        "chunks under the budget",
        _model_size,
    ),
    Rule(
        "R-TINY",
        "program",
        f"at most {TINY_GRAPH_LAYERS} conv/linear/matmul ops in the function",
        "CPU",
        "medium",
        "kasper0406/stablehlo-coreml PR #110 (1-2 layer graphs stay on the CPU; a 4-layer fp16 "
        "MLP is NE-resident); vx-lang/Vx#436 (dump D5: 4x4 matmul preferred CPU)",
        "the graph is too small for the NE to pay: merge it into a larger program, or run it "
        "on the CPU on purpose",
        _tiny_graph,
    ),
    # --- global: dtype, rank, dimension limits, dynamic shapes, batch (before op rules)
    Rule(
        "R-CTRL",
        "global",
        "cond / while_loop and the ops inside their blocks",
        "CPU",
        "medium",
        "smpanaro NOTES (cond is not supported on the NE); ane-guide appendix A",
        "unroll the control flow at trace time (fixed shapes make it static)",
        _control_flow,
    ),
    Rule(
        "R-DYN",
        "global",
        "a tensor with a symbolic (runtime-sized) dimension",
        "CPU",
        "high",
        "coreai neural_engine_rules (fully static shapes); coremltools faqs.md, "
        "flexible-inputs.md; smpanaro NOTES",
        "fix the shapes in the recipe (shapes.batch, shapes.sequence_length) or use "
        "EnumeratedShapes",
        _dynamic,
    ),
    Rule(
        "R-FP32",
        "global",
        "the op computes in fp32 (an fp32 input or output)",
        "CPU",
        "high",
        "coremltools typed-execution.md (only the NE is barred for fp32); dump D1 (fp32 "
        "decoder: 195/195 CPU under CPU_AND_NE); dump D5",
        "convert in fp16 (recipe precision: float16) with fp16 I/O (io.dtype: float16); keep "
        "no fp32 islands inside the layers",
        _fp32,
    ),
    Rule(
        "R-INT",
        "global",
        "an integer or bool activation (int16/int32/int64/bool; int8 is the W8A8 path)",
        "CPU",
        "high",
        _SOURCES_INT,
        "build masks and indices on the host as fp16 inputs (an additive fp16 key mask, "
        "io.inputs: embeddings instead of token ids)",
        _integer,
    ),
    Rule(
        "R-RANK",
        "global",
        f"a tensor of rank above {MAX_RANK}",
        "CPU",
        "high",
        "coreai neural_engine_rules (max rank 5); ane-guide ch.17 validators; executorch #11694",
        "reshape to rank 4 (B, C, 1, L) before the op",
        _rank,
    ),
    Rule(
        "R-LMHEAD",
        "global",
        "a projection whose output axis exceeds the chip's axis limit (a vocabulary-wide LM head)",
        "CPU",
        "medium",
        "Anemll llama_model.py (lm_head split 8/16-way); smpanaro NOTES (gpt2 lm_head on the "
        "CPU); mechramc/Orion README",
        "split the head into slices of at most 16384 outputs (recipe io.lm_head_chunk)",
        _lm_head,
    ),
    Rule(
        "R-DIM",
        "global",
        "an axis above the chip's limit (16384 on M1-M3 and 65536 from A16/M4 for width and "
        "sequence; 65536 channels)",
        "CPU",
        "medium",
        "ane-guide appendix A numeric limits and ch.17; Anemll agent.md and llama_model.py "
        "(16384 per dimension)",
        "split the axis into slices under the limit, or reshape so no axis exceeds it",
        _dims,
    ),
    Rule(
        "R-BATCH",
        "global",
        "batch > 1 on an activation x activation matmul (both operands computed at run time)",
        "CPU",
        "low",
        "ane-guide part-5 ch.19 (dynamic-weight conv fails to compile at batch >= 2; direct "
        "path only)",
        "use batch 1 and call once per sample, or fold the batch into the sequence axis",
        _batched_activation_matmul,
    ),
    # --- op rules: CPU-bound op types first, then the NE op families
    Rule(
        "O-CAST",
        "op",
        "cast",
        "CPU",
        "high",
        "dumps D1, D2, D5, vx-lang/Vx#436 (every cast preferred CPU); apple/coremltools#1984",
        "use fp16 model I/O (io.dtype: float16) so no boundary cast is needed; do integer to "
        "float conversions on the host",
        _types("cast"),
    ),
    Rule(
        "O-GATHER",
        "op",
        "gather, gather_nd, gather_along_axis (embedding lookups, position-table indexing)",
        "CPU",
        "high",
        "apple/ml-ane-transformers README (the 4 CPU ops are the embedding lookup); dumps D1, "
        "D2, D4; ane-guide ch.18 (no engine cost tree for gather)",
        "gather embedding rows on the host (io.inputs: embeddings); compute position tables "
        "before tracing for the fixed shape",
        _types("gather", "gather_nd", "gather_along_axis"),
    ),
    Rule(
        "O-TOPK",
        "op",
        "topk, argsort, reduce_argmax, reduce_argmin",
        "CPU",
        "high",
        "dump D4 (roboflow/rf-detr PR #1495: topk and the ops consuming its indices on the "
        "CPU); ane-guide ch.18 (argmax has no engine tree)",
        "take top-k or the argmax on the host from the returned logits",
        _types("topk", "argsort", "reduce_argmax", "reduce_argmin"),
    ),
    Rule(
        "O-SLUPD",
        "op",
        "a standalone slice_update",
        "CPU",
        "medium",
        "Anemll/anemll-profile README (Cannot support standalone slice_update)",
        "write the slice with concat of slices, or keep the update on the host",
        _types("slice_update"),
    ),
    Rule(
        "O-NOPATH",
        "op",
        "ops with no NE path: scatter, one_hot, band_part, non_zero, mod, logical ops, "
        "random ops, range_1d, shape, fill, inverse trig, NMS, list ops",
        "CPU",
        "medium",
        "ane-guide appendix A (no path, decompose on host); smpanaro NOTES (band_part)",
        "precompute the value before tracing (fixed shapes) or do it on the host",
        _types(*_NOPATH.split()),
    ),
    Rule(
        "O-RNN",
        "op",
        "lstm, gru, rnn",
        "CPU",
        "high",
        "apple/coremltools#1780 (maintainer: RNN/LSTM not supported on the NE); #337",
        "replace the recurrence by attention or convolution, or run it on the CPU on purpose",
        _types("lstm", "gru", "rnn"),
    ),
    Rule(
        "O-CUMSUM",
        "op",
        "cumsum",
        "CPU",
        "low",
        "ane-guide appendix A (native only on a curated runtime path)",
        "express the running sum as a matmul with a constant triangular matrix",
        _types("cumsum"),
    ),
    Rule(
        "O-TRIG-M1M2",
        "op",
        "sin, cos on chips without native trig (M1, M2)",
        "CPU",
        "low",
        "ane-guide appendix A (sin/cos family-gated to A15/M3)",
        "precompute cos/sin tables before tracing (RoPE) for the fixed shape",
        _types("sin", "cos"),
        chips=frozenset({"M1", "M2"}),
    ),
    Rule(
        "O-TRIG",
        "op",
        "sin, cos from M3 / A17 Pro",
        "NE",
        "low",
        "ane-guide appendix A (native from A15/M3, direct path)",
        "",
        _types("sin", "cos"),
    ),
    Rule(
        "O-RESIZE-M1",
        "op",
        "upsample / resize / crop_resize on M1 (no texture engine)",
        "CPU",
        "low",
        "ane-guide appendix A (texture engine from A14/M2; software fallback on M1)",
        "resize on the host or with a transposed conv",
        _types(
            "upsample_nearest_neighbor",
            "upsample_bilinear",
            "resize",
            "resize_bilinear",
            "resize_nearest_neighbor",
            "crop_resize",
        ),
        chips=frozenset({"M1"}),
    ),
    Rule(
        "O-CONV-LIM-M1",
        "op",
        "conv kernel wider than 13 on M1",
        "CPU",
        "medium",
        "ane-guide ch.17 (a kernel of width 14 rejects) and appendix A; dump D1 (HiFiGAN convs "
        "on the CPU)",
        "split the kernel into narrower convs, or fold the width into channels",
        _conv_kernel(13),
        chips=frozenset({"M1"}),
    ),
    Rule(
        "O-CONV-LIM",
        "op",
        "conv kernel wider than 16",
        "CPU",
        "medium",
        "ane-guide ch.17 and appendix A (15-16 on later chips); coreai rules (avoid large "
        "kernels along width)",
        "split the kernel into narrower convs, or fold the width into channels",
        _conv_kernel(16),
    ),
    Rule(
        "O-CONV",
        "op",
        "conv, conv_transpose",
        "NE",
        "high",
        "dumps D1 (conv 11/11 NE), D2 (102/102); coreai rules (1x1 Conv2d)",
        "",
        _types("conv", "conv_transpose"),
    ),
    Rule(
        "O-MM",
        "op",
        "linear, matmul, einsum",
        "NE",
        "high",
        "dumps D1 (linear 28, matmul 12 NE), D2 (matmul 12); apple/ml-ane-transformers "
        "multihead_attention.py",
        "",
        _types("linear", "matmul", "einsum"),
    ),
    Rule(
        "O-EW",
        "op",
        "fp16 elementwise arithmetic",
        "NE",
        "high",
        "dump D2 (mul 224, add 101, rsqrt 45 on the NE); dump D1; ane-guide appendix A",
        "",
        _types(*_EW.split()),
    ),
    Rule(
        "O-ACT",
        "op",
        "activations (relu, silu, sigmoid, tanh, gelu, erf, ...)",
        "NE",
        "high",
        "dumps D1 (relu, tanh), D2 (silu 16); ane-guide appendix A (gelu/erf by look-up "
        "table: medium for those)",
        "",
        _types(*_ACT.split()),
    ),
    Rule(
        "O-NORM",
        "op",
        "norms and reductions",
        "NE",
        "high",
        "dumps D1 (layer_norm 9, batch_norm 4), D2 (reduce_mean 45); ane-guide appendix A",
        "",
        _types(*_NORM.split()),
    ),
    Rule(
        "O-SOFTMAX",
        "op",
        "softmax",
        "NE",
        "high",
        "dumps D1 (softmax 6 NE), D2 (6)",
        "",
        _types("softmax"),
    ),
    Rule(
        "O-SHAPE",
        "op",
        "reshape, transpose, concat, split, slices, expand_dims, squeeze, stack, tile, pad",
        "NE",
        "high",
        "dumps D1 (reshape 48, transpose 32, concat 6, slice_by_index 5), D2 (pad, split, "
        "tile, concat)",
        "",
        _types(*_SHAPE.split()),
    ),
    Rule(
        "O-POOL",
        "op",
        "avg_pool, max_pool, l2_pool",
        "NE",
        "medium",
        "hollance unsupported-layers.md; coreai rules; ane-guide appendix A",
        "",
        _types("avg_pool", "max_pool", "l2_pool"),
    ),
    Rule(
        "O-RESIZE",
        "op",
        "upsample / resize / crop_resize from M2 (texture engine)",
        "NE",
        "low",
        "ane-guide appendix A; hollance unsupported-layers.md",
        "",
        _types(
            "upsample_nearest_neighbor",
            "upsample_bilinear",
            "resize",
            "resize_bilinear",
            "resize_nearest_neighbor",
            "crop_resize",
        ),
    ),
    Rule(
        "O-W8A8",
        "op",
        "quantize / dequantize of activations (W8A8)",
        "NE",
        "medium",
        "coremltools opt-quantization-overview.md, opt-joint-compression.md (faster int8 path "
        "from A17 Pro / M4)",
        "",
        _types("quantize", "dequantize"),
    ),
    Rule(
        "O-SDPA",
        "op",
        "fused scaled_dot_product_attention (iOS18)",
        "NE",
        "low",
        "ane-guide (sdpa native, direct path); coreai rules say there is no fused SDPA path "
        "on the NE (Core AI): uncertain",
        "prefer matmul + softmax + matmul, which the dumps place on the NE",
        _types("scaled_dot_product_attention"),
    ),
    Rule(
        "O-STATE",
        "op",
        "read_state, write_state, coreml_update_state (stateful KV cache)",
        "NE",
        "low",
        "Anemll llama_converter.py (fp16 state on the NE); apple/coremltools#2631, #2553 and "
        "dump D2 (stateful decode fails to compile on the NE, status 0x1d)",
        "keep the KV cache as explicit inputs and outputs, state dims a multiple of 32",
        _types("read_state", "write_state", "coreml_update_state"),
    ),
)

# Applied after the per-op pass, on its result.
NEIGHBOUR_RULE = Rule(
    "R-SEG",
    "neighbour",
    "a lone NE-capable op whose producers and consumers are all on the CPU",
    "CPU",
    "medium",
    "ane-guide part-2 ch.5 and part-5 ch.18 (the segmenter minimises compute + launch + "
    "transfer); dump D1 (one add next to int ops on the CPU); hollance unsupported-layers.md",
    "move its CPU neighbours onto the NE (see their rules) so it joins an NE segment",
    lambda op, ctx: None,  # decided on the graph, in predict.py
)

# No rule matched: no public evidence places the op on the NE.
DEFAULT_RULE = Rule(
    "R-UNKNOWN",
    "default",
    "an op type no rule covers",
    "CPU",
    "low",
    "none: no dump or document places this op on the NE",
    "replace it with ops from the NE families (conv, matmul, elementwise, norms, softmax, "
    "shape ops), or add a rule here once a compute-plan dump shows its placement",
    lambda op, ctx: op.op_type,
)

CONST_RULE = Rule(
    "R-CONST",
    "global",
    "const / constexpr_* (weights and their decompression)",
    "none",
    "high",
    "dump D1 (const and constexpr_blockwise_shift_scale unknown); dump D2 (constants are not "
    "dispatchable); anemll-profile",
    "",
    lambda op, ctx: op.op_type if not op.dispatchable else None,
)

# Flags: no device change, a cost or a risk the report names.
ALIGN_FLAG = "R-ALIGN"  # last axis padded to 64 bytes
RISK_FLAG = "R-RISK"  # the plan may say NE and the load-time NE compile still fail
RISKY_OPS = frozenset({"read_state", "write_state", "coreml_update_state"})

ALL_RULES: tuple[Rule, ...] = (CONST_RULE, *RULES, NEIGHBOUR_RULE, DEFAULT_RULE)


def rule_by_id(rule_id: str) -> Rule:
    """The rule with this id."""
    for r in ALL_RULES:
        if r.id == rule_id:
            return r
    raise KeyError(rule_id)
