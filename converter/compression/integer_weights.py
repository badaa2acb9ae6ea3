"""Integer weights written into a program as they were computed (GPTQ's integers, a source
checkpoint's own block grid): one ``constexpr_blockwise_shift_scale`` per weight (iOS 18 /
macOS 15; per-row int8 before that ``constexpr_affine_dequantize``), named ``<const>_quantized``
(``records.py`` finds the op by that suffix).

Written here rather than by coremltools' ``linear_quantize_weights``, which would recompute
scales from the values and could move the integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SUFFIX = "_quantized"


@dataclass(frozen=True)
class Integers:
    """One weight as ``scale * (q - offset)``: ``scale`` (and ``offset``) fp16 with the rank of
    ``q``, one value per block of ``q`` (a block's size is ``q.shape / scale.shape`` per axis)."""

    q: np.ndarray  # int8 holding the values (int4 range when bits == 4)
    scale: np.ndarray
    bits: int
    offset: np.ndarray | None = None

    def decode(self) -> np.ndarray:
        """What the program computes from the stored values: fp32 products, rounded to fp16."""
        scale = _blocks(self.scale.astype(np.float32), self.q.shape)
        q = self.q.astype(np.float32)
        if self.offset is not None:
            q = q - _blocks(self.offset.astype(np.float32), self.q.shape)
        return (scale * q).astype(np.float16).astype(np.float32)


def _blocks(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` (one per block) repeated to ``shape``."""
    for axis, (n, m) in enumerate(zip(shape, values.shape, strict=True)):
        values = np.repeat(values, n // m, axis=axis)
    return values


def _data(q: np.ndarray, bits: int) -> np.ndarray:
    from coremltools.converters.mil.mil import types

    if bits == 4:
        return q.astype(types.np_int4_dtype)
    return q


def write_integers(mlmodel: Any, values: dict[str, Integers]) -> Any:
    """A new MLModel whose named weight consts are constexpr ops holding ``values``."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.models.utils import _apply_graph_pass

    from converter.compression.methods.base import quiet_progress

    class Write(AbstractGraphPass):
        def apply(self, prog: Any) -> None:
            from coremltools.converters.mil._deployment_compatibility import AvailableTarget

            f = prog.functions["main"]
            ios18 = f.opset_version is not None and f.opset_version >= AvailableTarget.iOS18
            ops = {op.outputs[0].name: op for op in f.operations if op.op_type == "const"}
            with f:
                for const, w in values.items():
                    old = ops[const]
                    if ios18:
                        extra = {} if w.offset is None else {"offset": w.offset}
                        new = mb.constexpr_blockwise_shift_scale(
                            data=_data(w.q, w.bits), scale=w.scale, before_op=old,
                            name=const + SUFFIX, **extra,
                        )  # fmt: skip
                    elif w.bits == 8 and w.offset is None and w.scale.size == w.q.shape[0]:
                        new = mb.constexpr_affine_dequantize(
                            quantized_data=w.q, zero_point=np.int8(0),
                            scale=w.scale.reshape(-1), axis=0, before_op=old,
                            name=const + SUFFIX,
                        )  # fmt: skip
                    else:  # the methods ask for the feature (targets.Feature.BLOCKWISE_INT4)
                        raise ValueError(f"{const}: int{w.bits} blocks need iOS 18 / macOS 15")
                    f.replace_uses_of_var_after_op(
                        anchor_op=old, old_var=old.outputs[0], new_var=new
                    )
                    f.remove_ops([old])

    with quiet_progress():
        return _apply_graph_pass(mlmodel, Write())
