"""Plans applied to a small two-projection program: every scheme lands on the weight it names,
records count the bytes the program stores, and coremltools' decoding agrees with the MIL
evaluator's (grouped and 3-bit palettes in their iOS 18 form included)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from converter.compression.records import weight_records
from converter.compression.schemes import Scheme, apply_plan
from converter.compression.sites import weight_sites

NAMES = ("a.weight", "b.weight")
SHAPES = {"a.weight": (64, 32, 1, 1), "b.weight": (32, 64, 1, 1)}


def _model(target: str) -> Any:
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal(s) * 0.05).astype(np.float16) for n, s in SHAPES.items()}

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 32, 1, 4), dtype=types.fp16)],
        opset_version=getattr(ct.target, target),
    )
    def prog(x: Any) -> Any:
        for n in NAMES:
            const = mb.const(val=weights[n], name=n.replace(".", "_") + "_to_fp16")
            x = mb.conv(x=x, weight=const)
        return x

    return ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=getattr(ct.target, target),
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )


@pytest.mark.parametrize(
    ("target", "scheme", "ops", "bits_range"),
    [
        ("iOS17", Scheme("lut", 4, "per-tensor"), "constexpr_lut_to_dense", (4.0, 4.25)),
        ("iOS17", Scheme("int8", 8, "per-channel", None, False), "constexpr_affine_dequantize",
         (8.0, 9.0)),
        ("iOS18", Scheme("lut", 4, "per-grouped-channel", 16), "constexpr_lut_to_dense",
         (4.0, 4.6)),
        ("iOS18", Scheme("lut", 3, "per-tensor"), "constexpr_lut_to_dense", (3.0, 3.1)),
    ],
)  # fmt: skip
# bits per weight: the payload plus tables, scales and shapes (2,048 weights: 16 fp16 entries
# and a uint32 shape add 0.19 bit; 4 grouped palettes 0.5 bit; 64 scales and zero points 0.75)
def test_plan_lands_on_the_named_weight_and_decodes_alike(
    target: str, scheme: Scheme, ops: str, bits_range: tuple[float, float]
) -> None:
    from parity.mil import Evaluator

    model = _model(target)
    sites = weight_sites(model._mil_program.functions["main"], NAMES)
    assert [s.name for s in sites] == list(NAMES)
    compressed = apply_plan(model, {"a.weight": scheme}, sites)
    program = compressed._mil_program
    records, decoded = weight_records(
        program.functions["main"], sites, {"a.weight": scheme}, {"b.weight": "kept"}
    )
    by_name = {r.weight: r for r in records}
    a, b = by_name["a.weight"], by_name["b.weight"]
    assert a.op == ops and a.bits == scheme.bits
    assert bits_range[0] <= a.bits_per_weight <= bits_range[1]
    assert a.stored_bytes < a.fp16_bytes
    assert b.method == "fp16" and b.op == "const" and b.stored_bytes == b.fp16_bytes
    assert set(decoded) == {"a.weight"} and decoded["a.weight"].shape == SHAPES["a.weight"]
    if scheme.method == "lut":
        levels = 2**scheme.bits
        if scheme.granularity == "per-grouped-channel":
            assert scheme.group_size is not None
            for g in range(0, 64, scheme.group_size):
                assert len(np.unique(decoded["a.weight"][g : g + scheme.group_size])) <= levels
            assert len(np.unique(decoded["a.weight"])) > levels  # one palette per group
        else:
            assert len(np.unique(decoded["a.weight"])) <= levels
    evaluator = Evaluator(program, "fp32")
    outputs = {"a_weight_to_fp16_palettized", "a_weight_to_fp16_quantized"}
    ours = [v for k, v in evaluator._constants.items() if k in outputs]
    assert len(ours) == 1
    np.testing.assert_array_equal(np.asarray(ours[0]).astype(np.float16), decoded["a.weight"])


def test_unknown_weight_in_a_plan_is_refused() -> None:
    model = _model("iOS17")
    sites = weight_sites(model._mil_program.functions["main"], NAMES)
    with pytest.raises(KeyError, match="not in the program"):
        apply_plan(model, {"c.weight": Scheme("lut", 4, "per-tensor")}, sites)


@pytest.mark.parametrize(("bits", "group"), [(4, 8), (4, 16), (6, 32)])
def test_grouped_palettes_store_at_most_nominal_bits_plus_5_percent(bits: int, group: int) -> None:
    """Grouped-channel palettes (issue 12): one 2**bits-entry fp16 table per group of output
    channels, on a SmolLM2-width weight (576 inputs); every stored byte counted (indices,
    tables, the op's shape)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((128, 576, 1, 1)) * 0.05).astype(np.float16)

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 576, 1, 4), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any) -> Any:
        return mb.conv(x=x, weight=mb.const(val=weight, name="w_weight_to_fp16"))

    model = ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16, skip_model_load=True,
    )  # fmt: skip
    sites = weight_sites(model._mil_program.functions["main"], ["w.weight"])
    scheme = Scheme("lut", bits, "per-grouped-channel", group)
    compressed = apply_plan(model, {"w.weight": scheme}, sites)
    (record,), decoded = weight_records(
        compressed._mil_program.functions["main"], sites, {"w.weight": scheme}, {}
    )
    assert record.group_size == group and record.op == "constexpr_lut_to_dense"
    assert bits < record.bits_per_weight <= bits * 1.05
    for g in range(0, 128, group):  # a palette per group, not one shared
        # (a set of bit patterns: this numpy's np.unique repeats some float16 values)
        values = set(decoded["w.weight"][g : g + group].view(np.uint16).ravel().tolist())
        assert len(values) <= 2**bits
