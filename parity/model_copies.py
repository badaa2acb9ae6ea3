"""Copies of a BC1L module (decoder or encoder) that a variant's parity levels run: in
another dtype without a full-precision copy first, with a variant's decoded weights, with the
values an fp16 program stores, and fp64 one piece at a time. At Qwen2.5-0.5B size each whole
copy is GBs (bench/README.md, ``compress.py methods``), so none is made that a level does not
need."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
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
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point() and id(tensor) not in memo:
            cast = tensor.detach().to(dtype, copy=True)
            if isinstance(tensor, torch.nn.Parameter):
                cast = torch.nn.Parameter(cast, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = cast
    return copy.deepcopy(module, memo).eval()


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
    out = copy.deepcopy(module).eval()
    with torch.no_grad():
        for tensor in [*out.parameters(), *out.buffers()]:
            if tensor.is_floating_point() and precision == "float16":
                tensor.copy_(tensor.half().float())
    return out


@contextlib.contextmanager
def in_float64(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` in fp64 holding one fp64 piece at a time: each called submodule (the
    children, list entries unpacked) is made fp64 just before its forward and fp32 again just
    after (exact: fp32 values are fp64 values), the root's own buffers for the whole block."""

    def pieces(parent: torch.nn.Module) -> Iterator[torch.nn.Module]:
        for child in parent.children():
            if isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict):
                yield from pieces(child)
            else:
                yield child

    def to64(piece: torch.nn.Module, args: Any) -> None:
        piece.double()

    def to32(piece: torch.nn.Module, args: Any, out: Any) -> None:
        piece.float()

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
        for name, buffer in own.items():
            setattr(module, name, buffer)
