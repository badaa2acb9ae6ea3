"""The kernel registry: which MIL op types the evaluator implements, and their semantics.

A kernel registers for one or more op types with the attributes whose values change what the
op computes (conv groups and padding, gelu mode, reduction axes, ...). ``signature`` names an
op by those values, so a coverage test can list every distinct semantics a program uses, and
``unsupported`` says why an op cannot be evaluated before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity.mil.numerics import Arithmetic
from parity.mil.program import dtype_name

# A kernel returns one array per op output (a bare array for single-output ops).
Kernel = Callable[["Call"], "np.ndarray | list[np.ndarray]"]
Check = Callable[[Any], "str | None"]


class Call:
    """One op invocation: its input values (fp32 for floats) and the profile's arithmetic."""

    def __init__(self, op: Any, values: dict[str, Any], arith: Arithmetic) -> None:
        self.op = op
        self.values = values
        self.arith = arith
        # Set by a kernel whose result this time holds only values already stored (a product
        # with a 0 / 1 mask): the evaluator then skips rounding it, which could not change it.
        self.exact = False

    def __getitem__(self, name: str) -> Any:
        value = self.values.get(name)
        if value is None:
            raise KeyError(f"input {name!r} is required")
        return value

    def get(self, name: str, default: Any = None) -> Any:
        """The input's value, or ``default`` when the op does not have it."""
        value = self.values.get(name)
        return default if value is None else value

    def integer(self, name: str, default: int | None = None) -> int:
        """A scalar integer attribute."""
        value = self.get(name)
        if value is None:
            if default is None:
                raise KeyError(f"input {name!r} is required")
            return default
        return int(np.asarray(value).reshape(()))

    def integers(self, name: str) -> list[int] | None:
        """An integer vector attribute, or None when absent."""
        value = self.get(name)
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]

    def flag(self, name: str, default: bool = False) -> bool:
        """A scalar bool attribute."""
        value = self.get(name)
        return default if value is None else bool(np.asarray(value).reshape(()))

    def flags(self, name: str, size: int) -> list[bool]:
        """A bool vector attribute (all False when absent)."""
        value = self.get(name)
        if value is None:
            return [False] * size
        return [bool(v) for v in np.asarray(value).reshape(-1)]

    def number(self, name: str, default: float | None = None) -> float:
        """A scalar float attribute."""
        value = self.get(name)
        if value is None:
            if default is None:
                raise KeyError(f"input {name!r} is required")
            return default
        return float(np.asarray(value).reshape(()))

    def text(self, name: str, default: str | None = None) -> str:
        """A string attribute."""
        value = self.get(name)
        if value is None:
            if default is None:
                raise KeyError(f"input {name!r} is required")
            return default
        return str(value.item() if isinstance(value, np.ndarray) else value)

    def out_dtype(self, index: int = 0) -> str:
        """The declared dtype of an output, e.g. ``fp16`` or ``int32``."""
        return dtype_name(self.op.outputs[index])


@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel and what it needs to know about an op's semantics."""

    op_type: str
    fn: Kernel
    attributes: tuple[str, ...]
    check: Check | None
    exact: bool = False  # results only move or select input values: nothing to round
    # Inputs the kernel only reads while it runs (its result never holds them): a packed fp16
    # constant there is widened into the evaluator's reused buffer (`Evaluator._borrowed`).
    borrows: tuple[str, ...] = ()


KERNELS: dict[str, KernelSpec] = {}


def kernel(
    *op_types: str,
    attributes: tuple[str, ...] = (),
    check: Check | None = None,
    exact: bool = False,
    borrows: tuple[str, ...] = (),
) -> Callable[[Kernel], Kernel]:
    """Register ``fn`` for ``op_types``; ``attributes`` are the semantic const inputs.

    An attribute ``dtype:<input>`` names an input's element type instead of its value, and
    ``has:<input>`` whether the op has that input at all (an opset's form of the op).
    ``exact`` kernels only move or select values already stored: the evaluator skips the
    profile's rounding of their results (it could not change them). ``borrows`` names
    inputs the kernel reads only during its call and never returns (nor a view of them).
    """

    def register(fn: Kernel) -> Kernel:
        for op_type in op_types:
            if op_type in KERNELS:
                raise ValueError(f"two kernels for MIL op type {op_type!r}")
            KERNELS[op_type] = KernelSpec(op_type, fn, attributes, check, exact, borrows)
        return fn

    return register


def _attr_text(value: Any) -> str:
    if isinstance(value, np.ndarray):
        if value.size > 8:
            return f"<{value.size} values>"
        return str(value.tolist()).replace(" ", "")
    if isinstance(value, np.generic):
        return str(value.item())
    return str(value)


def signature(op: Any) -> str:
    """The op type with the values of its semantic attributes, e.g. ``gelu(mode=EXACT)``.

    Ops without a kernel are named by their type alone.
    """
    spec = KERNELS.get(op.op_type)
    if spec is None or not spec.attributes:
        return op.op_type
    parts = []
    for name in spec.attributes:
        if name.startswith("dtype:"):  # the declared dtype of an input, not a const value
            var = getattr(op, name[6:], None)
            parts.append(f"{name[6:]}.dtype={dtype_name(var) if var is not None else '-'}")
            continue
        if name.startswith("has:"):  # whether the op has an input (e.g. an opset's form)
            key = name[4:]
            present = key in op.input_spec.input_types and getattr(op, key, None) is not None
            parts.append(f"{key}={'yes' if present else '-'}")
            continue
        var = getattr(op, name, None)
        if var is None:
            parts.append(f"{name}=-")
        elif var.val is None:
            parts.append(f"{name}=<dynamic>")
        else:
            parts.append(f"{name}={_attr_text(var.val)}")
    return f"{op.op_type}({', '.join(parts)})"


def unsupported(op: Any) -> str | None:
    """Why ``op`` cannot be evaluated, or None when its kernel supports it."""
    spec = KERNELS.get(op.op_type)
    if spec is None:
        return "unknown op type"
    return spec.check(op) if spec.check is not None else None
