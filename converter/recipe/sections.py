"""The recipe's sections: shapes, I/O, gates, fixtures and the encoder options.

Which task reads which key is in `converter.recipe.task_keys`; the sections here hold every key
some task reads, with its default.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from converter.recipe.yaml_errors import Loc, StrictModel, got, raise_rules, rule
from parity.thresholds import DEFAULTS

MAX_AXIS = 16384  # the Neural Engine's per-axis limit

InputsMode = Literal["token-ids", "embeddings", "auto"]
DType = Literal["float16", "float32"]
HeadOutput = Literal["logits", "argmax", "topk"]
MAX_TOP_K = 64  # top-k per LM-head chunk: a small candidate list, not a second logits output

_LOGITS_EXPECTED = "'last', 'all' or a positive integer n (the last n positions)"


class Shapes(StrictModel):
    """Fixed input shapes of the converted program."""

    batch: int = Field(default=1, ge=1, le=64, strict=True)
    sequence_length: int = Field(default=64, ge=1, le=MAX_AXIS, strict=True)


class IOSpec(StrictModel):
    """What goes in and comes out of a decoder program (text-generation)."""

    # auto: host-side embeddings when the checkpoint ties its embeddings, token ids otherwise.
    inputs: InputsMode = "auto"
    logits: Literal["last", "all"] | int = "last"
    lm_head_chunk: int = Field(default=MAX_AXIS, ge=1, le=MAX_AXIS, strict=True)
    dtype: DType = "float16"
    # What each LM-head chunk returns: its logits, or its argmax (index and value), or its
    # top_k (indices and values); the host combines the chunks (manifest head_output).
    output: HeadOutput = "logits"
    top_k: int | None = Field(default=None, ge=1, le=MAX_TOP_K, strict=True)

    @model_validator(mode="after")
    def _top_k_with_topk(self) -> IOSpec:
        if self.output == "topk" and self.top_k is None:
            raise_rules("IOSpec", [(("top_k",), "expected a k for io.output: topk")])
        if self.output != "topk" and self.top_k is not None:
            problem = f"applies to io.output: topk only (io.output is {self.output})"
            raise_rules("IOSpec", [(("top_k",), problem)])
        if self.top_k is not None and self.top_k > self.lm_head_chunk:
            problem = f"{self.top_k} exceeds io.lm_head_chunk {self.lm_head_chunk}"
            raise_rules("IOSpec", [(("top_k",), problem)])
        return self

    @field_validator("logits", mode="before")
    @classmethod
    def _check_logits(cls, value: Any) -> Any:
        ok = value in ("last", "all") or (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        )
        if not ok:
            raise rule(f"expected {_LOGITS_EXPECTED}, got {got(value)}")
        return value


class EncoderIOSpec(StrictModel):
    """What goes in and comes out of an encoder program: token ids and a key mask in, the
    task's output out (both fixed by the task); only the dtype is a choice."""

    dtype: DType = "float16"


KV_MAX_ABS_DPROB = DEFAULTS.kv_max_abs_dprob  # SPEC 4, "Cached decoders": at most


class Gates(StrictModel):
    """Parity thresholds, fixed before measuring (SPEC section 4)."""

    fp32_layer_rel_error: float = Field(
        default=DEFAULTS.fp32_layer_rel_error, gt=0, lt=1, strict=True
    )
    fp32_logits_rel_error: float = Field(
        default=DEFAULTS.fp32_logits_rel_error, gt=0, lt=1, strict=True
    )
    fp16_argmax_agreement: float = Field(
        default=DEFAULTS.fp16_argmax_agreement, gt=0, le=1, strict=True
    )
    fp16_max_abs_dprob: float = Field(default=DEFAULTS.fp16_max_abs_dprob, gt=0, le=1, strict=True)
    # The emitted program run by the MIL evaluator in fp32 against the BC1L module with the
    # program's constants, per layer: the same function, so only rounding differs.
    mil_fp32_layer_rel_error: float = Field(
        default=DEFAULTS.mil_fp32_layer_rel_error, gt=0, lt=1, strict=True
    )
    # Cached decoders, fp16 through the cache over long continuations (SPEC 4, "Cached
    # decoders"): at most 0.03, which a recipe may tighten, never loosen.
    kv_max_abs_dprob: float = Field(
        default=KV_MAX_ABS_DPROB, gt=0, le=KV_MAX_ABS_DPROB, strict=True
    )
    # Decoders: the torch-fp16 level (the BC1L module cast to fp16) repeats what the emitted
    # program's fp16 level judges; on-failure runs it when an fp16 gate of the program fails,
    # to say whether the rewrite or the conversion went wrong; always runs it every time.
    torch_fp16: Literal["on-failure", "always"] = "on-failure"
    # Fields that choose when a level runs, not a gate's threshold.
    SWITCHES: ClassVar[tuple[str, ...]] = ("torch_fp16",)
    # Opt-in (decoders without a cache): run the emitted program under the device-margin
    # profile (the per-op errors others report for the NE, parity/mil/deviations.py) and gate
    # its argmax agreement, worst seed per position. None: the profile does not run.
    device_margin_argmax_agreement: float | None = Field(default=None, gt=0, le=1, strict=True)
    # Plan gates (SPEC 5): static NE residency of the emitted program on every chip of the
    # target's platform (anec plan-inspect); None = not required. Checked before publishing.
    plan_min_ne_flop_share: float | None = Field(default=None, ge=0, le=1, strict=True)
    plan_max_ne_segments: int | None = Field(default=None, ge=1, strict=True)
    # Encoders: cosine to the original's sentence embeddings (fp32) and, in fp16, to its
    # sentence embeddings or per-token hidden states.
    fp32_min_cosine: float = Field(default=DEFAULTS.fp32_min_cosine, gt=0, le=1, strict=True)
    fp16_min_cosine: float = Field(default=DEFAULTS.fp16_min_cosine, gt=0, le=1, strict=True)

    def parity_thresholds(self) -> dict[str, float]:
        """The parity gates alone (keyword arguments of ``parity.result.Thresholds``)."""
        return self.model_dump(
            exclude={"plan_min_ne_flop_share", "plan_max_ne_segments", *self.SWITCHES}
        )


