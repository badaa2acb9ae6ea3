"""What an exact rewrite gives through the cache in fp32: the fp32 cache level's floor.

    python bench/kv_fp32_floor.py [--recipe gemma-3-270m-draft-kv] [--fixtures 0,1,2]

The fp32 cache level (`parity.kv_fp32`) holds the emitted program's every call, per layer and
position, to the recipe's ``fp32_layer_rel_error`` against the window module in fp64 over the
whole sequence. This runs the same level on the *torch* cached functions in fp32 (the rewrite
before any conversion: the same graph, torch's kernels), over each fixture's whole greedy
continuation: a program whose figure is near this one computes what the rewrite computes, and
a position where this figure is high is one where the model itself amplifies fp32 rounding.
Beside it, `bench/fp32_vs_fp64.py` gives plain transformers fp32 (no rewrite, no cache).
Prints every gate of the level with where it was worst; figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class TorchLayers:
    """Each layer's output of the last torch call (a `parity.kv_fp32.LayerCapture` stand-in,
    from forward hooks on the window module's blocks)."""

    def __init__(self, blocks: Sequence[torch.nn.Module]) -> None:
        self.start = 0
        self.problems: list[str] = []
        self.layers: list[np.ndarray] = [np.empty(0)] * len(blocks)
        for i, block in enumerate(blocks):
            block.register_forward_hook(self._keep(i))

    def _keep(self, i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            self.layers[i] = out[0, :, 0, :].double().numpy()

        return hook


def main() -> None:
    """Run the fp32 cache level on the torch cached functions and print its gates."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="gemma-3-270m-draft-kv")
    parser.add_argument("--fixtures", default="", help="comma-separated indices (default all)")
    parser.add_argument("--decode-steps", type=int, default=0, help="default: the recipe's")
    args = parser.parse_args()

    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import DecoderRecipe, load_recipe, locate_recipe
    from converter.tasks.kv_contract import function_calls
    from converter.tasks.text_generation import rewrite_decoder
    from graph_passes.cached_decoder import cached_functions
    from parity.kv_fp32 import cached_fp32_level, reference
    from parity.kv_session import CacheSession, session_for, torch_runner
    from parity.reference import continuation, originals

    torch.set_grad_enabled(False)
    recipe = load_recipe(locate_recipe(args.recipe))
    if not isinstance(recipe, DecoderRecipe) or recipe.cache is None:
        parser.error(f"{args.recipe}: not a cached decoder recipe (no cache: section)")
    cache = recipe.cache
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    rw = rewrite_decoder(recipe, ckpt)
    functions = cached_functions(rw.module, "state", cache.length,
                                 function_calls(cache.prefill, cache.extend))  # fmt: skip
    table = rw.embed_table.numpy()
    fixtures = originals(rw.fixtures)
    if args.fixtures:
        fixtures = [fixtures[int(i)] for i in args.fixtures.split(",")]
    steps = args.decode_steps or cache.decode_steps
    started = time.perf_counter()
    conts = [continuation(ckpt.model, f, steps) for f in fixtures]
    print(f"continuations: {time.perf_counter() - started:.0f} s", flush=True)
    capture = TorchLayers(rw.module.decoder_layers())

    def make_session() -> CacheSession:
        for m in functions.values():
            m.reset_cache()
        session = session_for(functions, torch_runner(functions, torch.float32), None,
                              lambda ids: table[ids])  # fmt: skip
        session.states = {"kv_cache": functions["decode"].kv_cache.numpy()}  # a view
        return session

    started = time.perf_counter()
    gates = cached_fp32_level(
        make_session, [capture], conts,  # type: ignore[list-item]
        lambda c: reference(functions, c, table, "float32", None), cache.extend,
        (recipe.gates.fp32_layer_rel_error, recipe.gates.fp32_logits_rel_error),
    )  # fmt: skip
    print(f"torch fp32 through the cache ({time.perf_counter() - started:.0f} s, "
          f"{torch.backends.cpu.get_cpu_capability()} kernels):")  # fmt: skip
    for g in gates:
        print(f"  {g.name}: {g.value:.3g} ({'pass' if g.passed else 'FAIL'}) {g.where}")


if __name__ == "__main__":
    main()
