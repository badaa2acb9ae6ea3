"""State kernels (iOS 18 / macOS 15 stateful programs): read_state, coreml_update_state, and
slice_update, the op a state's partial write is made of.

A state is held in the evaluator's environment as a `StateSlot`: the caller passes the
state's value into `Evaluator.run` and reads the updated value back after the run, which is
how a runtime's ``MLState`` persists between predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity.mil.kernels.shape import slice_index
from parity.mil.registry import Call, kernel


@dataclass
class StateSlot:
    """The current value of one state during a run (stored as the profile stores floats)."""

    name: str
    value: np.ndarray


@kernel("read_state", exact=True)
def read_state(call: Call) -> np.ndarray:
    """The state's current value."""
    slot = call["input"]
    assert isinstance(slot, StateSlot)
    return slot.value


@kernel("coreml_update_state", exact=True)
def coreml_update_state(call: Call) -> np.ndarray:
    """Write ``value`` into the state (same shape) and return it."""
    slot, value = call["state"], np.asarray(call["value"])
    assert isinstance(slot, StateSlot)
    if value.shape != slot.value.shape:
        raise ValueError(f"state {slot.name}: value {value.shape}, state {slot.value.shape}")
    slot.value = value
    return value


@kernel(
    "slice_update",
    attributes=("stride", "begin_mask", "end_mask", "squeeze_mask"),
    exact=True,
)
def slice_update(call: Call) -> np.ndarray:
    """``x`` with ``x[begin:end:stride] = update`` (slice_by_index's indexing); begin and end
    may be run-time values. An update whose shape differs from the slice is an error."""
    x = np.array(call["x"], copy=True)
    update = np.asarray(call["update"])
    index = slice_index(call, x.ndim)
    target = x[index]
    if np.shape(target) != update.shape:
        raise ValueError(f"update of shape {update.shape} for a slice of shape {target.shape}")
    x[index] = update
    return x
