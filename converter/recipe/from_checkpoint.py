"""A recipe from a checkpoint and flags: ``anec convert CHECKPOINT``, ``anec recipes new``.

`FLAGS` is the whole mapping from command-line flags to recipe fields. What a flag does not
set is read from the checkpoint (`converter.recipe.checkpoint_facts`): the task from its
architecture, the inputs from its tied embeddings, the LM-head chunks from its vocabulary,
the fixtures from anec's fixture text and its tokenizer; the rest keeps the schema's
defaults. The recipe is validated by the schema, so it is valid by construction; a choice
anec cannot make, or a flag value the schema refuses, is an InputError naming the flag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from converter.compression.methods.int8 import Int8
from converter.compression.methods.lut import Lut
from converter.coreml.targets import TARGETS
from converter.errors import InputError
from converter.recipe import (
    ENCODER_TASKS,
    MAX_AXIS,
    MAX_NAME_LENGTH,
    TASKS,
    Recipe,
    load_recipe,
    validate_recipe,
)
from converter.recipe.checkpoint_facts import CheckpointFacts, read_facts
from converter.recipe.fixture_text import fixture_pairs, fixture_prompts, fixture_token_ids
from converter.recipe.refs import CheckpointRef, RecipeRef, parse_ref


@dataclass(frozen=True)
class Preset:
    """A ``--compress`` choice: the variant's method and bits, and its gates. Decoder gates are
    the shipped SmolLM2 compressed recipe's; encoders have shipped gates (MiniLM's min_cosine)
    for 8-bit variants only."""

    method: str
    bits: int | None
    decoder_gates: tuple[float, float]  # min_top1_agreement, max_mean_kl
    encoder_min_cosine: float | None


PRESETS: dict[str, Preset] = {
    Int8.name: Preset(Int8.name, None, (0.97, 0.01), 0.999),
    f"{Lut.name}8": Preset(Lut.name, 8, (0.97, 0.01), 0.999),
    f"{Lut.name}6": Preset(Lut.name, 6, (0.93, 0.03), None),
    f"{Lut.name}4": Preset(Lut.name, 4, (0.75, 0.25), None),
}
CACHE_TARGET = "macOS15"  # the first macOS with states and multifunction packages


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the recipe field it sets."""

    option: str
    dest: str  # the keyword argument click passes
    field: tuple[str, ...]
    help: str
    kind: type = str
    choices: tuple[str, ...] | None = None
    multiple: bool = False


FLAGS: tuple[Flag, ...] = (
    Flag("--task", "task", ("task",), "Task (default: from the checkpoint).", choices=TASKS),
    Flag("--name", "name", ("name",), "Artifact name (default: the checkpoint's)."),
    Flag("--length", "length", ("shapes", "sequence_length"), "Window in tokens [64].", int),
    Flag("--batch", "batch", ("shapes", "batch"), "Sequences per call [1].", int),
    Flag(
        "--cache",
        "cache",
        ("cache", "style"),
        "KV cache: none (a window program) [none], state (a Core ML state) or io.",
        choices=("none", "state", "io"),
    ),
    Flag("--cache-length", "cache_length", ("cache", "length"), "KV cache slots [512].", int),
    Flag("--prefill", "prefill", ("cache", "prefill"), "Tokens per prefill call [64].", int),
    Flag("--extend", "extend", ("cache", "extend"), "Tokens per extend call, K [4].", int),
    Flag(
        "--cache-layout",
        "cache_layout",
        ("cache", "layout"),
        "One multifunction package [multifunction] or one package per function.",
        choices=("multifunction", "per-function"),
    ),
    Flag(
        "--silu-form",
        "silu_form",
        ("silu_form",),
        "SiLU as one silu op [op] or x * sigmoid(x), no silu op (text-generation).",
        choices=("op", "mul-sigmoid"),
    ),
    Flag(
        "--compress",
        "compress",
        ("compression",),
        "Also publish this compressed variant (repeatable), gated on a held-out slice.",
        choices=tuple(PRESETS),
        multiple=True,
    ),
    Flag(
        "--target",
        "target",
        ("target",),
        f"Deployment target [macOS14; {CACHE_TARGET} with a cache].",
        choices=tuple(TARGETS),
    ),
    Flag(
        "--dtype",
        "dtype",
        ("io", "dtype"),
        "Input and output dtype [float16].",
        choices=("float16", "float32"),
    ),
)
_CACHE_DETAILS = ("cache_length", "prefill", "extend", "cache_layout")


