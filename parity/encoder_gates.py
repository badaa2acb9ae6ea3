"""Parity gates for BC1L encoders against the original transformers model (SPEC section 4).

The reference is the checkpoint run by transformers in fp32 on each fixture alone, unpadded.
Candidates run the fixtures right-padded in fixed (B, L) batches:

* ``torch-fp32``: the BC1L module in fp32 - the rewrite itself, gated per layer and on the task
  output (sentence embeddings: min cosine; hidden states and logits: relative error);
* ``torch-fp16``: the module with the fp16 epsilon floors, cast to fp16, run by torch on the
  CPU; gated on the task output (cosine, or argmax agreement and max |dp| for logits), on
  finiteness and on bitwise determinism;
* any further implementation handed in by name with a `Runner` - the partitioned pieces (host
  embedding -> island -> tail) or, through `MIL_LEVEL`, the emitted program run by the MIL
  evaluator - gated like ``torch-fp16``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from graph_passes.encoder import BC1LEncoder, EncoderOutput
from graph_passes.layer_norm import FP16_EPS_FLOOR
from graph_passes.masks import key_mask_from_padding
from graph_passes.partition import HostEmbedding
from parity.fixtures import Batch, Fixture
from parity.gate_registry import GateResult, Level, agreement, gate, stability_gates, worst_of
from parity.measure import (
    Measured,
    decision_kept,
    folded_rows,
    label_probabilities,
    max_abs,
    measure_levels,
    top2_margin,
    worst_gate,
)
from parity.reference import layer_states
from parity.result import (
    OUTPUT,
    LayerRow,
    Outputs,
    ParityReport,
    Runner,
    Thresholds,
    first_diverging,
    rel_error,
)
from parity.torch_settings import TORCH_CPU

# What runs after the layers: (finished stream, key mask, batch) -> the outputs by name.
Head = Callable[[torch.Tensor, torch.Tensor, Batch], Outputs]

# The name under which the MIL evaluator's run of the emitted program is gated, once the
# evaluator exists (parity/mil/): pass {MIL_LEVEL: runner} as `extra` to `check_encoder`.
MIL_LEVEL = "mil-fp16"


@dataclass(frozen=True)
class EncoderReference:
    """Per-layer hidden states (n, D) and the task output of one unpadded fixture, fp32."""

    hidden: list[torch.Tensor]
    output: torch.Tensor  # (n, D) hidden state, (D,) sentence embedding or (labels,) logits


@dataclass
class EncoderFixtureRow:
    """Per-fixture figures: the output of each implementation against the reference."""

    name: str
    slice: str
    tokens: int
    cosine: dict[str, float] = field(default_factory=dict)  # min over tokens for hidden states
    max_abs_error: dict[str, float] = field(default_factory=dict)
    rel_error: dict[str, float] = field(default_factory=dict)
    argmax_kept: dict[str, bool] = field(default_factory=dict)  # logits only
    max_abs_dprob: dict[str, float] = field(default_factory=dict)  # logits only
    certified: dict[str, bool] = field(default_factory=dict)  # top1 - top2 > 2 max|dlogit|


# ---- batches and the reference ----------------------------------------------------------------


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer layers of a transformers BERT / ModernBERT model (base or task)."""
    base = getattr(model, "bert", None) or getattr(model, "model", None) or model
    encoder = getattr(base, "encoder", None)
    layers = encoder.layer if encoder is not None else base.layers
    return layers  # type: ignore[return-value]


