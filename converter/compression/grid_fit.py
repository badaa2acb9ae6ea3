"""Find the integer grid a weight already lies on: a checkpoint de-quantized from a block
format (GGUF's Q4_0, Q4_1 and Q8_0 store 32 consecutive input values as integers with one
fp16 scale, and for Q4_1 one fp16 minimum) holds values ``scale * (q - offset)`` per block.

Such a weight is re-encoded on its own grid with no rounding beyond fp16's, where palettes or
per-row integers would quantize it a second time (``methods/grid.py``). The grid is fitted
per block (the integers from the block's range, then scale and offset by least squares on
them) and accepted only when every value of the weight is within ``TOLERANCE`` of its block's
maximum |value|: fp16 storage of the values and of the scale and offset moves a value on the
grid by at most about 2**-10 of that maximum (1.19 * 2**-10 measured on SmolLM2's Q4_1
weights), while a block of 32 values off the grid has one at nearly half a step (2**-8 of the
maximum for 8 bits, 2**-4 for 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from converter.compression.integer_weights import Integers

TOLERANCE = 2.0**-9

# llama.cpp's K-quants (Q2_K .. Q8_K: the packaged Gemma 3 is Q4_K and Q6_K) scale each block
# of 16 or 32 values by a 4-, 6- or 8-bit integer times the super-block's fp16 scale (and
# Q4_K / Q5_K subtract a minimum built alike). That product needs up to 19 significant bits:
# one fp16 scale per block cannot hold it, and their 4-bit blocks need not span levels 0..15
# (measured on Gemma 3 270M's GGUF: its Q4_K and Q6_K weights lie on none of `GRIDS`, its Q5_0
# and Q8_0 weights on int8 exactly; tests/test_gemma3_package.py). Method grid refuses a source
# holding them.
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


@dataclass(frozen=True)
class Grid:
    """A block grid: ``bits`` wide, symmetric (``scale * q``) or affine (an offset per block)."""

    bits: int
    symmetric: bool


# Cheapest first (bits per weight at blocks of 32: 4.5, 5.0, 8.5): Q4_0, Q4_1, Q8_0.
GRIDS = (Grid(4, True), Grid(4, False), Grid(8, True))


def _fit(blocks: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Integers, scale and offset (None if symmetric) of ``blocks`` (R, N, b) on ``grid``,
    the scale and offset least-squares fitted to the integers, both rounded to fp16."""
    levels = 2**grid.bits - 1
    if grid.symmetric:
        top = 2 ** (grid.bits - 1)
        peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
        # Where the largest |value| sits: at +-(top - 1) (Q8_0: d = amax / 127), or at -top
        # with a scale of either sign (Q4_0: d = max / -8). Each block takes the better fit.
        best = None
        for scale in (np.abs(peak) / (top - 1), -peak / top):
            safe = np.where(scale == 0, 1, scale)
            q = np.clip(np.rint(blocks / safe[..., None]), -top, top - 1)
            den = (q * q).sum(-1)
            fit = np.where(den > 0, (q * blocks).sum(-1) / np.where(den > 0, den, 1), 1.0)
            err = np.abs(q * fit[..., None] - blocks).max(-1)
            if best is None:
                best = (q, fit, err)
            else:
                take = err < best[2]
                best = (np.where(take[..., None], q, best[0]), np.where(take, fit, best[1]),
                        np.minimum(err, best[2]))  # fmt: skip
        assert best is not None
        return best[0], best[1].astype(np.float16), None
    lo, hi = blocks.min(-1), blocks.max(-1)
    step = (hi - lo) / levels
    q = np.rint((blocks - lo[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, levels)
    # least squares of v = m + d q per block
    n = blocks.shape[-1]
    sq, sv = q.sum(-1), blocks.sum(-1)
    sqq, sqv = (q * q).sum(-1), (q * blocks).sum(-1)
    det = n * sqq - sq * sq
    flat = det == 0  # every value equal: q = 0, value = -offset at scale 1
    d = np.where(flat, 1.0, (n * sqv - sq * sv) / np.where(flat, 1, det))
    m = np.where(flat, lo, (sv - d * sq) / n)
    scale = d.astype(np.float16)
    # Signed integers q - 2**(bits-1) and an offset on the grid of fp16's spacing at the
    # largest |q - offset| (or |offset|): then q - offset is exact in fp16 as in fp32, and the
    # program decodes alike whichever precision a runtime subtracts in (coremltools: fp16).
    half = 2 ** (grid.bits - 1)
    offset = -m / scale.astype(np.float64) - half
    reach = np.maximum(
        np.maximum(np.abs(-half - offset), np.abs(half - 1 - offset)), np.abs(offset)
    )
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(reach, 2.0**-14))) - 10)
    offset = np.rint(offset / spacing) * spacing
    return q - half, scale, offset.astype(np.float16)


def find_grid(weight: np.ndarray, block: int) -> tuple[Grid, Integers] | None:
    """The cheapest grid of ``GRIDS`` that reproduces ``weight`` (O, I, ...), blocks of
    ``block`` consecutive inputs, within ``TOLERANCE``; None if it lies on none."""
    rows, inputs = weight.shape[0], int(np.prod(weight.shape[1:]))
    if inputs % block or any(n != 1 for n in weight.shape[2:]):  # 1x1 convs and matrices
        return None
    w = weight.astype(np.float64).reshape(rows, inputs // block, block)
    bound = TOLERANCE * np.abs(w).max(-1, keepdims=True)
    shape = (rows, inputs // block) + (1,) * (weight.ndim - 2)  # one scale per block
    for grid in GRIDS:
        q, scale, offset = _fit(w, grid)
        ints = Integers(
            q.astype(np.int8).reshape(weight.shape),
            scale.reshape(shape),
            grid.bits,
            None if offset is None else offset.reshape(shape),
        )
        decoded = ints.decode().reshape(rows, inputs // block, block)
        if np.all(np.abs(decoded - w) <= bound):
            return grid, ints
    return None


def k_quant_tensors(tensor_types: dict[str, str]) -> dict[str, str]:
    """The tensors (name -> GGML type) stored in a K-quant format, which no grid holds."""
    return {name: kind for name, kind in tensor_types.items() if kind in K_QUANTS}
