"""Which recipe keys each task reads: the table behind the recipe's union on ``task``.

A decoder recipe (text-generation) and an encoder recipe (feature-extraction,
sentence-similarity, text-classification) are different schemas (`converter.recipe.schema`);
within them some keys still apply to some tasks only (a sentence embedding has no logits to
take an argmax of). A key a task does not read is an error at validation time, naming the key
and the task: nothing validates and is then ignored or refused at convert time.

The table says what the pipelines read today (converter/pipeline/run.py, encoder_pipeline.py,
converter/compression/, parity/encoder_gates.py); change a row when a pipeline starts reading a
key for another task.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

from converter.recipe.yaml_errors import Loc

Task = Literal[
    "text-generation", "feature-extraction", "text-classification", "sentence-similarity",
    "decision",
]  # fmt: skip
DecoderTask = Literal["text-generation"]
EncoderTask = Literal["feature-extraction", "text-classification", "sentence-similarity"]
# An encoder with a decision head (docs/decision-head.md): its own schema, `DecisionRecipe`.
DecisionTask = Literal["decision"]

TASKS: tuple[str, ...] = get_args(Task)
DECODER_TASKS: tuple[str, ...] = get_args(DecoderTask)
ENCODER_TASKS: tuple[str, ...] = get_args(EncoderTask)
DECISION_TASKS: tuple[str, ...] = get_args(DecisionTask)

_LOGIT_TASKS = ("text-generation", "text-classification")
EACH = "*"  # in a key path: every item of a list


@dataclass(frozen=True)
class TaskKey:
    """A recipe key that only some tasks read."""

    path: tuple[str, ...]  # dotted key; EACH stands for every list item
    tasks: tuple[str, ...]  # the tasks that read it
    what: str  # what it is for, in a few words (for the error message)

    @property
    def name(self) -> str:
        """The key as docs/recipes.md and messages write it
        (``compression.variants[].gates...``)."""
        return ".".join(self.path).replace(f".{EACH}", "[]")


# Parents before their children: a key reported as misplaced hides the keys below it.
TASK_KEYS: tuple[TaskKey, ...] = (
    TaskKey(("io", "inputs"), DECODER_TASKS, "token ids or host-side embedding rows"),
    TaskKey(("io", "logits"), DECODER_TASKS, "the positions the LM head returns"),
    TaskKey(("io", "lm_head_chunk"), DECODER_TASKS, "the LM head's vocabulary chunk"),
    TaskKey(
        ("io", "output"), DECODER_TASKS, "logits, or in-model argmax or top-k per LM-head chunk"
    ),
    TaskKey(("io", "top_k"), DECODER_TASKS, "k of io.output: topk"),
    TaskKey(("silu_form",), DECODER_TASKS, "how the program spells the MLP's SiLU"),
    TaskKey(
        ("gates", "fp32_logits_rel_error"),
        ("text-generation", "feature-extraction", "text-classification", "decision"),
        "relative error of logits or hidden states (a sentence embedding is gated on "
        "gates.fp32_min_cosine)",
    ),
    TaskKey(("gates", "fp16_argmax_agreement"), _LOGIT_TASKS, "argmax agreement of logits"),
    TaskKey(
        ("gates", "fp16_max_abs_dprob"),
        _LOGIT_TASKS,
        "the largest change of a softmax probability",
    ),
    TaskKey(
        ("gates", "device_margin_argmax_agreement"),
        DECODER_TASKS,
        "the opt-in device-margin profile's argmax gate",
    ),
    TaskKey(
        ("gates", "torch_fp16"),
        DECODER_TASKS,
        "when a decoder's torch-fp16 level runs (encoders always run theirs)",
    ),
    TaskKey(
        ("gates", "kv_max_abs_dprob"),
        DECODER_TASKS,
        "the fp16 probability gate of a cached decoder's continuations",
    ),
    TaskKey(("encoder",), ENCODER_TASKS, "partition and pooling of an encoder"),
    TaskKey(
        ("fixtures", "pairs"),
        ENCODER_TASKS,
        "two-text inputs with segment ids (a cross-encoder's query and passage)",
    ),
    TaskKey(("encoder", "pooling"), ("sentence-similarity",), "how tokens become a sentence"),
    TaskKey(("encoder", "normalize"), ("sentence-similarity",), "L2 normalisation of a sentence"),
    TaskKey(
        ("gates", "fp32_min_cosine"),
        ("sentence-similarity",),
        "the fp32 gate on sentence embeddings",
    ),
    TaskKey(
        ("gates", "fp16_min_cosine"),
        ("feature-extraction", "sentence-similarity"),
        "the fp16 gate on hidden states or sentence embeddings",
    ),
    TaskKey(
        ("compression", "mil_positions"),
        DECODER_TASKS,
        "all positions through the all-positions program, or each text's last prefixes",
    ),
    TaskKey(
        ("compression", "held_out", "positions"),
        DECODER_TASKS,
        "how many next-token positions a held-out corpus covers",
    ),
    TaskKey(
        ("compression", "calibration", "positions"),
        DECODER_TASKS,
        "how many next-token positions a calibration corpus covers",
    ),
    TaskKey(
        ("compression", "held_out", "sentences"),
        ENCODER_TASKS,
        "how many sentences a held-out corpus gives an encoder",
    ),
    TaskKey(
        ("compression", "calibration", "sentences"),
        ENCODER_TASKS,
        "how many sentences a calibration corpus gives an encoder",
    ),
    TaskKey(
        ("compression", "held_out", "pairs"),
        ENCODER_TASKS,
        "a held-out corpus's sentences as text pairs (a cross-encoder's input form)",
    ),
    TaskKey(
        ("compression", "calibration", "pairs"),
        ENCODER_TASKS,
        "a calibration corpus's sentences as text pairs",
    ),
    TaskKey(
        ("compression", "variants", EACH, "gates", "min_cosine"),
        ENCODER_TASKS,
        "a variant's cosine gate on encoder outputs",
    ),
    TaskKey(
        ("compression", "variants", EACH, "gates", "min_top1_agreement"),
        _LOGIT_TASKS,
        "a variant's top-1 agreement of next-token logits or of a classifier's label",
    ),
    TaskKey(
        ("compression", "variants", EACH, "gates", "max_mean_kl"),
        DECODER_TASKS,
        "a variant's mean KL of next-token distributions",
    ),
    TaskKey(
        ("compression", "variants", EACH, "gates", "max_abs_dprob"),
        _LOGIT_TASKS,
        "a variant's largest change of a next-token or label probability",
    ),
)


def _found(data: Any, path: tuple[str, ...], at: Loc = ()) -> Iterator[Loc]:
    """The locations in ``data`` (parsed YAML) where ``path`` is present."""
    if not path:
        yield at
        return
    head, rest = path[0], path[1:]
    if head == EACH:
        if isinstance(data, list):
            for i, item in enumerate(data):
                yield from _found(item, rest, (*at, i))
    elif isinstance(data, dict) and head in data:
        yield from _found(data[head], rest, (*at, head))


def _within(loc: Loc, parents: list[Loc]) -> bool:
    return any(loc[: len(p)] == p for p in parents)


def misplaced_keys(task: Any, data: Any) -> list[tuple[Loc, str]]:
    """Every key present in ``data`` (a recipe mapping) that ``task`` does not read, with why.

    An unknown task gives nothing: the task itself is the error then.
    """
    if task not in TASKS:
        return []
    problems: list[tuple[Loc, str]] = []
    for key in TASK_KEYS:
        if task in key.tasks:
            continue
        for loc in _found(data, key.path):
            if _within(loc, [p for p, _ in problems]):
                continue
            only = ", ".join(key.tasks)
            reason = f"does not apply to task {task}: {key.what}, read by {only} only; remove it"
            problems.append((loc, reason))
    return problems


def without_misplaced(task: Any, data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` without the keys ``task`` does not read (see `misplaced_keys`)."""
    out = copy.deepcopy(data)
    # Every misplaced key ends in a mapping key, so cutting one moves no list item.
    for loc, _ in misplaced_keys(task, out):
        parent: Any = out
        for part in loc[:-1]:
            parent = parent[part]
        del parent[loc[-1]]
    return out
