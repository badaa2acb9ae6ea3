"""Tiny perturbed Llama / Qwen2 models and everything a parity check needs (SPEC section 4).

transformers initialises biases to 0 and norm weights to 1, which hides dropped biases and
wrong norm conventions; `perturb_` moves every parameter away from those values. Everything
is built with transformers' own classes, in fp32, eval mode, from a fixed seed. The CLI tests
share `save_tiny_llama`, `tiny_recipe` / `write_tiny_recipe`, `write_tiny_gguf` and
`run_anec`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from click.testing import CliRunner, Result
from torch import nn

from converter.tasks import text_generation
from graph_passes.archs import adapt
from graph_passes.decoder import BC1LDecoder, DecoderIO, InputKind
from graph_passes.logits_layout import HeadOutput
from graph_passes.prescale import NormScale
from graph_passes.spec import CanonicalModel
from parity.conversion import ConversionReport, check_conversion
from parity.decoder_gates import module_inputs
from parity.fixtures import Batch, Fixture, build_fixtures, make_batches
from parity.gate_registry import registered
from parity.reference import ReferenceRun, run_reference
from parity.thresholds import Thresholds

VOCAB = 300
LENGTH = 16
PAD_ID = 0
FIXTURE_LENGTHS = (5, 8, 11, 16)
DEFAULT_THRESHOLDS = Thresholds(
    fp32_layer_rel_error=1e-4,
    fp32_logits_rel_error=1e-4,
    fp16_argmax_agreement=1.0,
    fp16_max_abs_dprob=0.02,
)


def one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded, then restore (body of an autouse fixture).

    These models are tiny, so threads buy nothing; on a 2-core machine shared with another
    torch process, intra-op threads contend and a 0.1 s parity check took 6 s (measured).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class DecoderCase:
    """One row of the decoder test table: transformers' classes and what the tiny config sets
    beyond the shared shape (an architecture's own features, sized to show at L = 16)."""

    config: str  # transformers config class name
    model: str  # transformers *ForCausalLM class name
    overrides: Mapping[str, Any]


# The decoder architectures under test, by anec architecture name. Adding an architecture to
# the generic checks (tests/test_archs.py) is one row here.
DECODERS: dict[str, DecoderCase] = {
    "llama": DecoderCase("LlamaConfig", "LlamaForCausalLM", {"rms_norm_eps": 1e-5}),
    "qwen2": DecoderCase("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    # Per-head q/k norms; head_dim 32: the q width 128 is twice the hidden width 64.
    "qwen3": DecoderCase("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # MQA, a causal window of 4 on two of three layers (exercised: fixtures reach 16 tokens),
    # query_pre_attn_scalar 64 (scale 1/8, not 1/sqrt(16)), sqrt(64) embedding scale.
    "gemma3": DecoderCase(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_key_value_heads": 1,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 64,
        },
    ),
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A tiny config: D=64, 4 heads of 16, 2 kv heads, I=128, 3 layers, vocab 300."""
    case = DECODERS[arch]
    config_cls = getattr(transformers, case.config)
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        "attn_implementation": "eager",
    }
    kwargs.update(case.overrides)
    kwargs.update(overrides)
    return config_cls(**kwargs)


@torch.no_grad()
def perturb_(model: nn.Module, scale: float = 0.1, norm_scale: float = 0.2) -> None:
    """Move every parameter off its init: norm weights to ``1 + 0.2 randn``, others ``+ 0.1 randn``.

    ``named_parameters`` lists a tied LM head once (it is the embedding table).
    """
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + norm_scale * torch.randn_like(p))
        else:
            p.add_(torch.randn_like(p) * scale)


def perturbed_copy(module: nn.Module, scale: float, seed: int = 3) -> nn.Module:
    """A copy of a BC1L module whose layers' conv weights carry seeded noise of ``scale``
    times their spread: a draft that agrees with the original sometimes."""
    other = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "layers" in name and p.ndim == 4:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A perturbed tiny ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` in fp32, eval mode."""
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, DECODERS[arch].model)
    model = model_cls(config).float().eval()
    perturb_(model)
    return model


def save_tiny_llama(path: Path) -> Path:
    """Save ``tiny_hf_model("llama")`` as an hf-dir checkpoint (config.json, model.safetensors)."""
    tiny_hf_model("llama").save_pretrained(path, safe_serialization=True)
    return path


def tiny_recipe(
    checkpoint: Path,
    name: str = "tiny",
    *,
    precision: str | None = None,
    gates: Mapping[str, object] | None = None,
    extra: str = "",
    io: Mapping[str, object] | None = None,
) -> str:
    """Recipe text converting an hf-dir ``checkpoint`` (`save_tiny_llama`): a 16-token window,
    two fixtures; ``precision``, ``gates`` (values written as ``str()`` gives them), ``io``
    keys and ``extra`` YAML (appended) where given."""
    lines = [
        f"name: {name}",
        "task: text-generation",
        "source:",
        "  kind: hf-dir",
        f"  path: {checkpoint}",
        "shapes:",
        "  batch: 1",
        "  sequence_length: 16",
        "io:",
        "  lm_head_chunk: 128",
        *(f"  {key}: {value}" for key, value in (io or {}).items()),
    ]
    if precision is not None:
        lines.append(f"precision: {precision}")
    if gates:
        lines += ["gates:", *(f"  {key}: {value}" for key, value in gates.items())]
    lines += ["fixtures:", "  token_ids: [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14]]"]
    return "\n".join(lines) + "\n" + extra


def write_tiny_recipe(file: Path, checkpoint: Path, name: str = "tiny", **options: Any) -> Path:
    """Write ``tiny_recipe(checkpoint, name, **options)`` to ``file`` and return ``file``."""
    file.write_text(tiny_recipe(checkpoint, name, **options), encoding="utf-8")
    return file


def write_tiny_gguf(path: Path, licence: str | None = None) -> Path:
    """A small valid GGUF written with the gguf package: llama metadata (``general.license``
    if given), a 300-token vocabulary (a string array, like a real one) and two tensors."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if licence is not None:
        writer.add_license(licence)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_tensor("token_embd.weight", np.ones((300, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((128, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_anec(*args: str | Path) -> Result:
    """Run ``anec ARGS`` in-process through click's test runner (stderr kept apart)."""
    from converter.commands import main

    return CliRunner().invoke(main, [str(a) for a in args])


def convert_tiny_llama(root: Path, extra: str, name: str = "tiny") -> tuple[Result, Path]:
    """Save the tiny Llama under ``root``, write its recipe ``name`` with the ``extra`` YAML
    appended and run ``anec convert --json`` into ``root/out``: (the result, the out folder)."""
    checkpoint = save_tiny_llama(root / "ckpt")
    recipe = write_tiny_recipe(root / f"{name}.yaml", checkpoint, name, extra=extra)
    out = root / "out"
    return run_anec("convert", recipe, "--out", out, "--json"), out


def random_sequences(seed: int, lengths: tuple[int, ...] = FIXTURE_LENGTHS) -> list[list[int]]:
    """Random token ids (never the pad id, so padding is visible in the ids too)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def build_module(
    canonical: CanonicalModel,
    inputs: InputKind = "token-ids",
    *,
    batch: int = 3,
    length: int = LENGTH,
    logit_positions: int = 1,
    lm_head_chunk: int = 128,
    output: HeadOutput = "logits",
    top_k: int = 0,
) -> BC1LDecoder:
    """The BC1L module for a canonical model, eval mode, fp32."""
    io = DecoderIO(
        batch=batch,
        length=length,
        inputs=inputs,
        logit_positions=logit_positions,
        lm_head_chunk=lm_head_chunk,
        output=output,
        top_k=top_k,
    )
    return BC1LDecoder(canonical, io).eval()


def set_prescales(
    module: BC1LDecoder, batches: list[Batch], embed_table: torch.Tensor
) -> list[NormScale]:
    """Measure norm inputs on the batches and set power-of-two prescales, as the pipeline does."""
    return text_generation.set_prescales(module, batches)


@dataclass
class Tiny:
    """A tiny perturbed checkpoint, its BC1L module, fixtures and references."""

    arch: str
    model: nn.Module
    canonical: CanonicalModel
    module: BC1LDecoder
    fixtures: list[Fixture]
    batches: list[Batch]
    references: dict[str, ReferenceRun]
    embed_table: torch.Tensor
    thresholds: Thresholds = DEFAULT_THRESHOLDS

    def check_program(
        self, package: Path, profiles: tuple[str, ...] = ("fp32", "fp16")
    ) -> ConversionReport:
        """The conversion-level gates of an fp16 ``package`` against this tiny model."""
        return check_conversion(
            package,
            self.module,
            self.batches,
            self.references,
            self.embed_table,
            self.thresholds,
            "float16",
            profiles=profiles,
        )

    def rebuild(self, canonical: CanonicalModel | None = None, **io: Any) -> BC1LDecoder:
        """Another module from (a possibly altered) canonical model, same I/O unless given."""
        current = self.module.io
        kwargs = {
            "batch": current.batch,
            "length": current.length,
            "logit_positions": current.logit_positions,
            "lm_head_chunk": current.lm_head_chunk,
            "output": current.output,
            "top_k": current.top_k,
        }
        inputs = io.pop("inputs", current.inputs)
        kwargs.update(io)
        module = build_module(canonical or self.canonical, inputs, **kwargs)
        set_prescales(module, self.batches, self.embed_table)
        return module


def build_tiny(
    arch: str = "llama",
    inputs: InputKind = "token-ids",
    *,
    seed: int = 0,
    batch: int = 3,
    length: int = LENGTH,
    padded_variants: bool = True,
    lm_head_chunk: int = 128,
    **overrides: Any,
) -> Tiny:
    """Model, canonical model, BC1L module (prescaled), fixtures, batches and references."""
    model = tiny_hf_model(arch, seed, **overrides)
    canonical = adapt(model.config, model.state_dict())
    module = build_module(
        canonical, inputs, batch=batch, length=length, lm_head_chunk=lm_head_chunk
    )
    fixtures = build_fixtures(
        [], random_sequences(seed + 1000), None, length, VOCAB, padded_variants
    )
    batches = make_batches(fixtures, batch, length, PAD_ID)
    embed_table = module.host_embedding_table()
    set_prescales(module, batches, embed_table)
    references = {f.name: run_reference(model, f.token_ids) for f in fixtures}
    return Tiny(arch, model, canonical, module, fixtures, batches, references, embed_table)


# ---- comparing a module with transformers -------------------------------------------------

# The cache level's gates a plain cached decoder runs: every registered one but the head
# choice's (io.output argmax / topk) and a compressed variant's weights gate.
DEFAULT_KV_GATES = {g.name for g in registered() if g.level == "kv-cache"} - {
    "kv_head_choice_mismatches",
    "kv_weights_identical",
}

MATCH_TOLERANCE = 1e-5


def rel(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    c, r = candidate.double(), reference.double()
    return float((c - r).norm() / r.norm())


def hf_states(
    model: torch.nn.Module, ids: tuple[int, ...]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer outputs (n, D) and logits (n, V) of transformers on the unpadded sequence."""
    states: list[torch.Tensor] = []

    def hook(_: torch.nn.Module, __: object, out: object) -> None:
        h = out[0] if isinstance(out, tuple) else out
        states.append(h[0].detach().clone())  # type: ignore[index]

    layers = model.model.layers  # type: ignore[union-attr]
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        for h in handles:
            h.remove()
    return states, logits


def assert_matches(t: Tiny, module: BC1LDecoder | None = None) -> None:
    """Every layer's state at every real position, and the last-position logits, within
    MATCH_TOLERANCE of transformers on the unpadded sequence."""
    module = module or t.module
    for batch in t.batches:
        x, key_mask = module_inputs(module, batch, t.embed_table, torch.float32)
        with torch.no_grad():
            states = module.run_layers(x, key_mask)
            logits = torch.cat(module.head(states[-1][..., -1:]), dim=1)[:, :, 0, 0]
        for r, fixture in enumerate(batch.fixtures):
            n = len(fixture.token_ids)
            ref_states, ref_logits = hf_states(t.model, fixture.token_ids)
            assert len(ref_states) == len(states)
            for i, (state, ref) in enumerate(zip(states, ref_states, strict=True)):
                err = rel(state[r, :, 0, LENGTH - n :].T, ref)
                assert err <= MATCH_TOLERANCE, f"{t.arch} {fixture.name} layer {i}: {err:.2e}"
            err = rel(logits[r], ref_logits[-1])
            assert err <= MATCH_TOLERANCE, f"{t.arch} {fixture.name} logits: {err:.2e}"


# One int8 variant of the tiny Llama, judged on two held-out token sequences (appended to a
# tiny recipe).
INT8_COMPRESSION = """\
compression:
  held_out: [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41, 42, 43, 44, 45]]
  variants:
    - suffix: int8
      method: int8
      granularity: per-channel
      gates: {min_top1_agreement: 0.9, max_mean_kl: 0.01}
"""
