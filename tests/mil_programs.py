"""Every kind of program anec emits, as tiny builds, for the MIL coverage and parity tests.

``PROGRAMS`` has one line per program: an architecture, a recipe option or a compression
variant. Adding one (an encoder, a new compression scheme) is one more line; the coverage test
then fails if the new program holds an op or attribute value the evaluator does not implement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tiny_models import LENGTH, Tiny, build_tiny

from converter.compression.activations import (
    activation_sites,
    calibrate,
    insert_activation_quantization,
)
from converter.compression.schemes import Scheme, apply_plan
from converter.compression.sites import weight_sites
from converter.coreml.program import to_mlprogram, trace
from converter.coreml.targets import TARGETS
from converter.tasks.decoder_contract import tensor_contract
from converter.tasks.encoder import program_module
from converter.tasks.encoder_contract import island_contract, single_contract, tail_contract
from graph_passes.decoder import BC1LDecoder
from graph_passes.markers import mark_layer_outputs
from graph_passes.partition import Island, Tail
from parity.conversion import input_dtypes, program_feed
from parity.mil import Evaluator, load_package


@dataclass
class Built:
    """One emitted program: the saved package, and the torch side it came from."""

    name: str
    package: Path
    tiny: Tiny | None  # None when the program has no uncompressed torch twin
    module: BC1LDecoder | None
    precision: str
    mlmodel: Any  # the in-memory coremltools model (compression starts from it)
    base: Built | None = None  # the uncompressed program a compressed one started from
    kind: str = "decoder"  # "decoder", "compressed", "encoder" or "kv"
    functions: dict[str, Any] | None = None  # kv: the cached torch modules per function


def decoder(
    out: Path,
    arch: str,
    inputs: str = "token-ids",
    logits: str = "last",
    chunk: int = 128,
    precision: str = "float16",
    target: str = "macOS14",
    output: str = "logits",
    top_k: int = 0,
) -> Built:
    """A tiny perturbed decoder converted like ``anec convert`` does (markers included);
    ``output`` argmax / topk: the in-model choice per LM-head chunk (io.output)."""
    torch.manual_seed(0)
    tiny = build_tiny(arch, inputs, lm_head_chunk=chunk)  # type: ignore[arg-type]
    module = tiny.module
    choice = {"output": output, "top_k": top_k} if output != "logits" else {}
    if logits == "all" or choice:
        module = tiny.rebuild(logit_positions=LENGTH if logits == "all" else 1, **choice)
    ins, outs = tensor_contract(module, "float16")
    traced = trace(module, ins)
    mark_layer_outputs(traced, len(module.layers))
    mlmodel = to_mlprogram(traced, ins, outs, TARGETS[target].ct_target(), precision)
    name = f"{arch}-{inputs}-{logits}-{chunk}-{precision}-{target}-{output}{top_k or ''}"
    package = out / f"{name}.mlpackage"
    mlmodel.save(str(package))
    return Built(name, package, tiny, module, precision, mlmodel)


def compressed(out: Path, base: Built, scheme: Scheme) -> Built:
    """``base`` with every projection weight compressed by ``scheme`` (anec's compress path)."""
    assert base.module is not None
    function = base.mlmodel._mil_program.functions["main"]
    sites = weight_sites(function, [n for n, _ in base.module.named_parameters()])
    assert sites, "no weight constants found to compress"
    model = apply_plan(base.mlmodel, {s.name: scheme for s in sites}, sites)
    label = scheme.describe().replace(" ", "_").replace("(", "").replace(")", "")
    name = f"{base.name}-{label}"
    package = out / f"{name}.mlpackage"
    model.save(str(package))
    return Built(name, package, None, None, base.precision, model, base, "compressed")


def w8a8(out: Path, base: Built) -> Built:
    """``base`` with int8 weights and int8 projection inputs, ranges calibrated by the MIL
    evaluator on the tiny fixtures (anec's w8a8 path)."""
    assert base.module is not None and base.tiny is not None
    function = base.mlmodel._mil_program.functions["main"]
    sites = weight_sites(function, [n for n, _ in base.module.named_parameters()])
    evaluator = Evaluator(load_package(base.package), "fp16")
    feeds = [
        program_feed(input_dtypes(evaluator), base.module, b, base.tiny.embed_table)[0]
        for b in base.tiny.batches
    ]
    ranged = calibrate(evaluator, feeds, activation_sites(function, sites))
    scheme = Scheme("int8", 8, "per-channel")
    model = apply_plan(
        insert_activation_quantization(base.mlmodel, ranged), {s.name: scheme for s in sites}, sites
    )
    name = f"{base.name}-w8a8"
    package = out / f"{name}.mlpackage"
    model.save(str(package))
    return Built(name, package, None, None, base.precision, model, base, "compressed")


def encoder(
    out: Path, arch: str, output: str, piece: str = "single", precision: str = "float16"
) -> Built:
    """A tiny perturbed BERT / ModernBERT encoder program as the encoder pipeline emits it:
    the single program, or the NE island or the tail of the partitioned form."""
    from encoder_models import build_encoder, tiny_config

    torch.manual_seed(0)
    tiny = build_encoder(tiny_config(arch), output)  # type: ignore[arg-type]
    module = program_module(tiny.module, precision)
    pieces = {
        "single": (module, single_contract),
        "island": (Island(module), island_contract),
        "tail": (Tail(module), tail_contract),
    }
    part, contract = pieces[piece]
    ins, outs = contract(module, "float16")
    mlmodel = to_mlprogram(
        trace(part.eval(), ins), ins, outs, TARGETS["macOS14"].ct_target(), precision
    )
    name = f"{arch}-{output}-{piece}-{precision}"
    package = out / f"{name}.mlpackage"
    mlmodel.save(str(package))
    return Built(name, package, None, None, precision, mlmodel, None, "encoder")


def decision(out: Path, piece: str) -> Built:
    """The tiny decision model's NE island (encoder + head layers) or its CPU tail (gather at
    run-time positions, scorer, softmaxes, action head), as the decision task emits them."""
    from decision_models import tiny_decision

    from converter.tasks.decision_contract import island_contract as decision_island
    from converter.tasks.decision_contract import tail_contract as decision_tail
    from graph_passes.archs import adapt_encoder
    from graph_passes.decision import DecisionEncoder, DecisionIsland, DecisionTail
    from graph_passes.encoder import EncoderIO

    t = tiny_decision()
    canonical = adapt_encoder(t.encoder.config, t.encoder.state_dict())
    io = EncoderIO(3, LENGTH, "token-ids", "last-hidden-state")
    module = program_module(DecisionEncoder(canonical, t.head, io).eval(), "float16")
    assert isinstance(module, DecisionEncoder)
    tail = DecisionTail(t.head, io).eval()
    part, (ins, outs) = (
        (DecisionIsland(module), decision_island(module, "float16"))
        if piece == "island"
        else (tail, decision_tail(module, tail, "float16"))
    )
    mlmodel = to_mlprogram(
        trace(part.eval(), ins), ins, outs, TARGETS["macOS14"].ct_target(), "float16"
    )
    name = f"modernbert-decision-{piece}"
    package = out / f"{name}.mlpackage"
    mlmodel.save(str(package))
    return Built(name, package, None, None, "float16", mlmodel, None, "encoder")


def cached(out: Path, arch: str, style: str) -> Built:
    """A tiny cached decoder's multifunction package (prefill 8, decode, extend 4 over a
    32-slot cache), emitted as the cached text-generation task emits it."""
    from converter.tasks.kv_contract import function_calls
    from converter.tasks.text_generation_kv import emit_functions
    from graph_passes.cached_decoder import cached_functions

    torch.manual_seed(0)
    tiny = build_tiny(arch, "embeddings", batch=1)
    functions = cached_functions(tiny.module, style, 32, function_calls(8, 4))  # type: ignore[arg-type]
    name = f"{arch}-kv-{style}"
    folder = out / name
    folder.mkdir()
    target = TARGETS["macOS15"].ct_target()
    emitted = emit_functions(functions, "float16", "float16", target, folder / f"{name}.mlpackage")
    return Built(
        name, emitted.package, tiny, None, "float16", None, None, "kv",
        functions,
    )  # fmt: skip


Builder = Callable[[Path, "Programs"], Built]


def _on(base: str, scheme: Scheme) -> Builder:
    return lambda out, done: compressed(out, done[base], scheme)


# One line per program anec emits. Compressed variants name the program they start from.
PROGRAMS: dict[str, Builder] = {
    "llama": lambda out, _: decoder(out, "llama"),
    "qwen2": lambda out, _: decoder(out, "qwen2"),
    "llama-embeddings-all": lambda out, _: decoder(out, "llama", "embeddings", "all"),
    "qwen2-one-chunk": lambda out, _: decoder(out, "qwen2", "embeddings", "last", 300),
    "llama-fp32": lambda out, _: decoder(out, "llama", precision="float32"),
    "qwen2-fp32-all": lambda out, _: decoder(out, "qwen2", "token-ids", "all", 100, "float32"),
    "llama-macos15": lambda out, _: decoder(out, "llama", target="macOS15"),
    "llama-lut4": _on("llama", Scheme("lut", 4, "per-tensor")),
    "llama-int8": _on("llama", Scheme("int8", 8, "per-channel")),
    "llama-int8-asym": _on("llama", Scheme("int8", 8, "per-channel", symmetric=False)),
    "llama-w8a8": lambda out, done: w8a8(out, done["llama"]),
    "llama-macos15-lut3-grouped": _on(
        "llama-macos15", Scheme("lut", 3, "per-grouped-channel", group_size=16)
    ),
    "llama-macos15-lut6": _on("llama-macos15", Scheme("lut", 6, "per-tensor")),
    "llama-macos15-int8": _on("llama-macos15", Scheme("int8", 8, "per-channel")),
    "llama-argmax": lambda out, _: decoder(out, "llama", output="argmax"),
    "llama-all-topk": lambda out, _: decoder(out, "llama", logits="all", output="topk", top_k=5),
    "llama-kv-state": lambda out, _: cached(out, "llama", "state"),
    "gemma3-kv-io": lambda out, _: cached(out, "gemma3", "io"),
    "bert-embedding": lambda out, _: encoder(out, "bert", "sentence-embedding"),
    "bert-logits-fp32": lambda out, _: encoder(out, "bert", "logits", precision="float32"),
    "modernbert-hidden": lambda out, _: encoder(out, "modernbert", "last-hidden-state"),
    "modernbert-island": lambda out, _: encoder(out, "modernbert", "logits", "island"),
    "modernbert-tail": lambda out, _: encoder(out, "modernbert", "logits", "tail"),
    "modernbert-decision-island": lambda out, _: decision(out, "island"),
    "modernbert-decision-tail": lambda out, _: decision(out, "tail"),
}


class Programs:
    """Builds programs on first use and keeps them for the session."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.built: dict[str, Built] = {}

    def __getitem__(self, name: str) -> Built:
        if name not in self.built:
            self.built[name] = PROGRAMS[name](self.out, self)
        return self.built[name]