@dataclass(frozen=True)
class Made:
    """A recipe made from a checkpoint, and why each choice was made (notes by top-level key)."""

    recipe: Recipe
    notes: dict[str, list[str]]


def given(values: Mapping[str, Any]) -> list[Flag]:
    """The flags set in ``values`` (click's keyword arguments)."""
    return [f for f in FLAGS if values.get(f.dest) not in (None, ())]


def flags_text(values: Mapping[str, Any]) -> str:
    """The flags set in ``values`` as a command line would give them."""
    words = []
    for flag in given(values):
        value = values[flag.dest]
        for item in value if isinstance(value, tuple) else (value,):
            words += [flag.option, str(item)]
    return " ".join(words)


def head_chunk(vocab_size: int) -> int:
    """The LM-head chunk: the fewest chunks within the NE's per-axis limit, of equal size."""
    chunks = -(-vocab_size // MAX_AXIS)
    return -(-vocab_size // chunks)


def artifact_name(stem: str) -> str:
    """A valid artifact name from a folder or file name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).replace("..", ".").strip("._-")
    return name[:MAX_NAME_LENGTH].rstrip("._-") or "model"


def recipe_for(arg: str, values: Mapping[str, Any]) -> Recipe:
    """The recipe ``arg`` names (`converter.recipe.refs`), made from flags for a checkpoint."""
    ref = parse_ref(arg)
    if isinstance(ref, RecipeRef):
        flags = given(values)
        if flags:
            raise InputError(
                f"{flags[0].option}: applies to a checkpoint, not to recipe {arg}; edit the "
                "recipe instead"
            )
        return load_recipe(ref.path)
    return make_recipe(ref, values).recipe


def make_recipe(ref: CheckpointRef, values: Mapping[str, Any]) -> Made:
    """The recipe for checkpoint ``ref`` with the flag ``values`` (None: not given)."""
    from pathlib import Path

    facts = read_facts(ref.source.resolve(Path.cwd()))
    task = _task(facts, values.get("task"))
    notes: dict[str, list[str]] = {"task": [f"{task}: {facts.task_note}"]}
    data: dict[str, Any] = {
        "name": values.get("name") or artifact_name(ref.stem),
        "task": task,
        "source": ref.source.model_dump(exclude_none=True),
    }
    shapes = {k: values[d] for k, d in (("batch", "batch"), ("sequence_length", "length"))}
    data["shapes"] = {k: v for k, v in shapes.items() if v is not None}
    if values.get("target"):
        data["target"] = values["target"]
    if values.get("dtype"):
        data["io"] = {"dtype": values["dtype"]}
    if task == "text-generation":
        _decoder_choices(data, facts, values, notes)
    elif any(values.get(d) is not None for d in ("cache", *_CACHE_DETAILS)):
        raise InputError(f"--cache: a KV cache is for text-generation, not task {task}")
    elif values.get("silu_form") is not None:
        raise InputError(f"--silu-form: applies to text-generation (a decoder's MLP), not {task}")
    length = int(data["shapes"].get("sequence_length", 64))
    data["fixtures"] = _fixtures(facts, length, notes, task in ENCODER_TASKS)
    if values.get("compress"):
        data["compression"] = _compression(task, facts, values["compress"], length)
    return Made(_validate(data, values), notes)


def _task(facts: CheckpointFacts, flag: str | None) -> str:
    task = flag or facts.task
    if task is None:
        raise InputError(f"--task: {facts.task_note}; pass --task ({', '.join(facts.tasks)})")
    if task not in facts.tasks:
        raise InputError(
            f"--task {task}: a {facts.model_type} checkpoint converts to {', '.join(facts.tasks)}"
        )
    return task


def _decoder_choices(
    data: dict[str, Any], facts: CheckpointFacts, values: Mapping[str, Any], notes: Any
) -> None:
    """Inputs, head chunks and the cache of a text-generation recipe."""
    inputs = "embeddings" if facts.tied_embeddings else "token-ids"
    if values.get("silu_form") is not None:
        data["silu_form"] = values["silu_form"]
    chunk = head_chunk(facts.vocab_size)
    data["io"] = {"inputs": inputs, "lm_head_chunk": chunk, **data.get("io", {})}
    why = "tied embeddings: rows gathered on the host" if facts.tied_embeddings else "untied"
    notes["io"] = [
        f"inputs: {inputs} ({why})",
        f"lm_head_chunk: {chunk} ({facts.vocab_size}-token vocabulary in "
        f"{-(-facts.vocab_size // chunk)} chunk(s) within the NE's per-axis limit {MAX_AXIS})",
    ]
    style = values.get("cache")
    details = {d: values.get(d) for d in _CACHE_DETAILS if values.get(d) is not None}
    if style in (None, "none"):
        if details:
            flag = "--" + next(iter(details)).replace("_", "-")
            raise InputError(f"{flag}: applies with --cache state or --cache io")
        return
    keys = {"cache_length": "length", "prefill": "prefill", "extend": "extend",
            "cache_layout": "layout"}  # fmt: skip
    data["cache"] = {"style": style, **{keys[d]: v for d, v in details.items()}}
    if "target" not in data:
        data["target"] = CACHE_TARGET
        notes["target"] = [f"{CACHE_TARGET}: the first target with a {style} KV cache"]


def _fixtures(facts: CheckpointFacts, length: int, notes: Any, pairs_read: bool
              ) -> dict[str, Any]:  # fmt: skip
    if facts.tokenizer is None:
        notes["fixtures"] = ["token ids drawn from a fixed seed: the checkpoint has no tokenizer"]
        return {"token_ids": fixture_token_ids(facts.vocab_size, length)}
    prompts = fixture_prompts(facts.tokenizer, length)
    if not prompts:
        raise InputError(f"--length {length}: no fixture text fits the window; choose more")
    notes["fixtures"] = [f"anec's fixture text, cut to {length} tokens by the checkpoint tokenizer"]
    pairs = fixture_pairs(facts.tokenizer, length) if facts.pair_note and pairs_read else []
    if pairs:
        notes["fixtures"].append(f"and query / passage pairs with their segment ids: "
                                 f"{facts.pair_note}")  # fmt: skip
        return {"prompts": prompts, "pairs": [list(p) for p in pairs]}
    return {"prompts": prompts}


def _compression(task: str, facts: CheckpointFacts, presets: Any, length: int) -> dict[str, Any]:
    decoder = task == "text-generation"
    variants = []
    for suffix in presets:
        preset = PRESETS[suffix]
        variant: dict[str, Any] = {"suffix": suffix, "method": preset.method}
        if preset.bits:
            variant["bits"] = preset.bits
        else:
            variant |= {"granularity": "per-channel", "symmetric": True}
        if decoder:
            top1, kl = preset.decoder_gates
            variant["gates"] = {"min_top1_agreement": top1, "max_mean_kl": kl}
        elif preset.encoder_min_cosine is not None:
            variant["gates"] = {"min_cosine": preset.encoder_min_cosine}
            if task == "text-classification":
                variant["gates"]["min_top1_agreement"] = 1.0
        else:
            eight = ", ".join(k for k, v in PRESETS.items() if v.encoder_min_cosine)
            raise InputError(
                f"--compress {suffix}: no preset gates for an encoder's {suffix} variant (only "
                f"{eight}); write its gates into a recipe (anec recipes new)"
            )
        variants.append(variant)
    # The shipped compressed recipes' held-out slices (SmolLM2, MiniLM).
    held_out: Any = {"corpus": "pydoc_data", **({"positions": 1000} if decoder else {})}
    held_out |= {} if decoder else {"sentences": 300}
    if facts.tokenizer is None:
        held_out = fixture_token_ids(facts.vocab_size, length, seed=1)
    return {"held_out": held_out, "variants": variants}


def _validate(data: dict[str, Any], values: Mapping[str, Any]) -> Recipe:
    """The schema's recipe for ``data``; its errors said by the flag that set the field."""
    try:
        return validate_recipe(data)
    except ValidationError as e:
        problems = [_said_by_flag(err, values, str(data["task"])) for err in e.errors()]
        raise InputError("; ".join(dict.fromkeys(problems))) from None


def _said_by_flag(err: Any, values: Mapping[str, Any], task: str) -> str:
    loc = tuple(err["loc"])
    message = str(err["msg"])
    if err["type"] == "extra_forbidden":
        message = f"does not apply to task {task}"
    for flag in given(values):
        n = min(len(loc), len(flag.field))
        if loc[:n] == flag.field[:n]:
            value = values[flag.dest]
            shown = " ".join(value) if isinstance(value, tuple) else value
            return f"{flag.option} {shown}: {message}"
    where = ".".join(str(p) for p in loc)
    return f"{where} (chosen from the checkpoint): {message}"
