"""How far plain fp32 arithmetic moves a decoder's layer outputs from fp64, per position.

    python bench/fp32_vs_fp64.py [--recipe gemma-3-270m-draft-kv] [--new-tokens 512]

For each fixture prompt of the recipe: the checkpoint's greedy continuation (transformers,
fp32), then the whole sequence scored once in fp32 and once in fp64 with no cache, and per
layer the worst ``||h32 - h64|| / ||h64||`` over positions. This is what an exact computation
in fp32 gives at each position, the floor under the fp32 cache level's per-layer gate
(`parity.kv_fp32`): a program can be no closer to the fp64 reference than fp32 itself, and
positions where this floor is high are where a model amplifies rounding. Prints the five
worst (value, layer, position) per prompt; figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    """Score each fixture's continuation in fp32 and fp64 and print the worst layers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="gemma-3-270m-draft-kv")
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()

    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import load_recipe, locate_recipe

    recipe = load_recipe(locate_recipe(args.recipe))
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model = ckpt.model.float().eval()
    torch.set_grad_enabled(False)
    for i, prompt in enumerate(recipe.fixtures.prompts):
        start = time.perf_counter()
        ids = ckpt.tokenizer(prompt, return_tensors="pt").input_ids
        seq = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        h32 = model(seq, output_hidden_states=True).hidden_states
        h64 = model.double()(seq, output_hidden_states=True).hidden_states
        model.float()
        worst = []
        # hidden_states[0] is the embedding; the last entry is after the final norm
        for layer in range(1, len(h32)):
            a, b = h32[layer][0].double(), h64[layer][0]
            rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
            worst.append((float(rel.max()), layer - 1, int(rel.argmax())))
        worst.sort(reverse=True)
        shown = ", ".join(f"{v:.2e} at layer {layer}, position {p}" for v, layer, p in worst[:5])
        print(f"prompt[{i}], {seq.shape[1]} tokens ({time.perf_counter() - start:.0f} s): {shown}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
