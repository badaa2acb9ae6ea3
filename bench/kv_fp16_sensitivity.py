"""Where a cached decoder's fp16 logits leave the reference along a long greedy continuation.

    python bench/kv_fp16_sensitivity.py RECIPE [--prompt 1] [--steps 512] [--threshold 0.25]

For issue 22's Gemma 3 state-cache gates. Takes the recipe's ``--prompt``-th fixture prompt,
its greedy continuation of ``--steps`` tokens by the original model in fp32 and the full
recompute's logits (``parity.reference.continuation``, as the cache gates do), then runs
the rewritten model's layers over the whole sequence in one call through the cached module's
own layer code (an empty cache, each local layer's window mask), in fp32 and cast to fp16 with
the torch levels' settings. Prints, per run, the largest |logit error| against the reference,
the positions over ``--threshold``, and the largest error within the first N decode steps.

Torch on the CPU, not the MIL evaluator: a figure of the BC1L form's fp16 arithmetic (one
valid order of roundings among many), not of the emitted program, and no cache traffic.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from converter.checkpoints.loading import load_checkpoint
from converter.recipe.loader import load_recipe
from converter.tasks.text_generation import Rewrite, rewrite_decoder
from graph_passes.cache_host import CallShape, call_inputs
from graph_passes.cached_decoder import CachedDecoder, CacheIO
from parity.kv_session import rope_rows
from parity.model_copies import cast_copy
from parity.reference import Continuation, continuation, originals
from parity.torch_settings import parity_torch

HEAD_POSITIONS = 64  # the LM head over this many positions at a time (V x 64 fp32 logits)
STEP_MARKS = (8, 64, 128, 256, 512, 1024)


@torch.no_grad()
def logit_errors(rw: Rewrite, ref: Continuation, dtype: torch.dtype) -> np.ndarray:
    """Largest |logit - reference| at each position from the prompt's last token on."""
    n = len(ref.ids)
    io = CacheIO("io", n, n, "all", rw.module.io.inputs)
    module = CachedDecoder(rw.module, io).eval()
    if dtype != torch.float32:
        module = cast_copy(module, dtype)
    host = call_inputs(CallShape(n, n, tuple(module.windows), "io"), 0, n, rope_rows(module))
    named = {k: torch.from_numpy(v).to(dtype) for k, v in host.items()}
    ids = torch.tensor([ref.ids])
    x = rw.embed_table[ids].to(dtype) if rw.module.io.inputs == "embeddings" else ids
    cache = torch.zeros(module.model_cache_shape(), dtype=dtype)
    h = module.window.embed_bc1l(x)
    layers = module.layers()
    for i, layer in enumerate(layers):
        h, _ = module.run_layer(i, layer, h, named, cache[i], cache[len(layers) + i])
    errors = []
    for start in range(len(ref.prompt) - 1, n, HEAD_POSITIONS):
        stop = min(start + HEAD_POSITIONS, n)
        chunks = module.window.head(h[:, :, :, start:stop])
        logits = torch.cat(chunks, dim=1)[0, :, 0, :].float().T.numpy()
        want = np.stack([ref.reference(p) for p in range(start, stop)])
        errors.append(np.abs(logits - want).max(axis=1))
    return np.concatenate(errors)


def report(name: str, errors: np.ndarray, first: int, threshold: float) -> list[str]:
    """Text lines for one run's per-position errors (position ``first`` is errors[0])."""
    worst = int(errors.argmax())
    over = [(first + int(i), float(errors[i])) for i in np.flatnonzero(errors > threshold)]
    marks = sorted({m for m in STEP_MARKS if m < len(errors)} | {len(errors) - 1})
    return [
        f"{name}: max |logit error| {errors.max():.4f} at position {first + worst}",
        f"  positions over {threshold}: "
        + (", ".join(f"{p} ({e:.3f})" for p, e in over) if over else "none"),
        "  max within the first N decode steps: "
        + ", ".join(f"{m}: {errors[: m + 1].max():.3f}" for m in marks),
    ]


def main() -> None:
    """Parse the arguments, build the continuation and print both runs' errors."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--prompt", type=int, default=1, help="fixture prompt index")
    parser.add_argument("--steps", type=int, default=512, help="greedy decode steps")
    parser.add_argument("--threshold", type=float, default=0.25, help="|logit error| to list")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    with parity_torch():
        rw = rewrite_decoder(recipe, ckpt)  # type: ignore[arg-type]
        fixture = originals(rw.fixtures)[args.prompt]
        ref = continuation(ckpt.model, fixture, args.steps)
        first = len(ref.prompt) - 1
        print(f"{recipe.name}, {fixture.name}: {len(ref.prompt)} prompt tokens + {args.steps}")
        for dtype in (torch.float32, torch.float16):
            errors = logit_errors(rw, ref, dtype)
            print("\n".join(report(f"torch {dtype}".replace("torch.", ""), errors, first,
                                   args.threshold)))  # fmt: skip


if __name__ == "__main__":
    main()
