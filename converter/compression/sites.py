"""Which constants of the fp16 program are weights, under which torch names, and which of them
a variant compresses.

coremltools names a weight constant after the traced parameter: ``layers.0.attention.qkv
.weight`` becomes ``layers_0_attention_qkv_weight`` plus a suffix its passes add
(``_to_fp16``). Only constants that feed a projection (conv, linear, matmul) and name a module
parameter are weights; buffers such as RoPE tables and the causal mask are never compressed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

PROJECTIONS = frozenset({"conv", "linear", "matmul"})
_SUFFIXES = ("_to_fp16", "")


@dataclass(frozen=True)
class WeightSite:
    """One weight constant of the program and the module parameter it holds."""

    name: str  # torch parameter name, e.g. "layers.0.mlp.down.weight"
    const: str  # the const op's name in the fp16 program
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name of the stored value ("float16")

    @property
    def elements(self) -> int:
        """Number of weight values."""
        return int(np.prod(self.shape))


def weight_sites(function: Any, parameter_names: Iterable[str]) -> list[WeightSite]:
    """Every weight constant of ``function`` that holds one of ``parameter_names``."""
    by_mangled = {n.replace(".", "_"): n for n in parameter_names}
    sites = []
    for op in function.operations:
        if op.op_type != "const":
            continue
        var = op.outputs[0]
        value = var.val
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            continue
        consumers = {child.op_type for child in var.child_ops}
        if not consumers or not consumers <= PROJECTIONS:
            continue
        for suffix in _SUFFIXES:
            base = var.name[: len(var.name) - len(suffix)] if suffix else var.name
            if var.name.endswith(suffix) and base in by_mangled:
                sites.append(
                    WeightSite(by_mangled[base], var.name, tuple(value.shape), value.dtype.name)
                )
                break
    return sites


def keep_reason(site: WeightSite, patterns: Iterable[str], min_elements: int) -> str | None:
    """Why ``site`` stays fp16 (a matching pattern, or too small), or None to compress it."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(site.name, pattern):
            return f"keep_fp16 pattern {pattern!r}"
    if site.elements < min_elements:
        return f"{site.elements} values < min_weight_elements {min_elements}"
    return None
