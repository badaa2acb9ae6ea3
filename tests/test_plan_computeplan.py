"""The macOS compute-plan adapter and dump ingest, against stand-ins.

The stand-ins (plan_standins.py) are coremltools' own structure, usage and cost dataclasses
and real device-class instances; only MLComputePlan itself is a fake with its three members.
The macOS calls (compile_model, MLComputePlan.load_from_path) are not exercised: they cannot
run on Linux.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plan_programs as pp
import pytest
from plan_standins import FakePlan, block, ne_except, recorded, structure_of, structure_op

from converter.errors import InputError
from converter.evidence.labels import Evidence
from converter.pipeline.hashing import mlpackage_content_hash
from converter.placement.computeplan import (
    function_names,
    read_plans,
    resave_with_default,
    walk_plan,
)
from converter.placement.dump import DUMP_FORMAT, read_dump, write_dump
from converter.placement.inspect import inspect_package

# ---------------------------------------------------------------------------- walking


# Recorded plans and measurements here are stand-ins: the test-only switch (conftest.py).
pytestmark = pytest.mark.usefixtures("stand_in_evidence")


def test_walk_maps_devices_costs_and_recurses_into_blocks() -> None:
    from coremltools.models import compute_plan as cp

    inner = block([structure_op("ios17.mul", ["inside"])])
    ops = [
        structure_op("ios17.const", ["w"]),
        structure_op("ios17.conv", ["c"]),
        structure_op("ios17.cond", ["branch"], [inner]),
        structure_op("ios17.gather", ["g"]),
    ]
    structure = cp.MLModelStructure(
        neuralnetwork=None,
        program=cp.MLModelStructureProgram(
            functions={"main": cp.MLModelStructureProgramFunction(inputs=[], block=block(ops))}
        ),
        pipeline=None,
    )
    devices = {"c": "NE", "branch": "CPU", "inside": "GPU", "g": "CPU"}
    plan = FakePlan(structure, lambda op, out: devices.get(out))
    walked = walk_plan(plan, "main")
    assert [(p.op_type, p.preferred) for p in walked] == [
        ("const", None),
        ("conv", "NE"),
        ("cond", "CPU"),
        ("mul", "GPU"),
        ("gather", "CPU"),
    ]
    assert walked[0].cost_weight is None and walked[1].cost_weight == 0.01
    assert walked[1].supported == ["CPU", "GPU", "NE"]
    with pytest.raises(InputError, match="not in the plan"):
        walk_plan(plan, "other")


def test_a_model_that_is_not_an_ml_program_is_refused() -> None:
    from coremltools.models import compute_plan as cp

    structure = cp.MLModelStructure(neuralnetwork=None, program=None, pipeline=None)
    with pytest.raises(InputError, match="not an ML Program"):
        walk_plan(FakePlan(structure, lambda o, n: "NE"), "main")


def test_an_unknown_device_type_is_an_error() -> None:
    from converter.placement.computeplan import device_name

    with pytest.raises(InputError, match="unknown compute device"):
        device_name(object())


# ---------------------------------------------------------------------- multifunction


@pytest.fixture
def multifunction(tmp_path: Path) -> Path:
    import coremltools as ct

    a = pp.save(pp.bc1l_block(), tmp_path / "a.mlpackage")
    b = pp.save(pp.mlp(4), tmp_path / "b.mlpackage")
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(a), src_function_name="main", target_function_name="attn")
    desc.add_function(str(b), src_function_name="main", target_function_name="mlp")
    desc.default_function_name = "attn"
    out = tmp_path / "multi.mlpackage"
    ct.utils.save_multifunction(desc, str(out))
    return out


def test_resave_makes_another_function_the_default(multifunction: Path, tmp_path: Path) -> None:
    assert function_names(multifunction) == (["attn", "mlp"], "attn")
    copy = resave_with_default(multifunction, "mlp", tmp_path / "copy.mlpackage")
    assert function_names(copy) == (["attn", "mlp"], "mlp")
    assert function_names(multifunction)[1] == "attn"  # the original is untouched
    with pytest.raises(InputError, match="no function"):
        resave_with_default(multifunction, "nope", tmp_path / "x.mlpackage")


def test_every_function_is_planned_as_the_default_of_its_own_compile(multifunction: Path) -> None:
    from parity.mil.program import load_package

    structure = structure_of(load_package(multifunction))
    compiled: list[str] = []

    def compile_fn(package: Path) -> str:
        default = function_names(package)[1]
        compiled.append(default)
        return default  # the "compiled path" tells the fake which function is planned

    def load_plan_fn(compiled_path: str, units: str) -> Any:
        def policy(operator: str, output: str) -> str | None:
            if operator.endswith(".const"):
                return None
            return "GPU" if units == "CPU_AND_GPU" else "NE"

        return FakePlan(structure, policy)

    plans = read_plans(multifunction, ["CPU_AND_NE", "CPU_AND_GPU"], compile_fn, load_plan_fn)
    assert sorted(compiled) == ["attn", "mlp"]
    assert set(plans) == {"CPU_AND_NE", "CPU_AND_GPU"}
    assert set(plans["CPU_AND_NE"]) == {"attn", "mlp"}
    convs = [p for p in plans["CPU_AND_NE"]["attn"] if p.op_type == "conv"]
    assert len(convs) == 3 and {p.preferred for p in convs} == {"NE"}
    assert {p.preferred for p in plans["CPU_AND_GPU"]["mlp"] if p.op_type == "linear"} == {"GPU"}


def test_reading_plans_without_a_mac_is_bad_input(tmp_path: Path) -> None:
    import platform

    if platform.system() == "Darwin":
        pytest.skip("on macOS the real adapter would run")
    package = pp.save(pp.mlp(4), tmp_path / "m.mlpackage")
    with pytest.raises(InputError, match="macOS"):
        read_plans(package, ["CPU_AND_NE"])


# -------------------------------------------------------------------------- dump ingest


def test_a_dump_round_trips_and_is_keyed_by_content_hash(tmp_path: Path) -> None:
    a = pp.save(pp.bc1l_block(), tmp_path / "a.mlpackage")
    b = pp.save(pp.mlp(4), tmp_path / "b.mlpackage")
    dump = tmp_path / "plan.json"
    rec_a = recorded(a, ne_except())
    write_dump(dump, rec_a)
    write_dump(dump, recorded(b, ne_except()))
    doc = json.loads(dump.read_text())
    assert doc["format"] == DUMP_FORMAT and doc["evidence"] == "compute-plan"
    assert set(doc["packages"]) == {mlpackage_content_hash(a), mlpackage_content_hash(b)}
    back = read_dump(dump, rec_a.content_sha256)
    assert back.plans == rec_a.plans and back.recorded == rec_a.recorded


def test_a_dump_for_another_package_or_in_another_format_is_refused(tmp_path: Path) -> None:
    a = pp.save(pp.bc1l_block(), tmp_path / "a.mlpackage")
    dump = tmp_path / "plan.json"
    write_dump(dump, recorded(a, ne_except()))
    with pytest.raises(InputError, match="no plan for this package"):
        read_dump(dump, "0" * 64)
    doc = json.loads(dump.read_text())
    for broken in (
        {**doc, "format": "other/1"},
        {**doc, "evidence": "static"},
        {**doc, "packages": []},
    ):
        dump.write_text(json.dumps(broken))
        with pytest.raises(InputError):
            read_dump(dump, mlpackage_content_hash(a))
    entry = doc["packages"][mlpackage_content_hash(a)]
    entry["plans"]["CPU_AND_NE"]["main"][1]["preferred"] = "TPU"
    dump.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="malformed compute-plan op"):
        read_dump(dump, mlpackage_content_hash(a))
    dump.write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        read_dump(dump, mlpackage_content_hash(a))


def test_plan_report_and_op_by_op_agreement_with_the_static_prediction(tmp_path: Path) -> None:
    package = pp.save(pp.bc1l_block(), tmp_path / "a.mlpackage")
    dump = tmp_path / "plan.json"
    # The stand-in plan puts the softmax on the CPU; the static rules say NE.
    from converter.placement.inspect import load_table

    softmax = next(op for op in load_table(package).ops() if op.op_type == "softmax")
    write_dump(dump, recorded(package, ne_except(softmax.outputs[0].name)))
    item = inspect_package(package, plan_file=dump)
    assert item.compute_plan is not None and item.agreement is not None
    assert item.compute_plan.evidence is Evidence.COMPUTE_PLAN
    assert item.compute_plan.calibration is None  # a plan is not a calibrated prediction
    rows = {r.op_type: r for r in item.compute_plan.functions[0].rows}
    assert rows["softmax"].device == "CPU" and rows["softmax"].rule == "compute-plan"
    assert rows["conv"].cost_weight == 0.01 and rows["conv"].supported == ["CPU", "GPU", "NE"]
    s = item.compute_plan.functions[0].summary
    assert s.ne_segments == 2 and [b.op_type for b in s.breakers] == ["softmax"]
    a = item.agreement
    assert a["compared_ops"] == item.static.functions[0].summary.ops
    assert a["same_device"] == a["compared_ops"] - 1
    assert a["disagreements"][0]["static_rule"] == "O-SOFTMAX"
    assert a["confusion"]["NE->CPU"] == 1