def reference_sentence_embedding(hidden: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' Pooling(mean) + Normalize on an unpadded (n, D) hidden state."""
    mean = hidden.double().mean(dim=0)
    return (mean / mean.norm().clamp_min(1e-12)).float()


def run_encoder_reference(
    model: nn.Module, fixture: Fixture, output: EncoderOutput
) -> EncoderReference:
    """Run the unpadded fixture at positions 0..n-1 (with its segment ids, when a text pair
    gave it some) as the checkpoint itself would."""
    inputs = {"input_ids": torch.tensor([fixture.token_ids], dtype=torch.int64)}
    if fixture.token_types:
        inputs["token_type_ids"] = torch.tensor([fixture.token_types], dtype=torch.int64)
    with layer_states(encoder_layers(model)) as hidden, torch.no_grad():
        result = model(**inputs)
    if output == "logits":
        out = result.logits[0]
    else:
        out = result.last_hidden_state[0]
        if output == "sentence-embedding":
            out = reference_sentence_embedding(out)
    return EncoderReference(hidden=hidden, output=out.detach().float())


# ---- candidates -------------------------------------------------------------------------------


def encoder_inputs(
    module: BC1LEncoder, batch: Batch, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The single program's inputs for a batch: ids [, token types], key mask."""
    key_mask = key_mask_from_padding(batch.attention_mask).to(dtype)
    if module.embedding.types is not None:
        return batch.input_ids, batch.segments, key_mask
    return batch.input_ids, key_mask


def fp16_module(module: BC1LEncoder) -> BC1LEncoder:
    """A copy with the fp16 epsilon floors, cast to fp16: what the fp16 program stores."""
    half = copy.deepcopy(module)
    half.set_eps_floor(FP16_EPS_FLOOR)
    return half.half().eval()


def embed(module: BC1LEncoder, batch: Batch) -> torch.Tensor:
    """The module's embedding of a batch's ids (and segment ids, where it has token types)."""
    types = batch.segments if module.embedding.types is not None else None
    return module.embed(batch.input_ids, types)


def encoder_runner(module: BC1LEncoder, dtype: torch.dtype, head: Head | None = None) -> Runner:
    """Run the whole module on a batch in ``dtype``, keeping per-layer states: embedding,
    layers, then ``head`` on the finished stream (by default the module's own tail, whose
    output is `OUTPUT`)."""

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        key_mask = key_mask_from_padding(batch.attention_mask).to(dtype)
        with torch.no_grad():
            states = module.run_layers(embed(module, batch), key_mask)
            h = module.finish(states[-1])
            out = {OUTPUT: module.tail(h, key_mask)} if head is None else head(h, key_mask, batch)
        return states, out

    return run


def host_runner(host: HostEmbedding, island: nn.Module, head: Head) -> Runner:
    """The partitioned pieces in torch, as the runtime calls them: the ``host`` embedding
    (from the shipped tables), the fp16 ``island``, then ``head`` on the island's output (the
    fp16 tail's outputs by name)."""

    def run(batch: Batch) -> tuple[list[torch.Tensor] | None, Outputs]:
        key_mask = key_mask_from_padding(batch.attention_mask).half()
        rows = host(batch.input_ids, batch.segments).half()
        with torch.no_grad():
            return None, head(island(rows, key_mask), key_mask, batch)

    return run


def real_part(output: torch.Tensor, kind: EncoderOutput, row: int, n: int) -> torch.Tensor:
    """One sample's output at its real positions."""
    return output[row, :n] if kind == "last-hidden-state" else output[row]


def level_of(implementation: str) -> Level:
    """The gate level an fp16 candidate is held to: the MIL program's, or torch fp16's (the
    partitioned pieces are torch fp16 modules)."""
    return "mil-fp16" if implementation == MIL_LEVEL else "torch-fp16"


# ---- the gates --------------------------------------------------------------------------------


def cosines(candidate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Cosine of each output vector (a token's row, or the one vector) to the reference's."""
    c, r = candidate.double(), reference.double()
    if c.dim() == 1:
        c, r = c[None], r[None]
    return torch.nn.functional.cosine_similarity(c, r, dim=-1)


def _score(row: EncoderFixtureRow, name: str, got: torch.Tensor, ref: torch.Tensor,
           kind: EncoderOutput) -> None:  # fmt: skip
    """Fill ``row``'s figures for implementation ``name`` (logits: argmax, |dp|, certified)."""
    finite = bool(torch.isfinite(got).all())
    row.rel_error[name] = rel_error(got, ref)
    row.max_abs_error[name] = max_abs(got, ref, finite)
    row.cosine[name] = float(cosines(got, ref).min()) if finite else float("-inf")
    if kind == "logits":
        # One score (a cross-encoder reranker, a regression head): an argmax or a softmax over
        # one label can never change, so its decision is the sign (p > 0.5 under the sigmoid),
        # which an error below |score| cannot flip.
        one = ref.shape[-1] == 1
        row.argmax_kept[name] = finite and decision_kept(got, ref)
        row.max_abs_dprob[name] = max_abs(label_probabilities(got), label_probabilities(ref),
                                          finite)  # fmt: skip
        margin = float(ref.abs().min()) if one else top2_margin(ref) / 2
        row.certified[name] = finite and margin > row.max_abs_error[name]


def _gates(name: str, m: Measured, rows: list[EncoderFixtureRow], kind: EncoderOutput,
           t: Thresholds, labels: int) -> list[GateResult]:  # fmt: skip
    """The gates of one implementation: torch fp32 on its layers and task output (cosine for
    sentence embeddings, relative error otherwise); fp16 candidates on cosine (embeddings,
    hidden states) or argmax and |dp| (logits of ``labels`` labels; one: its sign and
    sigmoid), finiteness and determinism."""
    fp32 = name == "torch-fp32"
    level: Level = "torch-fp32" if fp32 else level_of(name)
    gates = []
    if fp32:
        gates.append(worst_gate(
            level, "fp32_layer_rel_error", t, m.worst_layer,
            detail="max over layers and fixtures of ||h'-h||/||h|| at real positions",
        ))  # fmt: skip
    if kind == "sentence-embedding" or (kind == "last-hidden-state" and not fp32):
        what = "sentence" if kind == "sentence-embedding" else "real token"
        gates.append(worst_gate(
            level, "fp32_min_cosine" if fp32 else "fp16_min_cosine", t,
            worst_of(((row.cosine[name], row.name) for row in rows), lowest=True), name,
            f"per {what}, against the reference; max |error| "
            f"{max(row.max_abs_error[name] for row in rows):.3g}",
        ))  # fmt: skip
    if fp32 and kind != "sentence-embedding":
        gates.append(worst_gate(
            level, "fp32_logits_rel_error", t, worst_of((r.rel_error[name], r.name) for r in rows),
            name, "||y'-y||/||y|| per fixture, real positions",
        ))  # fmt: skip
    if kind == "logits" and not fp32:
        kept, flipped = agreement({row.name: row.argmax_kept[name] for row in rows})
        certified = sum(row.certified[name] for row in rows)
        one = labels == 1
        gates.append(gate(level, "fp16_argmax_agreement").check(
            kept, t.fp16_argmax_agreement, implementation=name, where=flipped,
            detail=("the score's sign (one label); " if one else "")
            + f"{certified}/{len(rows)} certified "
            + ("(|score| > max|dscore|)" if one else "(top1 - top2 > 2 max|dlogit|)"),
        ))  # fmt: skip
        gates.append(worst_gate(
            level, "fp16_max_abs_dprob", t, worst_of((r.max_abs_dprob[name], r.name) for r in rows),
            name, "sigmoid of the one score" if one else "softmax at T=1 over the labels",
        ))  # fmt: skip
    return gates if fp32 else gates + stability_gates(level, name, m.finite, m.deterministic)


def check_encoder(
    module: BC1LEncoder,
    batches: list[Batch],
    references: dict[str, EncoderReference],
    thresholds: Thresholds,
    extra: dict[str, Runner] | None = None,
    torch_levels: bool = True,
) -> tuple[ParityReport, list[EncoderFixtureRow]]:
    """Run every gate of SPEC section 4 for an encoder; ``extra`` adds fp16-level candidates
    (e.g. ``{"partitioned-fp16": ..., MIL_LEVEL: ...}``) gated like ``torch-fp16``. With
    ``torch_levels=False`` only the extra candidates run (when the torch levels already
    passed in an earlier call)."""
    kind = module.io.output
    # A classifier's label count (one: a score, judged by its sign and sigmoid).
    labels = next(int(r.output.shape[-1]) for r in references.values()) if kind == "logits" else 0
    layers = [LayerRow(i) for i in range(len(module.layers))]
    fixtures = [f for b in batches for f in b.fixtures]
    rows = {f.name: EncoderFixtureRow(f.name, f.slice, len(f.token_ids)) for f in fixtures}
    runners = {
        "torch-fp32": encoder_runner(module, torch.float32),
        "torch-fp16": encoder_runner(fp16_module(module), torch.float16),
    } if torch_levels else {}  # fmt: skip

    def score(name: str, fixture: Fixture, r: int, out: Outputs) -> list[torch.Tensor]:
        ref = references[fixture.name]
        got = real_part(out[OUTPUT], kind, r, len(fixture.token_ids)).float()
        _score(rows[fixture.name], name, got, ref.output, kind)
        return ref.hidden

    gates = measure_levels(
        runners, extra, batches, folded_rows(module.io.length), layers, score,
        lambda name, m: _gates(name, m, list(rows.values()), kind, thresholds, labels),
    )  # fmt: skip
    first = first_diverging(layers, thresholds)
    return ParityReport(gates, layers, [], first, {
        "reference": "transformers, fp32, each fixture alone, unpadded, positions 0..n-1",
        "torch-fp32": "anec BC1L encoder, torch fp32 on the CPU, right-padded folded batches",
        "torch-fp16": "anec BC1L encoder with fp16 epsilon floors cast to fp16, " + TORCH_CPU,
    }), list(rows.values())  # fmt: skip


def fixture_rows_to_text(rows: list[EncoderFixtureRow]) -> str:
    """A table: per fixture and implementation, cosine, max |error| and relative error."""
    lines = [
        "fixture                          slice        tokens  implementation      "
        "min cos      max|err|   rel err"
    ]
    for row in rows:
        for name in row.cosine:
            lines.append(
                f"{row.name[:32]:<32} {row.slice:<12} {row.tokens:>6}  {name:<18} "
                f"{row.cosine[name]:>10.7f}  {row.max_abs_error[name]:>10.3g}  "
                f"{row.rel_error[name]:>8.3g}"
            )
    return "\n".join(lines)
