"""How many bits SmolLM2's weights need: the LM head with every layer exact, and the layers
re-quantized with the LM head exact.

    python bench/smollm2_bits.py [--positions 1000]

The packaged SmolLM2 is a Q4_1 GGUF whose layers are stored exactly by ``method: grid`` at 5
bits per weight (4-bit integers, an fp16 scale and offset per 32 inputs); its tied embedding /
LM head is Q8_0 (8.5 bits exactly). This measures the LM head alone re-quantized by several
schemes, the decoder layers left as the checkpoint has them (transformers, fp32), on the
held-out pydoc_data slice the recipes judge on: top-1 agreement and mean KL(original ||
variant) against the original, and what every weight of the package would then store as a
ratio to fp16 (layers at 5 bits, norms fp16, the head at the scheme's bits). GPTQ is
coremltools' (``layerwise_compression.algorithms.GPTQ``) on the calibration slice's final
hidden states (it takes 3, 4 or 8 bits). The second table re-quantizes every decoder-layer
weight (rounding to nearest per block of inputs) with the LM head as stored: the cheapest
grids that would leave room for a 6.5-bit head under 0.30x. Measurements in transformers
fp32: not a converted program.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "smollm2-135m-draft-grid.yaml"


def per_row(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric integers, one scale per output row (rounding to nearest)."""
    top = 2 ** (bits - 1) - 1
    s = w.abs().amax(1, keepdim=True) / top
    return (w / s).round().clamp(-top - 1, top) * s


def per_block(w: torch.Tensor, bits: int, block: int, symmetric: bool) -> torch.Tensor:
    """Integers per block of ``block`` inputs, symmetric or affine (min / max)."""
    rows, inputs = w.shape
    b = w.reshape(rows, inputs // block, block)
    if symmetric:
        top = 2 ** (bits - 1) - 1
        s = b.abs().amax(-1, keepdim=True) / top
        return ((b / s).round().clamp(-top - 1, top) * s).reshape(rows, inputs)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / (2**bits - 1)
    return (((b - lo) / d).round() * d + lo).reshape(rows, inputs)


def gptq(w: torch.Tensor, x: torch.Tensor, bits: int) -> torch.Tensor:
    """coremltools' GPTQ of ``w`` on inputs ``x`` (N, in): per-row symmetric integers."""
    from coremltools.optimize.torch.layerwise_compression.algorithms import (
        GPTQ,
        ModuleGPTQConfig,
    )

    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.data.copy_(w)
    algo = GPTQ(layer, ModuleGPTQConfig(weight_dtype=f"uint{bits}"))
    algo.add_batch(x[None], layer(x)[None])
    algo._compress_impl()
    out = layer.weight.data.clone()
    algo.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=1000, help="held-out positions")
    args = parser.parse_args()
    from converter.checkpoints.loading import load_checkpoint
    from converter.compression.corpus import decoder_texts
    from converter.recipe import load_recipe
    from converter.recipe.compression_section import Corpus

    torch.set_num_threads(1)
    recipe = load_recipe(RECIPE)
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model, tok = ckpt.model.eval(), ckpt.tokenizer
    window = recipe.shapes.sequence_length

    def texts(part: str, positions: int) -> list[list[int]]:
        return decoder_texts(Corpus(corpus="pydoc_data", positions=positions), part, tok, window)

    def hidden(ids: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model.model(torch.tensor([t])).last_hidden_state[0] for t in ids])

    held = texts("held_out", args.positions)
    h, cal = hidden(held), hidden(texts("calibration", 512))
    head = model.lm_head.weight.detach().clone()
    ref = torch.log_softmax(h @ head.T, -1)
    params = sum(p.numel() for p in model.parameters())  # the tied table counted once
    head_n, norms = head.numel(), sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    layer_n = params - head_n - norms
    print(f"{h.shape[0]} held-out positions, {cal.shape[0]} calibration; head {tuple(head.shape)}")
    print("| LM head | bits/weight | package ratio (layers 5 b) | top-1 | mean KL |")
    print("| --- | --- | --- | --- | --- |")
    cases: list[tuple[str, float, Callable[[], torch.Tensor]]] = [
        ("Q8_0 as stored (grid int8)", 8.5, lambda: head),
        ("int4 per row", 4 + 16 / 576, lambda: per_row(head, 4)),
        ("GPTQ int4 per row", 4 + 16 / 576, lambda: gptq(head, cal, 4)),
        ("int4 symmetric, blocks of 32", 4.5, lambda: per_block(head, 4, 32, True)),
        ("int4 affine, blocks of 32", 5.0, lambda: per_block(head, 4, 32, False)),
        ("int5 affine, blocks of 32", 6.0, lambda: per_block(head, 5, 32, False)),
        ("int6 symmetric, blocks of 32", 6.5, lambda: per_block(head, 6, 32, True)),
        ("int8 per row", 8 + 16 / 576, lambda: per_row(head, 8)),
        ("GPTQ int8 per row", 8 + 16 / 576, lambda: gptq(head, cal, 8)),
    ]
    print_rows(cases, h, ref, layer_n, head_n, norms, params)
    print()
    print("| decoder layers (LM head as stored) | bits/weight | top-1 | mean KL |")
    print("| --- | --- | --- | --- |")
    layer_cases = [
        ("int4 symmetric, blocks of 64", 4.25, lambda w: per_block(w, 4, 64, True)),
        ("int4 symmetric, blocks of 32", 4.5, lambda w: per_block(w, 4, 32, True)),
        ("int4 affine, blocks of 64", 4.5, lambda w: per_block(w, 4, 64, False)),
    ]

    def logp(m: torch.nn.Module) -> torch.Tensor:
        return torch.cat([torch.log_softmax(m(torch.tensor([t])).logits[0], -1) for t in held])

    with torch.no_grad():
        full = logp(model)
        for label, bits, quantize in layer_cases:
            work = copy.deepcopy(model)
            for module in work.model.layers.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(quantize(module.weight))
            lp = logp(work)
            top1 = (lp.argmax(-1) == full.argmax(-1)).float().mean().item()
            kl = (full.exp() * (full - lp)).sum(-1).mean().item()
            print(f"| {label} | {bits:.2f} | {top1:.4f} | {kl:.4f} |")


def print_rows(
    cases: list[tuple[str, float, Callable[[], torch.Tensor]]],
    h: torch.Tensor,
    ref: torch.Tensor,
    layer_n: int,
    head_n: int,
    norms: int,
    params: int,
) -> None:
    """One table row per LM-head case."""
    for label, bits, make in cases:
        start = time.perf_counter()
        lp = torch.log_softmax(h @ make().T, -1)
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        ratio = (layer_n * 5 + head_n * bits + norms * 16) / (params * 16)
        took = time.perf_counter() - start
        print(f"| {label} | {bits:.2f} | {ratio:.4f} | {top1:.4f} | {kl:.4f} | ({took:.0f} s)")


if __name__ == "__main__":
    main()
