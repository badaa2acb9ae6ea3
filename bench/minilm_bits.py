"""How far 4-bit weights move MiniLM's sentence embeddings, by rounding and by GPTQ.

    python bench/minilm_bits.py [--sentences 300]

The packaged all-MiniLM-L6-v2 (real fp32 weights) in transformers fp32, every encoder-layer
projection re-quantized, judged as the compressed MiniLM recipe judges: the mean-pooled,
normalized sentence embedding of each held-out pydoc_data sentence against the original's
(min and mean cosine). GPTQ is coremltools' (``layerwise_compression.algorithms.GPTQ``, int4
per output row), layer by layer on the calibration slice's sentences, each layer's inputs
from the layers before it already rounded. Measurements in fp32 torch, not a converted
program.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "minilm-l6-embed-compressed.yaml"


def rounded(w: torch.Tensor, bits: int, block: int | None = None) -> torch.Tensor:
    """Symmetric integers, rounding to nearest, one scale per row or per block of inputs."""
    top = 2 ** (bits - 1) - 1
    rows = w.reshape(w.shape[0], -1 if block is None else w.shape[1] // block, block or w.shape[1])
    s = rows.abs().amax(-1, keepdim=True) / top
    return ((rows / s).round().clamp(-top - 1, top) * s).reshape(w.shape)


def _sink(algo: Any, real: torch.Tensor) -> Any:
    """A forward hook feeding a GPTQ its layer's real (unpadded) input and output rows."""
    return lambda _, a, o: algo.add_batch(a[0][real][None], o[real][None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=300, help="held-out sentences")
    args = parser.parse_args()
    from coremltools.optimize.torch.layerwise_compression.algorithms import (
        GPTQ,
        ModuleGPTQConfig,
    )

    from converter.checkpoints.loading import load_checkpoint
    from converter.compression.corpus import encoder_texts
    from converter.recipe import load_recipe
    from converter.recipe.compression_section import Corpus

    torch.set_num_threads(1)
    recipe = load_recipe(RECIPE)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model, tok = ckpt.model.eval(), ckpt.tokenizer
    length = recipe.shapes.sequence_length

    def sentences(part: str, count: int) -> list[str]:
        return encoder_texts(Corpus(corpus="pydoc_data", sentences=count), part, tok, length)

    held, cal = sentences("held_out", args.sentences), sentences("calibration", 128)

    def embed(m: Any, texts: list[str]) -> torch.Tensor:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = m(**enc).last_hidden_state
        mask = enc["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    ref = embed(model, held)

    def each_linear(fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        work = copy.deepcopy(model)
        with torch.no_grad():
            for module in work.encoder.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(fn(module.weight))
        return work

    def gptq(bits: int) -> Any:
        work = copy.deepcopy(model)
        enc = tok(cal, padding=True, return_tensors="pt")
        real = enc["attention_mask"].bool()
        for layer in work.encoder.layer:
            linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
            algos = {
                n: GPTQ(m, ModuleGPTQConfig(weight_dtype=f"uint{bits}")) for n, m in linears.items()
            }
            hooks = [m.register_forward_hook(_sink(algos[n], real)) for n, m in linears.items()]
            with torch.no_grad():
                work(**enc)
            for hook in hooks:
                hook.remove()
            for algo in algos.values():
                # the rounding alone, as converter/compression/methods/gptq.py
                algo._compress_impl()
                algo.cleanup()
        return work

    print(f"{len(held)} held-out sentences, {len(cal)} calibration")
    print("| encoder projections | bits/weight | min cosine | mean cosine |")
    print("| --- | --- | --- | --- |")
    cases = [
        ("int8 per row", 8 + 16 / 384, lambda: each_linear(lambda w: rounded(w, 8))),
        ("int4 per row", 4 + 16 / 384, lambda: each_linear(lambda w: rounded(w, 4))),
        ("int4, blocks of 32", 4.5, lambda: each_linear(lambda w: rounded(w, 4, 32))),
        ("GPTQ int4 per row", 4 + 16 / 384, lambda: gptq(4)),
    ]
    for label, bits, make in cases:
        cos = (embed(make(), held) * ref).sum(-1)
        print(f"| {label} | {bits:.2f} | {cos.min().item():.5f} | {cos.mean().item():.5f} |")


if __name__ == "__main__":
    main()
