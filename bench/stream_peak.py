"""SmolLM2's residual-stream peak: how close its fp32 values come to fp16's largest (65,504).

Two measurements of the original model (transformers, fp32) in one run:

* every vocabulary entry as the first token: the largest |h| at position 0 over all layers
  (position 0 attends only to itself, so this covers every possible first token exactly);
* every fixture of the shipped recipe: the largest |h| and the layer and position holding it.

The converter scales the stream by a power of two only when a measured value exceeds 2^15
(`graph_passes.stream_scale.LIMIT`); this shows how far the worst first token stays below.

Usage: ``python bench/stream_peak.py [--top N] [--batch N]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from converter.checkpoints.loading import load_checkpoint  # noqa: E402
from converter.recipe import load_recipe  # noqa: E402
from graph_passes.stream_scale import FP16_MAX, LIMIT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="first tokens to list")
    parser.add_argument("--batch", type=int, default=1024, help="first tokens per forward pass")
    args = parser.parse_args()

    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-draft.yaml")
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model, tok = ckpt.model, ckpt.tokenizer
    vocab = model.config.vocab_size

    start = time.perf_counter()
    first = torch.zeros(vocab)
    with torch.no_grad():
        for s in range(0, vocab, args.batch):
            ids = torch.arange(s, min(vocab, s + args.batch)).unsqueeze(1)
            states = model.model(ids, output_hidden_states=True).hidden_states[:-1]
            first[s : s + len(ids)] = torch.stack([h[:, 0].abs().amax(-1) for h in states]).amax(0)
    scan_s = time.perf_counter() - start

    print(f"First token scan: {vocab} tokens in {scan_s:.1f} s (fp32, transformers)")
    print(f"{'token id':>8}  {'text':<16} {'max |h|':>9}  {'fp16 margin':>11}")
    top = first.topk(args.top)
    for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        text = repr(tok.decode([index]))[:16]
        print(f"{index:>8}  {text:<16} {value:>9.1f}  {FP16_MAX / value:>10.2f}x")
    worst = float(top.values[0])
    print(f"scaling limit {LIMIT:g}: the worst first token is {LIMIT / worst:.3f}x below it")

    print("\nRecipe fixtures (unpadded):")
    print(f"{'fixture':<10} {'tokens':>6}  {'max |h|':>9}  {'entering layer':>14}  {'position':>8}")
    for i, prompt in enumerate(recipe.fixtures.prompts):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            states = model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        peaks = torch.stack([h[0].abs().amax(-1) for h in states[:-1]])  # (layers + 1, n)
        layer, position = divmod(int(peaks.argmax()), peaks.shape[1])
        print(f"prompt[{i}]  {len(ids):>6}  {float(peaks.max()):>9.1f}  {layer:>14}  {position:>8}")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"\npeak RSS {peak_kb:,} kB")


if __name__ == "__main__":
    main()
