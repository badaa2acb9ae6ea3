"""Both decision recipes at full mmBERT-base depth and vocabulary (22 layers, D=768, vocab
256,000; tests/data/configs/mmbert-base-shape.json) with the documented two-layer head,
random weights drawn at the init's scale and perturbed, the scorer peaked as in
tests/test_decision_real_shape.py (which runs three layers in CI). Prints every gate, the
plan's NE segments, the boundary bytes and the predicted floors; writes --json if asked.

    . /work/venv/bin/activate; PYTHONPATH=. python bench/decision.py [--recipe NAME] [--json F]

Figures are printed, never asserted. Times are wall-clock on whatever the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

RECIPES = ("decision-mmbert-b1-l96-k4", "decision-mmbert-b3-l64-k4")


def full_depth_encoder():  # type: ignore[no-untyped-def]
    """transformers' ModernBertModel at the shared mmBERT-base shape, random, perturbed."""
    import torch
    from encoder_models import real_shape_config
    from tiny_models import perturb_
    from transformers import ModernBertModel
    from transformers.initialization import no_init_weights

    config = real_shape_config("mmbert-base-shape")
    torch.manual_seed(1)
    with no_init_weights():
        model = ModernBertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.02 if "norm" not in name else torch.ones_like(p))
        perturb_(model, scale=0.02)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", choices=RECIPES)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from click.testing import CliRunner
    from decision_models import head_config, make_head, save_checkpoint, with_markers
    from encoder_models import random_sequences

    from converter.commands import main as anec
    from converter.pipeline.run import convert
    from converter.recipe import load_recipe, recipe_from_dict, recipe_to_dict

    started = time.perf_counter()
    encoder = full_depth_encoder()
    params = sum(p.numel() for p in encoder.parameters())
    print(f"encoder: {params / 1e6:.1f} M parameters, built in "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    data = head_config(768, scorer={"widths": [768, 256, 1], "activation": "gelu"})
    _, tensors = make_head(encoder, data, peak=40.0, scale=0.02, action_peak=8.0)
    recipes: dict[str, object] = {}
    out: dict[str, object] = {"encoder_parameters": params, "recipes": recipes}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(Path(tmp) / "ckpt", encoder, data, tensors)
        del encoder
        for name in args.recipe or RECIPES:
            recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
            length = recipe.shapes.sequence_length
            seqs = with_markers(random_sequences(7, (length, 41, 23, length - 5), 256_000, first=1))
            raw = recipe_to_dict(recipe)
            raw.update(source={"kind": "hf-dir", "path": str(path)},
                       fixtures={"token_ids": seqs, "padded_variants": False})  # fmt: skip
            t0 = time.perf_counter()
            result = convert(recipe_from_dict(raw), Path(tmp) / "out")
            wall = time.perf_counter() - t0
            parity = json.loads((result.report_dir / "parity.json").read_text())
            manifest = json.loads((result.report_dir / "manifest.json").read_text())
            island = result.report_dir / f"{name}.island.mlpackage"
            inspect = CliRunner().invoke(anec, ["plan-inspect", str(island), "--json"])
            package = json.loads(inspect.output)["packages"][0]
            summary = package["static"]["functions"][0]["summary"]
            floors = {f["chip"]: round(f["ms"], 2) for f in package["predicted"]["floors"]}
            print(f"\n{name}: exit {result.exit_code}, {wall:.0f} s wall")
            for g in parity["gates"]:
                print(f"  {g['level']:<10} {g['name']:<28} {g['implementation']:<17} "
                      f"{float(g['value']):.4g} {g['comparison']} {float(g['threshold']):g} "
                      f"{'pass' if g['passed'] else 'FAIL'} {g['where']}")  # fmt: skip
            print(f"  static (uncalibrated): NE segments {summary['ne_segments']}, inputs "
                  f"{summary['input_bytes']} B, outputs {summary['output_bytes']} B")  # fmt: skip
            print(f"  predicted floor ms per chip (a model): {floors}")
            print(
                "  boundaries: "
                + ", ".join(
                    f"{b['source']} -> {b['target']} {b['bytes']} B" for b in manifest["boundaries"]
                )
            )
            recipes[name] = {"exit_code": result.exit_code, "wall_s": wall,
                             "gates": parity["gates"], "static": summary,
                             "floors_ms": floors, "boundaries": manifest["boundaries"]}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
