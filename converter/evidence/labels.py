"""The evidence labels every placement or speed figure carries (SPEC section 5).

One enum for every report, so a figure can never be labelled with a word of its own:
``static`` (anec's placement rules on the MIL program), ``compute-plan`` (MLComputePlan on
macOS), ``observed`` (measured on Apple hardware at run time) and ``predicted`` (the cost
model). A report section carries exactly one of them; never mix them in one figure.
"""

from __future__ import annotations

from enum import Enum


class Evidence(str, Enum):
    """Where a figure comes from; its value is the label printed in reports."""

    STATIC = "static"
    COMPUTE_PLAN = "compute-plan"
    OBSERVED = "observed"
    PREDICTED = "predicted"

    def __str__(self) -> str:
        return self.value


# What each label promises, printed beside it in reports that people read.
MEANING: dict[Evidence, str] = {
    Evidence.STATIC: "anec's own placement rules applied to the MIL program (no Apple software "
    "involved); a prediction, not a measurement",
    Evidence.COMPUTE_PLAN: "Core ML's MLComputePlan on macOS: Apple's planned (preferred) device "
    "per op; what the planner intends, not what ran",
    Evidence.OBSERVED: "measured at run time on Apple hardware",
    Evidence.PREDICTED: "anec's cost model (a floor from published chip figures); a model, "
    "not a measurement",
}
