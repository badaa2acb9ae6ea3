"""The parity steps' torch thread limit applies inside its block only."""

from __future__ import annotations

import pytest
import torch

from parity.torch_settings import PARITY_THREADS, torch_threads


def test_torch_threads_sets_the_count_inside_and_restores_it_after() -> None:
    before = torch.get_num_threads()
    other = 2 if before != 2 else 3
    torch.set_num_threads(other)
    try:
        with torch_threads():
            assert torch.get_num_threads() == PARITY_THREADS
        assert torch.get_num_threads() == other
        with pytest.raises(RuntimeError), torch_threads():
            raise RuntimeError("a failing step")
        assert torch.get_num_threads() == other
        with torch_threads(None):
            assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)
