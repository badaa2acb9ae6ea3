"""Copies of a BC1L module (decoder or encoder) that a variant's parity levels run: in
another dtype without a full-precision copy first, with a variant's decoded weights, with the
values an fp16 program stores, and fp64 one piece at a time. At Qwen2.5-0.5B size each whole
copy is GBs (bench/README.md, ``compress.py methods``), so none is made that a level does not
need."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

M = TypeVar("M", bound=torch.nn.Module)


def with_weights(
    module: M, weights: dict[str, np.ndarray], dtype: torch.dtype = torch.float32
) -> M:
    """A copy of ``module`` in ``dtype`` whose named parameters hold ``weights``."""
    return set_weights(cast_copy(module, dtype), weights)


def cast_copy(module: M, dtype: torch.dtype) -> M:
    """A deep copy of ``module`` (in eval mode) with its floating-point parameters and buffers
    in ``dtype``, made without a full copy in the original dtype first (at Qwen2.5-0.5B size an
    fp32 copy is 2 GB)."""
    return _copy_replacing(module, lambda t: t.to(dtype, copy=True))


def set_weights(module: M, weights: dict[str, np.ndarray]) -> M:
    """``module`` itself with its named parameters holding ``weights``."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            tensor = torch.from_numpy(np.asarray(value))
            params[name].copy_(tensor.reshape(params[name].shape))
    return module


def program_constants(module: M, precision: str = "float16") -> M:
    """A copy (eval mode) whose parameters and buffers hold the values a program of
    ``precision`` stores: fp16-rounded for "float16", unchanged otherwise."""
    if precision != "float16":
        return copy.deepcopy(module).eval()
    return _copy_replacing(module, lambda t: t.half().to(t.dtype))


def float64_program_copy(
    module: M, weights: dict[str, np.ndarray], others_in_fp16: bool = True
) -> M:
    """A copy of ``module`` for `in_float64` holding the values an fp16 program stores, the
    named parameters holding ``weights``: in fp64 it computes exactly what
    ``set_weights(program_constants(module), weights)`` computes, without that whole fp32 copy.

    Each named parameter holds its array itself, in the array's own dtype (shared, not copied;
    a read-only or already used array is copied); every other floating-point parameter and
    buffer its fp16-rounded value, held in fp16 (``others_in_fp16``) or in its own dtype.
    `in_float64` widens every value exactly. At Qwen2.5-0.5B size the whole copy was 1.84 GiB
    beside 1.33 GiB of fp32 weights (bench/README.md, ``compress.py methods``); the caller
    drops its own references to ``weights`` so the copy owns them."""
    params = dict(module.named_parameters())
    memo: dict[int, Any] = {}
    used: set[int] = set()
    for name, value in weights.items():
        param = params[name]
        array = np.asarray(value)
        if not array.flags.writeable or array.ctypes.data in used:
            array = array.copy()  # torch may not share a read-only array; no two share one
        used.add(array.ctypes.data)
        shared = torch.from_numpy(array).reshape(param.shape)
        memo[id(param)] = torch.nn.Parameter(shared, requires_grad=param.requires_grad)
    # as program_constants rounds
    rounded = (lambda t: t.half()) if others_in_fp16 else (lambda t: t.half().to(t.dtype))
    return _copy_replacing(module, rounded, memo)


def _copy_replacing(
    module: M, replace: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any] | None = None
) -> M:
    """A deep copy (eval mode) of ``module`` whose floating-point parameters and buffers are
    ``replace`` of the originals (those ``memo`` already maps excepted): the replacements go
    into deepcopy's memo, so no copy of the original values is ever made."""
    memo = {} if memo is None else memo
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point() and id(tensor) not in memo:
            new = replace(tensor.detach())
            if isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = new
    return copy.deepcopy(module, memo).eval()


@contextlib.contextmanager
def in_float64(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` in fp64 holding one fp64 piece at a time: each called submodule (the
    children, list entries unpacked) is made fp64 just before its forward and given its own
    floating-point tensors back just after (exact: fp32 values are fp64 values), the root's
    own buffers for the whole block."""

    def pieces(parent: torch.nn.Module) -> Iterator[torch.nn.Module]:
        for child in parent.children():
            if isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict):
                yield from pieces(child)
            else:
                yield child

    Held = list[tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]]
    held: dict[torch.nn.Module, Held] = {}

    def floats(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {n: t.data for n, t in tensors.items() if t is not None and t.is_floating_point()}

    def to64(piece: torch.nn.Module, args: Any) -> None:
        # The tensors themselves are put back, not fp32 copies made: with copies the fp32
        # check's torch run rose 0.83 GiB at Qwen2.5-0.5B size, put back 0.4 (bench/README).
        held[piece] = [(m, floats(m._parameters), floats(m._buffers)) for m in piece.modules()]
        piece.double()

    def restore(piece: torch.nn.Module) -> None:
        for owner, params, buffers in held.pop(piece):
            for name, data in params.items():
                param = owner._parameters[name]
                assert param is not None
                param.data = data
            owner._buffers.update(buffers)

    def to32(piece: torch.nn.Module, args: Any, out: Any) -> None:
        restore(piece)

    own = {name: b for name, b in module.named_buffers(recurse=False) if b.is_floating_point()}
    handles = []
    for piece in pieces(module):
        handles += [piece.register_forward_pre_hook(to64), piece.register_forward_hook(to32)]
    for name, buffer in own.items():
        setattr(module, name, buffer.double())
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for piece in list(held):  # a forward that raised: its piece is still fp64
            restore(piece)
        for name, buffer in own.items():
            setattr(module, name, buffer)
