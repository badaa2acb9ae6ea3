"""Axis helpers shared by the kernels (MIL axes may be negative, counted from the end)."""

from __future__ import annotations


def norm_axis(axis: int, rank: int) -> int:
    """A non-negative axis; raises IndexError outside ``[-rank, rank)``."""
    if not -rank <= axis < rank:
        raise IndexError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def norm_axes(axes: list[int] | None, rank: int) -> tuple[int, ...]:
    """Sorted non-negative axes; None means every axis."""
    if axes is None:
        return tuple(range(rank))
    normed = sorted({norm_axis(a, rank) for a in axes})
    if len(normed) != len(axes):
        raise ValueError(f"repeated axes {axes}")
    return tuple(normed)
