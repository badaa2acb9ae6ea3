"""Tiny (and real-shape) perturbed BERT / ModernBERT models for encoder parity tests.

Built with transformers' own classes in fp32, eval mode, from a fixed seed, then perturbed
(`tiny_models.perturb_`: every bias and norm weight away from its initial value). Eager
attention, so the reference is transformers' plain softmax path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from real_configs import config_dict
from tiny_models import perturb_
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
)

from graph_passes.archs import adapt_encoder
from graph_passes.encoder import BC1LEncoder, EncoderIO, EncoderOutput
from graph_passes.layer_norm import FP16_EPS_FLOOR, apply_layer_norm_prescales, measure_centred_l2
from graph_passes.spec import EncoderModel
from parity.encoder_gates import (
    EncoderReference,
    encoder_inputs,
    run_encoder_reference,
)
from parity.fixtures import Batch, Fixture, build_fixtures, make_batches
from parity.thresholds import Thresholds

VOCAB = 300
PAD_ID = 0
THRESHOLDS = Thresholds(
    fp32_layer_rel_error=1e-4,
    fp32_logits_rel_error=1e-4,
    fp32_min_cosine=0.99999,
    fp16_min_cosine=0.9995,
    fp16_argmax_agreement=1.0,
    fp16_max_abs_dprob=0.02,
)

_CLASSES = {
    ("bert", False): BertModel,
    ("bert", True): BertForSequenceClassification,
    ("modernbert", False): ModernBertModel,
    ("modernbert", True): ModernBertForSequenceClassification,
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """D=64, 4 heads of 16; BERT: 3 layers, I=128; ModernBERT: 4 layers (global, local, local,
    global), I=96, local window 4 (local_attention 8), norm biases on so they are tested."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "pad_token_id": PAD_ID,
        "attn_implementation": "eager",
        "num_labels": 3,
    }
    if arch == "bert":
        kwargs = {**common, "intermediate_size": 128, "num_hidden_layers": 3}
        kwargs["max_position_embeddings"] = 128
        return BertConfig(**{**kwargs, **overrides})
    kwargs = {
        **common,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "local_attention": 8,
        "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0,
        "norm_bias": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "cls_token_id": 1,
        "sep_token_id": 2,
        "max_position_embeddings": 512,
    }
    return ModernBertConfig(**{**kwargs, **overrides})


def real_shape_config(name: str, **overrides: Any) -> Any:
    """A vendored config ``tests/data/configs/<name>.json`` (eager attention)."""
    data = config_dict(name)
    data.pop("architectures", None)
    data.update({"attn_implementation": "eager", **overrides})
    return ModernBertConfig(**data)


def hf_model(config: Any, classify: bool, seed: int = 0) -> nn.Module:
    """The perturbed transformers model for ``config`` (a classifier when ``classify``)."""
    torch.manual_seed(seed)
    model = _CLASSES[(config.model_type, classify)](config).float().eval()
    perturb_(model)
    return model


def random_sequences(
    seed: int, lengths: tuple[int, ...], vocab: int = VOCAB, first: int | None = None
) -> list[list[int]]:
    """Random token ids, never the pad id (ids 3..vocab-1); ``first`` fixes the first token."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    if first is not None:
        for s in seqs:
            s[0] = first
    return seqs


def output_kind(task: str) -> EncoderOutput:
    """The encoder output of a recipe-style task name."""
    return {
        "feature-extraction": "last-hidden-state",
        "sentence-similarity": "sentence-embedding",
        "text-classification": "logits",
    }[task]  # type: ignore[return-value]


def set_encoder_prescales(module: BC1LEncoder, batches: list[Batch]) -> None:
    """Measure LayerNorm inputs on the batches (fp32) and set power-of-two prescales."""
    norms = module.norms()

    def run() -> None:
        for batch in batches:
            module(*encoder_inputs(module, batch, torch.float32))

    apply_layer_norm_prescales(norms, measure_centred_l2(norms, run), FP16_EPS_FLOOR)


@dataclass
class TinyEncoder:
    """A perturbed checkpoint, its BC1L module, right-padded batches and references."""

    model: nn.Module
    canonical: EncoderModel
    module: BC1LEncoder
    fixtures: list[Fixture]
    batches: list[Batch]
    references: dict[str, EncoderReference]

    def rebuild(self, canonical: EncoderModel | None = None) -> BC1LEncoder:
        """Another module (from a possibly altered canonical model), prescaled the same way."""
        module = BC1LEncoder(canonical or self.canonical, self.module.io).eval()
        set_encoder_prescales(module, self.batches)
        return module


def build_encoder(
    config: Any,
    output: EncoderOutput,
    *,
    seed: int = 0,
    batch: int = 3,
    length: int = 16,
    lengths: tuple[int, ...] = (5, 9, 16, 12),
    model: nn.Module | None = None,
) -> TinyEncoder:
    """Model, canonical model, prescaled BC1L module, fixtures, batches and references."""
    model = model or hf_model(config, output == "logits", seed)
    canonical = adapt_encoder(model.config, model.state_dict())
    module = BC1LEncoder(canonical, EncoderIO(batch, length, "token-ids", output)).eval()
    # Classifiers with CLS pooling read the first slot: start every fixture with a CLS-like id.
    seqs = random_sequences(seed + 1000, lengths, config.vocab_size, first=1)
    fixtures = build_fixtures([], seqs, None, length, config.vocab_size, padded_variants=False)
    batches = make_batches(fixtures, batch, length, PAD_ID, right=True)
    set_encoder_prescales(module, batches)
    references = {f.name: run_encoder_reference(model, f, output) for f in fixtures}
    return TinyEncoder(model, canonical, module, fixtures, batches, references)


WORDS = ["how", "do", "bees", "make", "honey", "nectar", "hive", "capital", "of", "france",
         "paris", "city", "what", "is", "a", "compiler"]  # fmt: skip


def cross_encoder_checkpoint(path: Path) -> Path:
    """A one-label BERT with a WordPiece tokenizer, its token-type row 1 far from row 0 and its
    classifier scaled (a random tiny head scores every input about alike) so a pair's second
    segment moves the score as a trained reranker's does."""
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    model = hf_model(tiny_config("bert", num_labels=1), classify=True)
    with torch.no_grad():
        types = model.bert.embeddings.token_type_embeddings.weight
        shift = torch.randn(types.shape[1], generator=torch.Generator().manual_seed(5))
        types[1] = types[0] + 4 * shift
        model.classifier.weight *= 20
    model.save_pretrained(path)
    return path
