"""Deployment targets and the Core ML features each one allows.

This module is the single table to edit when a target's capabilities are learned: recipes,
compression and emitting ask `check_feature` instead of comparing version numbers themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from converter.errors import InputError

Platform = Literal["iOS", "macOS"]
# Stored weight megabytes (10^6 bytes) per package of a chunked cached decoder, by platform
# (Anemll's chunk sizes): a recipe's `cache.package_budget_mb` overrides it.
DEFAULT_PACKAGE_BUDGET_MB: dict[Platform, int] = {"iOS": 1000, "macOS": 2000}
MB = 1_000_000  # package_budget_mb counts decimal megabytes


def package_budget_bytes(budget_mb: float | None, platform: Platform) -> int:
    """The per-package weight budget in bytes: the recipe's, or the platform's default."""
    mb = DEFAULT_PACKAGE_BUDGET_MB[platform] if budget_mb is None else budget_mb
    return int(mb * MB)


@dataclass(frozen=True)
class Target:
    """One minimum deployment target, e.g. iOS16 or macOS13."""

    name: str
    platform: Platform
    major: int
    ct_attr: str  # attribute of coremltools.target, e.g. "iOS16" or "macOS13"

    def ct_target(self) -> Any:
        """Return the matching `coremltools.target` member (imports coremltools lazily)."""
        # Lazy: coremltools is slow to import and not needed to validate a recipe.
        import coremltools as ct

        return getattr(ct.target, self.ct_attr)


def _target(platform: Platform, major: int) -> Target:
    name = f"{platform}{major}"
    return Target(name=name, platform=platform, major=major, ct_attr=name)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        *(_target("iOS", major) for major in range(15, 19)),
        *(_target("macOS", major) for major in range(12, 16)),
    ]
}


class Feature(Enum):
    """A Core ML capability that only some deployment targets allow."""

    MLPROGRAM = "mlprogram"
    FP16_IO = "fp16-io"
    GROUPED_PALETTE = "grouped-palette"
    PALETTE_3BIT = "palette-3bit"
    STATES = "states"
    SDPA = "sdpa"
    MULTIFUNCTION = "multifunction"
    BLOCKWISE_INT4 = "blockwise-int4"
    COMPRESSED_WEIGHTS = "compressed-weights"
    INT8_ACTIVATIONS = "int8-activations"


@dataclass(frozen=True)
class _Requirement:
    what: str  # a plural noun phrase: "<what> need iOS16 / macOS13 or later"
    min_ios: int
    min_macos: int

    def min_major(self, platform: Platform) -> int:
        return self.min_ios if platform == "iOS" else self.min_macos


# Minimum versions per feature. iOS N and macOS N-3 share a Core ML specification version.
_REQUIREMENTS: dict[Feature, _Requirement] = {
    Feature.MLPROGRAM: _Requirement("ML Program models", 15, 12),
    Feature.FP16_IO: _Requirement("float16 inputs and outputs", 16, 13),
    Feature.GROUPED_PALETTE: _Requirement("grouped-channel palettes", 18, 15),
    Feature.PALETTE_3BIT: _Requirement("3-bit palettes", 18, 15),
    Feature.STATES: _Requirement("stateful models (MLState)", 18, 15),
    Feature.SDPA: _Requirement("fused scaled_dot_product_attention ops", 18, 15),
    Feature.MULTIFUNCTION: _Requirement("multifunction models", 18, 15),
    Feature.BLOCKWISE_INT4: _Requirement("block-wise int4 weights", 18, 15),
    Feature.COMPRESSED_WEIGHTS: _Requirement("palettized and int8 weights", 16, 13),
    Feature.INT8_ACTIVATIONS: _Requirement("int8 activation quantize/dequantize ops", 17, 14),
}


def get_target(name: str) -> Target:
    """Return the target called `name`, or raise InputError listing the known targets."""
    try:
        return TARGETS[name]
    except KeyError:
        known = ", ".join(TARGETS)
        raise InputError(f"unknown deployment target {name!r}; expected one of {known}") from None


def check_feature(target_name: str, feature: Feature) -> str | None:
    """Return why `target_name` does not allow `feature`, or None when it does.

    Example reason: "float16 inputs and outputs need iOS16 / macOS13 or later; target is iOS15".
    """
    target = get_target(target_name)
    req = _REQUIREMENTS[feature]
    if target.major >= req.min_major(target.platform):
        return None
    versions = f"iOS{req.min_ios} / macOS{req.min_macos}"
    return f"{req.what} need {versions} or later; target is {target.name}"


def allowed_features(target_name: str) -> frozenset[Feature]:
    """Return every feature that `target_name` allows."""
    return frozenset(f for f in Feature if check_feature(target_name, f) is None)
