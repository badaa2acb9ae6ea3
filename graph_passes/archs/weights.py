"""Taking a checkpoint's tensors by name, for the adapters: every tensor is either mapped or
named in an error, never dropped silently."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graph_passes.errors import InputError


class WeightReader:
    """Takes tensors out of a state dict by name, checking shapes, and tracks what is left."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], architecture: str) -> None:
        self._sd = state_dict
        self._left = set(state_dict)
        self._arch = architecture

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``key`` in fp32; InputError when it is missing or not ``shape``.

        An fp32 tensor is handed through, not copied: canonical weights are read-only (every
        rewrite builds new tensors; tests/test_bc1l.py checks a whole rewrite leaves the
        loaded model's tensors as they were), and a copy of every weight beside the loaded
        model was one fp32 checkpoint more in the rewrite step (Gemma 3 270M: 1 GB)."""
        if key not in self._sd:
            raise InputError(f"checkpoint tensor {key!r} is missing (expected shape {shape})")
        tensor = self._sd[key]
        if tuple(tensor.shape) != shape:
            raise InputError(
                f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}; the config "
                f"implies {shape}"
            )
        self._left.discard(key)
        return tensor.detach().to(torch.float32)

    def skip(self, key: str) -> None:
        """Count ``key`` as handled without reading it: a tensor the adapter leaves out on
        purpose (an index buffer, an unused pooler, a tied LM head)."""
        self._left.discard(key)

    def finish(self) -> None:
        """InputError naming the tensors neither taken nor skipped, if any."""
        if self._left:
            names = ", ".join(sorted(self._left)[:8])
            more = f" (and {len(self._left) - 8} more)" if len(self._left) > 8 else ""
            raise InputError(
                f"checkpoint tensors not mapped by the {self._arch} adapter: {names}{more}; "
                "anec refuses to drop weights silently"
            )
