"""The recipe's ``compression:`` section: variants, what stays fp16, evidence slices, gates.

Every threshold here is fixed in the recipe before anything is measured. A variant's gates are
its own: a 4-bit model is not held to the fp16 conversion's 100 % argmax gate, and the fp16
gates are never loosened for it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from converter.compression import methods
from converter.compression.methods.base import LUT_BITS, SEARCH_BITS
from converter.compression.smooth import ALPHA
from converter.coreml.targets import Feature, check_feature
from converter.recipe.yaml_errors import Loc, OneOf, StrictModel, raise_rules

# The registered methods (converter/compression/methods/, one module each), read when a recipe
# is validated; and those the mixed search may choose per weight (``searchable``).
Method = Annotated[str, OneOf(methods.names)]
SearchMethod = Annotated[str, OneOf(methods.search_methods)]
# per-block: integers with a scale per block of group_size inputs (method grid)
Granularity = Literal["per-tensor", "per-grouped-channel", "per-channel", "per-block"]

__all__ = ["LUT_BITS", "SEARCH_BITS"]  # importable from here

_SUFFIX_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# Kept fp16 unless a variant says otherwise: norms (their weights scale a residual stream that
# reaches |h| ~ 27k), the embedding table and the LM head (the draft's output distribution).
DEFAULT_KEEP_FP16 = ("*norm*", "embed*", "lm_head*")


class Corpus(StrictModel):
    """Human-written text installed with Python, as a held-out or calibration slice.

    ``pydoc_data``: the prose paragraphs of the standard library's documentation topics
    (``pydoc_data.topics``), in topic order; the held-out slice takes the even paragraphs, the
    calibration slice the odd ones, so the two never share a text (``compress.corpus``).
    A decoder reads ``positions`` (at least that many scored positions: paragraphs cut to the
    window until the count is reached), an encoder ``sentences``.
    """

    corpus: Literal["pydoc_data"]
    positions: int | None = Field(default=None, ge=1, strict=True)
    sentences: int | None = Field(default=None, ge=1, strict=True)
    # Encoders: ``sentences`` text pairs, each sentence with the next (a cross-encoder's input
    # form, with its segment ids), instead of single sentences.
    pairs: bool = Field(default=False, strict=True)

    @model_validator(mode="after")
    def _check(self) -> Corpus:
        if (self.positions is None) == (self.sentences is None):
            raise_rules(
                "Corpus",
                [(("positions",), "expected one of positions (decoders) or sentences (encoders)")],
            )
        return self


Texts = Corpus | list[str | list[int]]  # Corpus first: the task-key table walks the first


def _keys(items: Texts) -> set[str | tuple[int, ...]]:
    if isinstance(items, Corpus):  # its texts are checked where they are cut (compress.corpus)
        return set()
    return {i if isinstance(i, str) else tuple(i) for i in items}


def split_texts(items: list[str | list[int]]) -> tuple[list[str], list[list[int]]]:
    """Texts and token-id lists of a held-out or calibration list."""
    return [i for i in items if isinstance(i, str)], [i for i in items if not isinstance(i, str)]


class VariantGates(StrictModel):
    """A variant's gates against the original checkpoint on the held-out slice and fixtures.

    Decoders: top-1 agreement and mean KL(p_original || p_variant) at every level (torch, MIL);
    ``max_abs_dprob`` is optional (reported always). Encoders: ``min_cosine`` of the task
    output (sentence embedding, hidden states per token, logits) against the original; a
    classifier also ``min_top1_agreement`` (its predicted label; one label: the score's
    sign) and, optional, ``max_abs_dprob`` (softmax over the labels; one label: its sigmoid:
    the gate that sees a one-score head's magnitude, which a cosine of one value does not).
    """

    min_top1_agreement: float | None = Field(default=None, gt=0, le=1, strict=True)
    max_mean_kl: float | None = Field(default=None, gt=0, strict=True)
    max_abs_dprob: float | None = Field(default=None, gt=0, le=1, strict=True)
    min_cosine: float | None = Field(default=None, gt=0, le=1, strict=True)


class SearchBudget(StrictModel):
    """The mixed-bit search's budget, against the fp16 model on the held-out slice."""

    min_top1_agreement: float = Field(gt=0, le=1, strict=True)
    max_mean_kl: float = Field(gt=0, strict=True)


class SearchSpace(StrictModel):
    """A fixed search space: one candidate per weight tensor, method x bits x group
    (``compress.candidates``): each of ``methods`` at each of ``bits``, palettes per tensor and
    per group of each of ``group_sizes`` output rows, gptq per row (4 and 8 bits only), grid
    (one candidate: each weight's own block grid of ``grid_block`` inputs, where it has one)."""

    bits: list[int] = Field(default_factory=lambda: [16, 8, 6, 4])
    # default: the first search method (registry order: k-means palettes)
    methods: list[SearchMethod] = Field(default_factory=lambda: list(methods.search_methods()[:1]))
    group_sizes: list[Annotated[int, Field(ge=1, strict=True)]] = []
    # grid only: the block of consecutive inputs a weight's own grid is found on (GGUF: 32)
    grid_block: int = Field(default=32, ge=1, strict=True)
    budget: SearchBudget

    @model_validator(mode="after")
    def _check(self) -> SearchSpace:
        problems: list[tuple[Loc, str]] = []
        bad = [b for b in self.bits if b not in SEARCH_BITS]
        if bad or len(set(self.bits)) != len(self.bits) or len(self.bits) < 2:
            allowed = ", ".join(map(str, SEARCH_BITS))
            problems.append((("bits",), f"expected at least two distinct widths from {allowed}"))
        if len(set(self.methods)) != len(self.methods) or not self.methods:
            known = ", ".join(methods.search_methods())
            problems.append((("methods",), f"expected distinct methods from {known}"))
        for method in methods.METHODS.values():
            if method.name in self.methods:
                problems += method.search_check(self)
                continue
            for name, why in method.search_fields.items():
                default = type(self).model_fields[name].get_default(call_default_factory=True)
                if getattr(self, name) != default:
                    problems.append(((name,), why))
        if len(set(self.group_sizes)) != len(self.group_sizes):
            problems.append((("group_sizes",), "expected distinct group sizes"))
        raise_rules("SearchSpace", problems)
        return self


class AcceptanceSpec(StrictModel):
    """Each variant's acceptance as a speculative draft for the fp16 model (decoders only):
    greedy, at each depth K, on the first ``prompt_tokens`` tokens of the first ``prompts``
    held-out texts that long, ``new_tokens`` generated each (``compress.acceptance``)."""

    depths: list[Annotated[int, Field(ge=1, le=8, strict=True)]] = Field(
        default_factory=lambda: [1, 2, 3, 4]
    )
    prompts: int = Field(default=4, ge=1, strict=True)
    prompt_tokens: int = Field(default=32, ge=1, strict=True)
    new_tokens: int = Field(default=32, ge=1, strict=True)

    @model_validator(mode="after")
    def _check(self) -> AcceptanceSpec:
        if not self.depths or len(set(self.depths)) != len(self.depths):
            raise_rules("AcceptanceSpec", [(("depths",), "expected distinct depths from 1 to 8")])
        return self


class Variant(StrictModel):
    """One compressed variant, published as ``<name>-<suffix>``."""

    suffix: str = Field(json_schema_extra={"expected": "lower-case letters, digits, '.', '_', '-'"})
    method: Method
    bits: int | None = Field(default=None, strict=True)
    granularity: Granularity = "per-tensor"
    group_size: int | None = Field(default=None, ge=1, strict=True)
    symmetric: bool = Field(default=True, strict=True)
    keep_fp16: list[str] | None = None  # None: the section's keep_fp16
    # w8a8 only: projections (weight-name patterns) whose input stays fp16, e.g. the MLP down
    # projections that carry a model's outlier activations (SmolLM2: up to 3058).
    activations_keep_fp16: list[str] = []
    gates: VariantGates
    search: SearchSpace | None = None
    # outliers only: input columns of each weight kept exact (largest |w| first)
    outlier_columns: int | None = Field(default=None, strict=True)
    # w8a8 only: fold each quantized projection's input scales into the weights (SmoothQuant-
    # style, powers of two: exact; compress.smooth): MLP down inputs into the up rows, o
    # inputs into the value rows, q/k/v and gate/up inputs into the preceding norm's gain
    smooth: bool = Field(default=False, strict=True)
    # with smooth: the migration strength, the share of each input's range moved into weights
    smooth_alpha: float = Field(default=ALPHA, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> Variant:
        problems: list[tuple[Loc, str]] = []
        if not _SUFFIX_RE.match(self.suffix) or ".." in self.suffix:
            problems.append((("suffix",), f"expected lower-case letters, digits, '.', '_', '-', "
                             f"got {self.suffix!r}"))  # fmt: skip
        problems += methods.get(self.method).check(self)
        if self.granularity in ("per-grouped-channel", "per-block"):
            if self.group_size is None:
                problems.append((("group_size",), f"required for {self.granularity}"))
        elif self.group_size is not None:
            problems.append((("group_size",), "only for per-grouped-channel and per-block"))
        for name in methods.optional_fields():
            owners = methods.owners(name)
            default = type(self).model_fields[name].get_default(call_default_factory=True)
            if self.method not in owners and getattr(self, name) != default:
                why = methods.get(owners[0]).fields[name]
                reason = (
                    f"only {' and '.join(owners)} {why}"
                    if why
                    else (f"only for method: {' or '.join(owners)}")
                )
                problems.append(((name,), reason))
        raise_rules("Variant", problems)
        return self

    def features(self) -> list[tuple[Loc, Feature, str]]:
        """Target features this variant needs: the field that asks, the feature, the fix."""
        used: list[tuple[Loc, Feature, str]] = [
            (("method",), Feature.COMPRESSED_WEIGHTS, "choose a later target")
        ]
        return used + methods.get(self.method).features(self)


class Compression(StrictModel):
    """Compressed variants of the converted model and the evidence they are judged on."""

    keep_fp16: list[str] = Field(default_factory=lambda: list(DEFAULT_KEEP_FP16))
    # Smaller weights stay fp16: their bytes do not matter and a palette would cost more.
    min_weight_elements: int = Field(default=2048, ge=1, strict=True)
    # The held-out slice every quality figure is measured on: texts (or token-id lists for a
    # checkpoint without a tokenizer), or a `Corpus` installed with Python; never used for
    # calibration or sensitivity, and not one of the conversion fixtures.
    held_out: Texts
    # Text for layer sensitivity (mixed search) and activation ranges (w8a8).
    calibration: Texts = []
    # MIL level. "all": the emitted program with its last-position slice removed (the same
    # weights, `parity.compression_gates.all_positions`) scores every position of each held-out
    # text in one evaluation. A number n: each text is run as its prefixes ending at its last n
    # tokens through the emitted program as it is (one evaluation each).
    mil_positions: Annotated[int, Field(ge=1, le=64, strict=True)] | Literal["all"] = "all"
    # Decoders: each variant's acceptance as a draft for the fp16 model, in its report.
    acceptance: AcceptanceSpec | None = None
    variants: list[Variant]

    @model_validator(mode="after")
    def _check(self) -> Compression:
        problems: list[tuple[Loc, str]] = []
        if not isinstance(self.held_out, Corpus) and not self.held_out:
            problems.append((("held_out",), "expected at least one held-out text"))
        if isinstance(self.calibration, Corpus) and not isinstance(self.held_out, Corpus):
            # Corpus parts are disjoint by construction only against each other.
            problems.append(
                (("held_out",), "a calibration corpus needs a held-out corpus (disjoint parts)")
            )
        if not self.variants:
            problems.append((("variants",), "expected at least one variant"))
        seen: dict[str, int] = {}
        for i, v in enumerate(self.variants):
            if v.suffix in seen:
                first = seen[v.suffix]
                problems.append(
                    (("variants", i, "suffix"), f"duplicate (first: variants[{first}])")
                )
            seen.setdefault(v.suffix, i)
        overlap: set[str | tuple[int, ...]] | list[str] = _keys(self.held_out) & _keys(
            self.calibration
        )
        if isinstance(self.held_out, Corpus) and not isinstance(self.calibration, Corpus):
            from converter.compression.corpus import shared_with

            texts = [t for t in self.calibration if isinstance(t, str)]
            overlap = ["x"] * shared_with(self.held_out, "held_out", texts)
        if overlap:
            problems.append(
                (("calibration",), f"shares {len(overlap)} text(s) with held_out; keep them apart")
            )
        calibrated = methods.calibrated()
        needs_calibration = [v.suffix for v in self.variants if v.method in calibrated]
        if needs_calibration and not self.calibration:
            problems.append(
                (("calibration",), f"required by variant(s) {', '.join(needs_calibration)}")
            )
        elif self.calibration and not needs_calibration:
            # Read by the calibrated methods only: elsewhere it would be silently unused.
            readers = f"{', '.join(calibrated[:-1])} and {calibrated[-1]}"
            problems.append(
                (
                    ("calibration",),
                    f"used by {readers} variants only and no variant here is one; remove it",
                )
            )
        raise_rules("Compression", problems)
        return self


def compression_problems(
    compression: Compression,
    target: str,
    task: str,
    name: str,
    fixture_prompts: list[str] | list[str | list[int]],
    max_name_length: int,
) -> list[tuple[Loc, str]]:
    """Rules that need the rest of the recipe: target features, names, tasks, overlaps."""
    problems: list[tuple[Loc, str]] = []
    decoder = task == "text-generation"
    for i, v in enumerate(compression.variants):
        at: Loc = ("compression", "variants", i)
        for loc, feature, fix in v.features():
            reason = check_feature(target, feature)
            if reason:
                problems.append(((*at, *loc), f"{reason}; {fix}"))
        full = f"{name}-{v.suffix}"
        if len(full) > max_name_length:
            problems.append(((*at, "suffix"), f"{full!r} is longer than {max_name_length}"))
        g = v.gates
        if decoder and (g.min_top1_agreement is None or g.max_mean_kl is None):
            need = "a text-generation variant needs min_top1_agreement and max_mean_kl"
            problems.append(((*at, "gates"), need))
        if not decoder and g.min_cosine is None:
            problems.append(((*at, "gates"), "an encoder variant needs min_cosine"))
        if task == "text-classification" and g.min_top1_agreement is None:
            need = "a text-classification variant needs min_top1_agreement (its argmax gate)"
            problems.append(((*at, "gates"), need))
        tasks = methods.get(v.method).tasks
        if tasks is not None and task not in tasks:
            problems.append(
                ((*at, "method"), f"{v.method} is implemented for {', '.join(sorted(tasks))} only")
            )
    if compression.acceptance is not None and not decoder:
        problems.append(
            (("compression", "acceptance"), "speculative acceptance is measured for decoders only")
        )
    for part in ("held_out", "calibration"):
        items = getattr(compression, part)
        if isinstance(items, Corpus):
            need = "positions" if decoder else "sentences"
            if getattr(items, need) is None:
                problems.append(((("compression", part, need)), f"required for task {task}"))
            from converter.compression.corpus import shared_with

            clash = shared_with(items, part, [p for p in fixture_prompts if isinstance(p, str)])
            if clash:
                problems.append(
                    (("compression", part), f"shares {clash} text(s) with fixtures.prompts")
                )
    shared = _keys(compression.held_out) & _keys(list(fixture_prompts))
    if shared:
        problems.append(
            (("compression", "held_out"), f"shares {len(shared)} text(s) with fixtures.prompts")
        )
    return problems
