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

The table is one tuple, ``RULES``, in three modules along its stages: the program and global
rules here, the op rules in ``op_rules.py`` (add an op rule there); the tests the rules run on
an op are in ``conditions.py`` and the rule types in ``rule_model.py``. Every name is
importable from here.

``CALIBRATIONS`` lists the real compute-plan dumps of anec artifacts this table has been
compared with. It is empty: no dump of an anec artifact exists yet, so every static report
says ``uncalibrated``.
"""

from __future__ import annotations

from converter.placement.conditions import (
    COMPUTE_LAYER_TYPES,
    MAX_RANK,
    NE_INT_DTYPES,
    NON_NE_DTYPES,
    TINY_GRAPH_LAYERS,
    batched_activation_matmul,
    compute_units,
    control_flow,
    dims,
    dynamic,
    fp32,
    integer,
    lm_head,
    model_size,
    rank,
    tiny_graph,
)
from converter.placement.op_rules import OP_RULES
from converter.placement.rule_model import (
    COMPUTE_UNITS,
    CONFIDENCE_ORDER,
    Calibration,
    ComputeUnits,
    Confidence,
    Context,
    Device,
    ProgramFacts,
    Rule,
    Stage,
    Test,
)

# The rule types and the conditions' thresholds stay importable from here, as before.
__all__ = [
    "ALIGN_FLAG",
    "ALL_RULES",
    "CALIBRATIONS",
    "COMPUTE_LAYER_TYPES",
    "COMPUTE_UNITS",
    "CONFIDENCE_ORDER",
    "CONST_RULE",
    "Calibration",
    "ComputeUnits",
    "Confidence",
    "Context",
    "DEFAULT_RULE",
    "Device",
    "MAX_RANK",
    "NEIGHBOUR_RULE",
    "NE_INT_DTYPES",
    "NON_NE_DTYPES",
    "ProgramFacts",
    "RISKY_OPS",
    "RISK_FLAG",
    "RULES",
    "Rule",
    "Stage",
    "TINY_GRAPH_LAYERS",
    "Test",
    "calibration_status",
    "rule_by_id",
]

CALIBRATIONS: tuple[Calibration, ...] = ()


def calibration_status() -> str:
    """``uncalibrated`` until a real dump of an anec artifact has been compared and recorded."""
    return "calibrated" if CALIBRATIONS else "uncalibrated"


# ------------------------------------------------------------------------------ the table
# Order matters inside a stage: the first matching rule decides.

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
        compute_units,
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
        model_size,
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
        tiny_graph,
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
        control_flow,
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
        dynamic,
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
        fp32,
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
        integer,
    ),
    Rule(
        "R-RANK",
        "global",
        f"a tensor of rank above {MAX_RANK}",
        "CPU",
        "high",
        "coreai neural_engine_rules (max rank 5); ane-guide ch.17 validators; executorch #11694",
        "reshape to rank 4 (B, C, 1, L) before the op",
        rank,
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
        lm_head,
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
        dims,
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
        batched_activation_matmul,
    ),
    *OP_RULES,
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
