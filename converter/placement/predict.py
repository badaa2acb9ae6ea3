"""The static predictor (evidence ``static``): the preferred device of every op, from the rules.

Stages, in order: program rules (compute units, model size, tiny graph) decide every op of a
function; then, per op, the global rules (control flow, dynamic shapes, dtype, rank,
dimension limits, batched activation matmuls) and the op rules; the first rule that applies
decides. Last, the neighbour rule moves a lone NE op between CPU ops to the CPU. Rules that
do not hold on the chip asked for are skipped, which is where per-chip differences come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from converter.placement.chips import Chip
from converter.placement.ops import Function, Op
from converter.placement.rules import (
    ALIGN_FLAG,
    COMPUTE_LAYER_TYPES,
    CONST_RULE,
    DEFAULT_RULE,
    NEIGHBOUR_RULE,
    RISK_FLAG,
    RISKY_OPS,
    RULES,
    ComputeUnits,
    Confidence,
    Context,
    Device,
    ProgramFacts,
    Rule,
)

_STAGES = ("program", "global", "op")


@dataclass
class Placement:
    """The predicted preferred device of one op and the rule that decided it."""

    device: Device
    rule: Rule
    reason: str
    confidence: Confidence
    flags: list[str] = field(default_factory=list)
    also: Rule | None = None  # the op rule that agrees, when a program/global rule decided

    @property
    def fix(self) -> str:
        """What to change: the deciding rule's fix, then the agreeing op rule's."""
        if self.device == "NE":
            return ""
        fixes = [self.rule.fix]
        if self.also is not None and self.also.fix and self.also.device == self.device:
            fixes.append(self.also.fix)
        return "; ".join(f for f in fixes if f)


def program_facts(function: Function) -> ProgramFacts:
    """The program-level facts the program rules read."""
    return ProgramFacts(
        compute_layers=sum(op.op_type in COMPUTE_LAYER_TYPES for op in function.ops),
        weight_bytes_stored=function.weight_bytes_stored,
        symbolic_inputs=tuple(t.name for t in function.inputs if not t.static),
    )


def padding_factor(op: Op) -> float:
    """How many times its dense size the op's largest output occupies with 64-byte rows."""
    worst = 1.0
    for t in op.outputs:
        dense, aligned = t.nbytes, t.aligned_nbytes
        if dense and aligned:
            worst = max(worst, aligned / dense)
    return worst


def _flags(op: Op, device: Device) -> list[str]:
    flags = []
    if device == "NE" and padding_factor(op) >= 2.0:
        flags.append(ALIGN_FLAG)
    if op.op_type in RISKY_OPS:
        flags.append(RISK_FLAG)
    return flags


def _op_rule(op: Op, ctx: Context) -> Rule | None:
    """The op rule that would decide ``op`` if no program or global rule did."""
    for rule in RULES:
        if rule.stage == "op" and rule.applies_on(ctx.chip) and rule.test(op, ctx) is not None:
            return rule
    return None


def place_op(op: Op, ctx: Context) -> Placement:
    """The first rule, stage by stage, that applies to ``op`` on ``ctx.chip``."""
    reason = CONST_RULE.test(op, ctx)
    if reason is not None:
        return Placement("none", CONST_RULE, reason, CONST_RULE.confidence)
    for stage in _STAGES:
        for rule in RULES:
            if rule.stage != stage or not rule.applies_on(ctx.chip):
                continue
            reason = rule.test(op, ctx)
            if reason is not None:
                device: Device = rule.device
                if rule.id == "R-CU" and ctx.compute_units == "CPU_AND_GPU":
                    device = "GPU"  # not modelled op by op; what matters is "not the NE"
                also = _op_rule(op, ctx) if stage != "op" else None
                return Placement(device, rule, reason, rule.confidence, _flags(op, device), also)
    reason = DEFAULT_RULE.test(op, ctx) or op.op_type
    return Placement("CPU", DEFAULT_RULE, reason, DEFAULT_RULE.confidence)


def apply_neighbour_rule(function: Function, placements: list[Placement]) -> None:
    """Move each lone NE op whose producers and consumers all run on the CPU (in place).

    Decided on the devices before this pass, so the result does not depend on op order.
    """
    before = [p.device for p in placements]
    for op, p in zip(function.ops, placements, strict=True):
        if before[op.index] != "NE":
            continue
        around = [before[i] for i in (*op.producers, *op.consumers) if before[i] != "none"]
        if around and all(d == "CPU" for d in around):
            placements[op.index] = Placement(
                "CPU",
                NEIGHBOUR_RULE,
                f"{op.op_type} alone between {len(around)} CPU op(s) ({p.rule.id} alone: NE)",
                NEIGHBOUR_RULE.confidence,
            )


def predict_function(
    function: Function, chip: Chip, compute_units: ComputeUnits = "CPU_AND_NE"
) -> list[Placement]:
    """The placement of every op of ``function`` on ``chip`` under ``compute_units``."""
    ctx = Context(chip, compute_units, program_facts(function))
    placements = [place_op(op, ctx) for op in function.ops]
    apply_neighbour_rule(function, placements)
    if compute_units == "ALL":
        # Under ALL, Core ML may give NE-capable regions to the GPU (R-CU, dump D1 HiFiGAN).
        for p in placements:
            if p.device == "NE" and p.confidence == "high":
                p.confidence = "medium"
    return placements
