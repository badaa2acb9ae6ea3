"""Compression benchmarks: time and peak memory per variant, and quality on a full-precision
checkpoint (MiniLM). Full-size runs live here, not in CI.

    python bench/compress.py weights                     # SmolLM2 and Qwen2.5-0.5B shapes
    python bench/compress.py weights --shape qwen2.5-0.5b --method lut4
    python bench/compress.py minilm                      # MiniLM variants: size and cosine
    python bench/compress.py smollm2 [--recipe FILE]     # the compressed SmolLM2 recipe, end to end
    python bench/compress.py frontier OUT [OUT ...]      # every variant of earlier runs
    python bench/compress.py methods [--layers N]        # each method on Qwen2.5-0.5B shapes

``weights`` builds an fp16 ML Program holding the projection weights of the named model shape
(random normal weights, std 0.02, in the BC1L 1x1-conv form; the LM head stays fp16 as in the
recipes) and compresses every weight with one scheme through ``converter.compression.schemes``, in a
fresh subprocess per case so its peak RSS (``ru_maxrss``) is its own. Times are wall clock on a
shared machine: read them as approximate. Storage ratios are not latency ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import compress_methods

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Projection shapes per layer (out, in) in the BC1L program: fused qkv, o, fused gate_up, down.
SHAPES = {
    "smollm2-135m": {"layers": 30, "d": 576, "qkv": 960, "inter": 1536},
    "qwen2.5-0.5b": {"layers": 24, "d": 896, "qkv": 1152, "inter": 4864},
}
METHODS = {
    "int8": ("int8", 8, "per-channel"),
    "lut8": ("lut", 8, "per-tensor"),
    "lut6": ("lut", 6, "per-tensor"),
    "lut4": ("lut", 4, "per-tensor"),
}
GIB = 2**30


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def shape_program(shape: str, directory: Path) -> tuple[Any, list[Any]]:
    """An fp16 program chaining every projection of ``shape`` with random weights."""
    import coremltools as ct
    import numpy as np
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    s = SHAPES[shape]
    d = s["d"]
    rng = np.random.default_rng(0)
    names: list[tuple[str, tuple[int, int]]] = []
    for i in range(s["layers"]):
        names += [
            (f"layers_{i}_attention_qkv_weight", (s["qkv"], d)),
            (f"layers_{i}_attention_o_weight", (d, d)),
            (f"layers_{i}_mlp_gate_up_weight", (2 * s["inter"], d)),
            (f"layers_{i}_mlp_down_weight", (d, s["inter"])),
        ]

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, d, 1, 8), dtype=types.fp16)],
        opset_version=ct.target.iOS17,
    )
    def prog(x: Any) -> Any:
        h = x
        for name, (out, inp) in names:
            w = (rng.standard_normal((out, inp, 1, 1), dtype=np.float32) * 0.02).astype(np.float16)
            if h.shape[1] != inp:  # take the channels the next projection reads
                h = mb.slice_by_size(x=h, begin=[0, 0, 0, 0], size=[1, inp, 1, 8])
            h = mb.conv(x=h, weight=mb.const(val=w, name=name + "_to_fp16"), name=name + "_conv")
        return h

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS14,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    from converter.compression.sites import weight_sites

    # The names are already in the mangled form, so each site is named after its constant.
    sites = weight_sites(model._mil_program.functions["main"], [n for n, _ in names])
    return model, sites


def weights_case(shape: str, method: str) -> dict[str, Any]:
    """Build the shape's program and compress all of it with ``method`` (in this process)."""
    from converter.compression.schemes import Scheme, apply_plan

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model, sites = shape_program(shape, Path(tmp))
        build = time.perf_counter() - start
        peak_build = _peak_gib()
        kind, bits, granularity = METHODS[method]
        plan = {s.name: Scheme(kind, bits, granularity) for s in sites}  # type: ignore[arg-type]
        start = time.perf_counter()
        compressed = apply_plan(model, plan, sites)
        path = Path(tmp) / "c.mlpackage"
        compressed.save(str(path))
        seconds = time.perf_counter() - start
        weights_bytes = sum(p.stat().st_size for p in path.rglob("weight.bin"))
    fp16_bytes = sum(s.elements * 2 for s in sites)
    return {
        "shape": shape,
        "method": method,
        "weights": len(sites),
        "parameters": sum(s.elements for s in sites),
        "build_s": round(build, 1),
        "compress_and_save_s": round(seconds, 1),
        "peak_rss_gib_after_build": round(peak_build, 2),
        "peak_rss_gib": round(_peak_gib(), 2),
        "weight_file_ratio": round(weights_bytes / fp16_bytes, 4),
    }


