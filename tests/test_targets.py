"""The deployment-target table and its feature checks."""

from __future__ import annotations

import sys
import types

import pytest

from converter.coreml.targets import TARGETS, Feature, allowed_features, check_feature, get_target
from converter.errors import InputError

IOS18_FEATURES = [
    Feature.GROUPED_PALETTE,
    Feature.PALETTE_3BIT,
    Feature.STATES,
    Feature.SDPA,
    Feature.MULTIFUNCTION,
    Feature.BLOCKWISE_INT4,
]


def test_table_lists_ios15_to_18_and_macos12_to_15() -> None:
    assert list(TARGETS) == [
        "iOS15",
        "iOS16",
        "iOS17",
        "iOS18",
        "macOS12",
        "macOS13",
        "macOS14",
        "macOS15",
    ]
    t = TARGETS["macOS13"]
    assert (t.name, t.platform, t.major, t.ct_attr) == ("macOS13", "macOS", 13, "macOS13")


def test_fp16_io_on_ios15_is_rejected_with_the_reason() -> None:
    reason = check_feature("iOS15", Feature.FP16_IO)
    assert reason == "float16 inputs and outputs need iOS16 / macOS13 or later; target is iOS15"


@pytest.mark.parametrize(
    ("target", "allowed"),
    [("iOS15", False), ("iOS16", True), ("macOS12", False), ("macOS13", True), ("macOS15", True)],
)
def test_fp16_io(target: str, allowed: bool) -> None:
    assert (check_feature(target, Feature.FP16_IO) is None) is allowed


@pytest.mark.parametrize("feature", IOS18_FEATURES)
@pytest.mark.parametrize(
    ("target", "allowed"),
    [("iOS17", False), ("iOS18", True), ("macOS14", False), ("macOS15", True)],
)
def test_ios18_features(feature: Feature, target: str, allowed: bool) -> None:
    reason = check_feature(target, feature)
    assert (reason is None) is allowed
    if reason:
        assert "iOS18 / macOS15 or later" in reason
        assert reason.endswith(f"target is {target}")


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_target_allows_mlprogram(target: str) -> None:
    assert check_feature(target, Feature.MLPROGRAM) is None
    assert Feature.MLPROGRAM in allowed_features(target)


def test_allowed_features_of_macos14() -> None:
    assert allowed_features("macOS14") == {
        Feature.MLPROGRAM,
        Feature.FP16_IO,
        Feature.COMPRESSED_WEIGHTS,
        Feature.INT8_ACTIVATIONS,
    }


def test_int8_activations_need_ios17_and_compressed_weights_ios16() -> None:
    assert check_feature("macOS13", Feature.INT8_ACTIVATIONS) is not None
    assert check_feature("iOS17", Feature.INT8_ACTIVATIONS) is None
    assert check_feature("iOS15", Feature.COMPRESSED_WEIGHTS) is not None
    assert check_feature("macOS13", Feature.COMPRESSED_WEIGHTS) is None


def test_unknown_target_lists_known_ones() -> None:
    with pytest.raises(InputError, match="unknown deployment target 'iOS99'.*iOS15.*macOS15"):
        get_target("iOS99")
    with pytest.raises(InputError):
        check_feature("watchOS9", Feature.FP16_IO)


def test_ct_target_imports_coremltools_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("coremltools")
    fake.target = types.SimpleNamespace(iOS16="ios16-object")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "coremltools", fake)
    assert TARGETS["iOS16"].ct_target() == "ios16-object"


def test_ct_target_names_exist_in_coremltools() -> None:
    ct = pytest.importorskip("coremltools")
    for t in TARGETS.values():
        assert t.ct_target() is getattr(ct.target, t.name)
    # iOS N and macOS N-3 are the same Core ML specification.
    assert TARGETS["iOS16"].ct_target() == TARGETS["macOS13"].ct_target()