class Fixtures(StrictModel):
    """Inputs the parity gates run on."""

    prompts: list[str] = []
    # Encoders: [first, second] texts tokenized as one two-segment input, with their segment
    # ids (a cross-encoder's query and passage, an NLI premise and hypothesis).
    pairs: list[tuple[str, str]] = []
    token_ids: list[list[Annotated[int, Field(ge=0, strict=True)]]] = []
    padded_variants: bool = Field(default=True, strict=True)

    @model_validator(mode="after")
    def _not_empty(self) -> Fixtures:
        problems: list[tuple[Loc, str]] = []
        if not self.prompts and not self.token_ids and not self.pairs:
            problems.append(((), "expected at least one entry in prompts, pairs or token_ids"))
        for i, prompt in enumerate(self.prompts):
            if not prompt.strip():
                problems.append((("prompts", i), "expected a non-empty prompt"))
        for i, pair in enumerate(self.pairs):
            for j, text in enumerate(pair):
                if not text.strip():
                    problems.append((("pairs", i, j), "expected a non-empty text"))
        for i, ids in enumerate(self.token_ids):
            if not ids:
                problems.append((("token_ids", i), "expected a non-empty list of token ids"))
        raise_rules("Fixtures", problems)
        return self


class EncoderOptions(StrictModel):
    """Encoder tasks only (feature-extraction, sentence-similarity, text-classification)."""

    # single: one program (embedding gather inside, on the CPU); host-embedding: embedding rows
    # and their norm on the host | one NE island with every layer | the tail (pooling, heads)
    # as a second small package (SPEC section 2).
    partition: Literal["single", "host-embedding"] = "single"
    # host-embedding only, and only where the embedding norm reads the token row alone
    # (ModernBERT): ship the table already normalised (checked at conversion).
    prenormalize_embeddings: bool = Field(default=False, strict=True)
    # sentence-similarity: how token states become one vector, and whether it is L2-normalised
    # (all-MiniLM-L6-v2: mean over real tokens, normalised). Classification heads use the
    # checkpoint's own pooling.
    pooling: Literal["mean"] = "mean"
    normalize: bool = Field(default=True, strict=True)

    @field_validator("normalize")
    @classmethod
    def _normalized_only(cls, value: bool) -> bool:
        if not value:
            raise rule(
                "false is not implemented; the implemented sentence embedding is the mean "
                "over real tokens, L2-normalised (normalize: true)"
            )
        return value

    @model_validator(mode="after")
    def _prenormalize_needs_host(self) -> EncoderOptions:
        if self.prenormalize_embeddings and self.partition != "host-embedding":
            problem = "needs partition: host-embedding (the table is normalised on the host)"
            raise_rules("EncoderOptions", [(("prenormalize_embeddings",), problem)])
        return self


class DecisionOptions(StrictModel):
    """Decision models only (task decision): where the head is and its gates
    (docs/decision-head.md). The partition is fixed: host embedding | NE island (encoder and
    head layers) | CPU tail (selection, scorer, calibration, action head)."""

    # The head's folder inside the checkpoint directory (config.json + model.safetensors).
    head_dir: str = Field(default="decision_head", min_length=1)
    # Ship the token table already normalised (ModernBERT's norm reads the token row alone).
    prenormalize_embeddings: bool = Field(default=True, strict=True)
    # Gates (SPEC section 4), fixed here before anything is measured.
    fp32_marker_rows_rel_error: float = Field(
        default=DEFAULTS.fp32_marker_rows_rel_error, gt=0, lt=1, strict=True
    )
    candidate_argmax_agreement: float = Field(
        default=DEFAULTS.candidate_argmax_agreement, gt=0, le=1, strict=True
    )
    action_argmax_agreement: float = Field(
        default=DEFAULTS.action_argmax_agreement, gt=0, le=1, strict=True
    )
    max_abs_dprob_calibrated: float = Field(
        default=DEFAULTS.max_abs_dprob_calibrated, gt=0, le=1, strict=True
    )
    max_abs_dprob_action: float = Field(
        default=DEFAULTS.max_abs_dprob_action, gt=0, le=1, strict=True
    )
    # Requests whose reference scorer logits have top1 - top2 below this form the
    # narrow-margin slice (reported per slice).
    narrow_margin: float = Field(default=DEFAULTS.narrow_margin, gt=0, strict=True)

    @field_validator("head_dir")
    @classmethod
    def _relative(cls, value: str) -> str:
        if value.startswith(("/", "~")) or ".." in value.split("/"):
            raise rule(f"expected a folder inside the checkpoint directory, got {got(value)}")
        return value