def cmd_weights(args: argparse.Namespace) -> None:
    shapes = args.shape or list(SHAPES)
    methods = args.method or ["int8", "lut4"]
    rows = []
    for shape in shapes:
        for method in methods:
            out = subprocess.run(
                [sys.executable, __file__, "_weights_case", shape, method],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                print(f"{shape} {method}: failed\n{out.stderr[-2000:]}")
                continue
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"{'shape':<14} {'method':<6} {'params':>8} {'build s':>8} {'compress+save s':>16} "
        f"{'peak RSS GiB':>13} {'weights ratio':>14}"
    )
    for r in rows:
        print(
            f"{r['shape']:<14} {r['method']:<6} {r['parameters'] / 1e6:>7.0f}M {r['build_s']:>8} "
            f"{r['compress_and_save_s']:>16} {r['peak_rss_gib']:>13} {r['weight_file_ratio']:>14}"
        )
    print("peak RSS covers building the random fp16 program too; limit for the 0.5B shape: 12 GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


# ---- MiniLM: a full-precision checkpoint ---------------------------------------------------

# Each variant is held to the recipe's cosine gate (0.999): the ones below it are kept in
# .failed with the same reports, so every row is printed.
MINILM_VARIANTS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8", "granularity": "per-channel"},
    "lut8": {"method": "lut", "bits": 8},
    "lut6": {"method": "lut", "bits": 6},
    "lut4": {"method": "lut", "bits": 4},
    # grouped-channel palettes (issue 12): one table per group of output channels (macOS15)
    "lut4g8": {"method": "lut", "bits": 4, "granularity": "per-grouped-channel", "group_size": 8},
    "lut4g16": {"method": "lut", "bits": 4, "granularity": "per-grouped-channel", "group_size": 16},
    "lut4g32": {"method": "lut", "bits": 4, "granularity": "per-grouped-channel", "group_size": 32},
    "lut6g32": {"method": "lut", "bits": 6, "granularity": "per-grouped-channel", "group_size": 32},
}


