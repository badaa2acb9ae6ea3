"""Numeric profiles: how the evaluator stores and accumulates floating-point values.

The Neural Engine stores activations in fp16; how it accumulates sums (matmuls, convolutions,
reductions), whether it flushes subnormals and which look-up tables it uses for activations
are not published. A profile states one set of assumptions, so a result is always labelled
with the assumptions that produced it:

* ``fp32`` - every value and every operation in fp32, whatever the program declares. This
  checks what coremltools made of the graph (op lowering, fused ops, folded constants) without
  fp16 noise, so it can be compared with the BC1L torch module at about 1e-5.
* ``fp16`` - fp16 storage: every float an op produces (and every float constant and input) is
  rounded to fp16 (round to nearest even, overflow to inf), as the NE stores it; inside an op
  the arithmetic and all accumulation run in fp32. This is the gated profile.
* ``fp16-acc`` - pessimistic: fp16 storage as above, and every running sum (matmul, conv,
  einsum, linear, reductions, softmax and layer_norm sums) is held in fp16 - rounded after
  each block of ``acc_block`` terms, which are summed exactly first (an fp16 accumulator fed by
  32-wide dot products) - and fp16 subnormals are flushed to zero. Reported beside ``fp16``,
  never gated: it is a bound on what an unknown accumulator could do, not a measurement.
* ``device-margin`` - ``fp16-acc``'s assumptions plus the per-op deviations others report
  for the NE (``parity.mil.deviations``: each an absolute error with its source, added with a
  seeded sign before the result is stored). Opt-in (a recipe's
  ``gates.device_margin_argmax_agreement``), run once per seed, the worst seed per position
  kept: what the program's argmax survives if the NE is as far off as reported.

Activation look-up tables are not modelled: no profile knows the NE's tables; the
device-margin profile only adds reported errors to the exact functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parity.mil.deviations import DEVIATIONS, Deviation


@dataclass(frozen=True)
class Profile:
    """One set of numeric assumptions for evaluating an ML Program."""

    name: str
    fp16_storage: bool  # round every float value to fp16 between ops
    fp16_accumulation: bool  # running sums inside an op are rounded to fp16
    acc_block: int  # terms summed exactly before each fp16 rounding of a running sum
    flush_subnormals: bool  # fp16 subnormal results become (signed) zero
    description: str
    # Reported per-op errors added to results before storing (`parity.mil.deviations`).
    deviations: tuple[Deviation, ...] = ()
    # Inputs and states the program declares fp16 are rounded to fp16 on the way in, as the
    # runtime receives and holds them (off: held as given, `FP32_HELD`).
    fp16_inputs: bool = True


FP32 = Profile(
    name="fp32",
    fp16_storage=False,
    fp16_accumulation=False,
    acc_block=1,
    flush_subnormals=False,
    description="every value and every operation in fp32",
)
FP16 = Profile(
    name="fp16",
    fp16_storage=True,
    fp16_accumulation=False,
    acc_block=1,
    flush_subnormals=False,
    description="fp16 storage between ops (round to nearest even), fp32 arithmetic and "
    "accumulation inside each op",
)
FP16_ACC = Profile(
    name="fp16-acc",
    fp16_storage=True,
    fp16_accumulation=True,
    acc_block=32,
    flush_subnormals=True,
    description="fp16 storage; running sums of matmuls, convs and reductions held in fp16, "
    "rounded after every 32 exactly-summed terms; fp16 subnormals flushed to zero "
    "(pessimistic assumptions, reported, not gated)",
)

# fp16-acc's assumptions, plus the reported deviations.
DEVICE_MARGIN = replace(
    FP16_ACC,
    name="device-margin",
    description="as fp16-acc, plus the per-op deviations others report for the NE, added "
    "with seeded signs (reported figures, not measured here; opt-in, worst over seeds)",
    deviations=DEVIATIONS,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (FP32, FP16, FP16_ACC, DEVICE_MARGIN)}
GATED = FP16.name
# The fp32 cache level's run (`parity.kv_fp32`): the program's function alone, in fp32, its
# fp16 inputs and cache taken as given. Holding the cache in fp16 makes a key one fp16 ulp
# apart from an exact computation's wherever the two fp32 values straddle a rounding point, so
# no exact reference could be held to a tight bound; the fp16 levels judge that storage.
FP32_HELD = replace(
    FP32,
    name="fp32-held",
    description="every value and every operation in fp32, fp16 inputs and states held in fp32",
    fp16_inputs=False,
)


def get_profile(name: str) -> Profile:
    """The profile called ``name``; a KeyError lists the known names."""
    try:
        return PROFILES[name] if name != FP32_HELD.name else FP32_HELD
    except KeyError:
        raise KeyError(f"unknown numeric profile {name!r}; known: {', '.join(PROFILES)}") from None