def cmd_minilm(args: argparse.Namespace) -> None:
    """``recipes/minilm-l6-embed-compressed.yaml`` through the conversion pipeline with the
    int8, lut8, lut6 and lut4 variants; figures from each variant's parity.json."""
    from converter.pipeline.run import convert
    from converter.recipe import load_recipe, locate_recipe
    from converter.recipe.compression_section import Variant

    recipe = load_recipe(locate_recipe("minilm-l6-embed-compressed"))
    assert recipe.compression is not None
    chosen = args.variant or list(MINILM_VARIANTS)
    variants = [
        Variant.model_validate({"suffix": k, **MINILM_VARIANTS[k], "gates": {"min_cosine": 0.999}})
        for k in chosen
    ]
    compression = recipe.compression.model_copy(update={"variants": variants})
    out = Path(args.out or tempfile.mkdtemp(prefix="minilm-compress-"))
    start = time.perf_counter()
    # macOS15: grouped-channel palettes (the fp16 program is the same function either way)
    update = {"compression": compression, "target": "macOS15"}
    result = convert(recipe.model_copy(update=update), out, force=True)
    print(f"{out}: exit {result.exit_code} in {time.perf_counter() - start:.0f} s")
    base = json.loads((out / recipe.name / "parity.json").read_text())
    (fp16,) = [
        g for g in base["gates"] if g["name"] == "fp16_min_cosine" and "mil" in g["implementation"]
    ]
    print(f"fp16 MIL min cosine vs original: {fp16['value']:.6f}")
    print(
        f"{'variant':<7} {'ratio':>6} {'bits/w':>6} {'pkg':>6}  {'torch cos orig':>14} "
        f"{'torch cos fp16':>14} {'MIL cos orig':>12} {'MIL cos fp16':>12} {'MIL mean':>9}  gate"
    )
    rows = []
    for v in result.variants:
        doc = json.loads((v.directory / "parity.json").read_text())
        size = doc["size"]
        levels = {lv["implementation"]: lv for lv in doc["levels"]}
        t, m = levels["torch-fp16"], levels["mil-fp16"]
        row = {
            "variant": v.suffix,
            "compressed_ratio": size["compressed_ratio"],
            "bits_per_weight": size["compressed_bits_per_weight"],
            "package_ratio": size["package_ratio"],
            "torch_min_cos_original": t["against_original"]["min_cosine"],
            "torch_min_cos_fp16": t["against_fp16_artifact"]["min_cosine"],
            "mil_min_cos_original": m["against_original"]["min_cosine"],
            "mil_min_cos_fp16": m["against_fp16_artifact"]["min_cosine"],
            "mil_mean_cos_original": m["against_original"]["mean_cosine"],
            "passed": v.passed,
            "seconds": v.seconds,
        }
        rows.append(row)
        print(
            f"{v.suffix:<7} {row['compressed_ratio']:>6.3f} {row['bits_per_weight']:>6.2f} "
            f"{row['package_ratio']:>6.3f}  {row['torch_min_cos_original']:>14.6f} "
            f"{row['torch_min_cos_fp16']:>14.6f} {row['mil_min_cos_original']:>12.6f} "
            f"{row['mil_min_cos_fp16']:>12.6f} {row['mil_mean_cos_original']:>9.6f}  "
            f"{'pass' if v.passed else 'fail'}"
        )
    print("\nfrontier (every explored variant):")
    print_frontier(variant_rows([out]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


# ---- SmolLM2 end to end ----------------------------------------------------------------------


def cmd_smollm2(args: argparse.Namespace) -> None:
    recipe = args.recipe or str(REPO / "recipes" / "smollm2-135m-draft-compressed.yaml")
    out = args.out or tempfile.mkdtemp(prefix="smollm2-compress-")
    start = time.perf_counter()
    proc = subprocess.run(
        ["anec", "convert", recipe, "--out", out, "--force", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    print(f"anec convert exit {proc.returncode} in {wall:.0f} s; artifacts under {out}")
    for directory in sorted(Path(out).iterdir()):
        report = directory / "parity.json"
        if not report.is_file() or "size" not in json.loads(report.read_text()):
            continue
        doc = json.loads(report.read_text())
        size = doc["size"]
        levels = {lv["implementation"]: lv for lv in doc["levels"]}
        print(
            f"{directory.name:<34} {'PASS' if doc['passed'] else 'FAIL'}  "
            f"weights {size['compressed_ratio']:.3f}x ({size['compressed_bits_per_weight']:.2f} "
            f"b/w)  package {size['package_ratio']:.3f}x"
        )
        for impl, lv in levels.items():
            o, f = lv["against_original"], lv["against_fp16_artifact"]
            print(
                f"    {impl:<10} vs original: top-1 {o['argmax_agreement']:.3f} mean KL "
                f"{o['mean_kl']:.4f} max|dp| {o['max_abs_dprob']:.3f}   vs fp16: top-1 "
                f"{f['argmax_agreement']:.3f} mean KL {f['mean_kl']:.4f}"
            )
        if "search" in doc:
            s = doc["search"]
            print(
                f"    search: chosen {s['chosen']['counts']} "
                f"{s['chosen']['weight_bytes'] / 2**20:.2f} MiB"
            )
            for p in s["frontier"]:
                print(
                    f"      frontier {p['weight_bytes'] / 2**20:7.2f} MiB  KL {p['mean_kl']:.4f}"
                    f"  top-1 {p['top1']:.3f}"
                )
            for name, u in s["uniform"].items():
                print(
                    f"      uniform {name} {u['weight_bytes'] / 2**20:7.2f} MiB  KL "
                    f"{u['mean_kl']:.4f}  top-1 {u['top1']:.3f}"
                )
    print("\nfrontier (every explored variant):")
    print_frontier(variant_rows([Path(out)]))
    if proc.returncode not in (0, 1):
        print(proc.stderr[-3000:])


# ---- the frontier: every explored variant, bytes against quality -----------------------------


def variant_rows(directories: list[Path]) -> list[dict[str, Any]]:
    """One row per variant report (``parity.json`` with a size) under ``directories``:
    published and ``.failed`` alike, so every explored point is listed."""
    rows = []
    for root in directories:
        for directory in sorted(Path(root).iterdir()):
            report = directory / "parity.json"
            if not report.is_file():
                continue
            doc = json.loads(report.read_text())
            if "size" not in doc:
                continue
            size = doc["size"]
            row: dict[str, Any] = {
                "variant": doc["variant"],
                "passed": doc["passed"],
                # every weight byte the package stores (LM head, palettes, scales, exact
                # columns, fp16-kept tensors) against the fp16 package's weights
                "ratio": size["all_weights_stored_bytes"] / size["all_weights_fp16_bytes"],
                "bits": size["all_weights_bits_per_weight"],
                "held_out": doc.get("held_out", {}),
            }
            for level in doc["levels"]:
                for against, key in (
                    ("orig", "against_original"),
                    ("fp16", "against_fp16_artifact"),
                ):
                    s = level[key]
                    tag = f"{level['implementation']}/{against}"
                    if "argmax_agreement" in s and "mean_kl" in s:  # a decoder
                        psnr = s.get("psnr_db", {})
                        row[tag] = {
                            "top1": s["argmax_agreement"], "kl": s["mean_kl"],
                            "dp": s["max_abs_dprob"], "positions": s["positions"],
                            "psnr_min": psnr.get("min_db"), "psnr_median": psnr.get("median_db"),
                        }  # fmt: skip
                    else:  # an encoder
                        psnr = s.get("psnr_db", {})
                        row[tag] = {
                            "min_cos": s["min_cosine"], "mean_cos": s["mean_cosine"],
                            "psnr_min": psnr.get("min_db"), "psnr_median": psnr.get("median_db"),
                        }  # fmt: skip
            rows.append(row)
    return sorted(rows, key=lambda r: r["ratio"])


def pareto(rows: list[dict[str, Any]], metric: Any) -> set[str]:
    """Variants no other variant beats in both bytes (fewer) and ``metric`` (higher)."""
    best = -float("inf")
    out = set()
    for r in sorted(rows, key=lambda r: (r["ratio"], -metric(r))):
        if metric(r) > best:
            out.add(r["variant"])
            best = metric(r)
    return out


def _f(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else str(value)


def print_frontier(rows: list[dict[str, Any]]) -> None:
    """Every explored point, bytes against quality; ``*`` marks the Pareto frontier (bytes
    against torch-level top-1 vs the fp16 model for decoders, MIL min cosine for encoders)."""
    decoder = any("torch-fp16/fp16" in r and "top1" in r["torch-fp16/fp16"] for r in rows)
    if decoder:
        front = pareto(rows, lambda r: r["torch-fp16/fp16"]["top1"])
        print(
            f"{'':1} {'variant':<30} {'ratio':>6} {'b/w':>5}  {'level':<10} {'vs':<4} "
            f"{'top-1':>6} {'mean KL':>8} {'max|dp|':>7} {'PSNR min':>8} {'median':>7}  gates"
        )
        for r in rows:
            mark = "*" if r["variant"] in front else " "
            for tag in ("torch-fp16/fp16", "torch-fp16/orig", "mil-fp16/fp16", "mil-fp16/orig"):
                if tag not in r:
                    continue
                m = r[tag]
                level, against = tag.split("/")
                print(
                    f"{mark} {r['variant']:<30} {r['ratio']:>6.3f} {r['bits']:>5.2f}  "
                    f"{level:<10} {against:<4} {m['top1']:>6.3f} {m['kl']:>8.4f} "
                    f"{m['dp']:>7.3f} {_f(m['psnr_min'], '8.1f'):>8} "
                    f"{_f(m['psnr_median'], '7.1f'):>7}  {'pass' if r['passed'] else 'fail'}"
                )
        positions = {r["held_out"].get("positions") for r in rows}
        print(
            f"held-out positions per level: {sorted(p for p in positions if p)}; ratio: every "
            "weight byte stored / the fp16 package's; * Pareto (ratio vs torch top-1 vs fp16)"
        )
    else:
        front = pareto(rows, lambda r: r["mil-fp16/orig"]["min_cos"])
        print(
            f"{'':1} {'variant':<24} {'ratio':>6} {'b/w':>5}  {'torch cos orig':>14} "
            f"{'MIL cos orig':>12} {'MIL cos fp16':>12} {'PSNR min':>8} {'median':>7}  gates"
        )
        for r in rows:
            mark = "*" if r["variant"] in front else " "
            t, m, f = r["torch-fp16/orig"], r["mil-fp16/orig"], r["mil-fp16/fp16"]
            print(
                f"{mark} {r['variant']:<24} {r['ratio']:>6.3f} {r['bits']:>5.2f}  "
                f"{t['min_cos']:>14.6f} {m['min_cos']:>12.6f} {f['min_cos']:>12.6f} "
                f"{_f(m['psnr_min'], '8.1f'):>8} {_f(m['psnr_median'], '7.1f'):>7}  "
                f"{'pass' if r['passed'] else 'fail'}"
            )
        print("min over held-out sentences; * Pareto (ratio vs MIL min cosine vs original)")


def cmd_frontier(args: argparse.Namespace) -> None:
    rows = variant_rows([Path(d) for d in args.out])
    print_frontier(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_weights_case":
        print(json.dumps(weights_case(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("weights", help="compression time and peak memory per model shape")
    w.add_argument("--shape", action="append", choices=list(SHAPES))
    w.add_argument("--method", action="append", choices=list(METHODS))
    w.add_argument("--json")
    m = sub.add_parser("minilm", help="MiniLM variants: size and sentence-embedding cosine")
    m.add_argument("--variant", action="append", choices=list(MINILM_VARIANTS))
    m.add_argument("--out")
    m.add_argument("--json")
    s = sub.add_parser("smollm2", help="the compressed SmolLM2 recipe end to end")
    s.add_argument("--recipe")
    s.add_argument("--out")
    f = sub.add_parser("frontier", help="every variant under OUT dirs: bytes against quality")
    f.add_argument("out", nargs="+", help="output directories of anec convert runs")
    f.add_argument("--json")
    compress_methods.add_parser(sub)  # bench/compress_methods.py
    args = parser.parse_args()
    commands = {"weights": cmd_weights, "minilm": cmd_minilm, "smollm2": cmd_smollm2}
    commands["frontier"] = cmd_frontier
    commands["methods"] = compress_methods.cmd_methods
    commands[args.command](args)


if __name__ == "__main__":
    main()
