"""The ``anec speculate`` command: greedy speculative decoding with a cached draft artifact."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click

from converter.errors import InputError


def parse_depths(text: str) -> list[int]:
    """``1..8`` or ``4`` or ``1,2,4`` -> the depths, each 1..8."""
    if ".." in text:
        low, high = (int(x) for x in text.split(".."))
        depths = list(range(low, high + 1))
    else:
        depths = [int(x) for x in text.split(",")]
    if not depths or any(not 1 <= k <= 8 for k in depths):
        raise InputError(f"--k {text!r}: expected depths between 1 and 8, e.g. 1..8")
    return depths


def vocab_hash(vocab: dict[str, int], ids: int) -> str:
    """sha256 of the (id, token) pairs below ``ids``: the vocabulary both models use."""
    pairs = sorted((i, t) for t, i in vocab.items() if i < ids)
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


@dataclass(frozen=True)
class Target:
    """The target model (fp32) and what it was loaded from."""

    model: Any
    sha256: str  # the checkpoint's (converter.checkpoints.loading)
    source: str
    tokenizer: Any  # None: none shipped


def load_target(draft: Any, target: Path | None) -> Target:
    """The ``--target`` checkpoint, or without one the draft's own (hash checked)."""
    from converter.checkpoints.loading import load_checkpoint
    from converter.drafts.host_loop import artifact_checkpoint, artifact_source
    from converter.recipe.sources import ResolvedSource

    if target is None:
        source, _ = artifact_source(draft.directory)
        ckpt = artifact_checkpoint(draft.directory)
        return Target(ckpt.model.float().eval(), ckpt.sha256, str(source.directory), None)
    ckpt = load_checkpoint(ResolvedSource("hf-dir", target, None), "text-generation")
    return Target(ckpt.model.float().eval(), ckpt.sha256, str(target), ckpt.tokenizer)


def target_key(draft: Any, target: Path | None) -> str:
    """Which target a draft is measured against, before loading it: drafts with one key share
    one loaded target and its continuations."""
    return str(target) if target is not None else draft.manifest["checkpoint"]["sha256"]


def target_name(draft: Any, target: Target) -> tuple[bool, str]:
    """Whether ``target`` is the draft's own checkpoint, and its name in the report; a
    foreign target must share the draft's vocabulary (InputError naming it otherwise)."""
    manifest = draft.manifest
    if target.sha256 == manifest["checkpoint"]["sha256"]:
        return True, f"{target.source} (the draft's own)"
    if draft.tokenizer is None or target.tokenizer is None:
        raise InputError(f"{target.source}: a vocabulary check needs both tokenizers")
    shared = min(manifest["vocab_size"], len(target.tokenizer.get_vocab()))
    if vocab_hash(draft.tokenizer.get_vocab(), shared) != vocab_hash(
        target.tokenizer.get_vocab(), shared
    ):
        raise InputError(
            f"{target.source}: its vocabulary differs from the draft's on ids 0..{shared - 1}"
        )
    return False, target.source


BOOTSTRAP = 2000  # resamples of the texts for the MIL check's interval (seeded)


def mil_check(
    make: Any, verify: Any, prompts: list[list[int]], k: int, max_new_tokens: int,
    backend: list[Any],
) -> dict[str, Any]:  # fmt: skip
    """The same texts with the draft in the MIL evaluator against ``backend`` (the other
    backend's `Acceptance` per text): both mean accepted per cycle, the difference in cycles
    and as a share with its 95 % interval (a paired bootstrap over the texts), and the first
    cycle where the two loops part (text, continuation index, drafts each accepted)."""
    import numpy as np

    from converter.drafts.speculation import Acceptance, speculate

    mil = []
    for prompt in prompts:
        one = Acceptance(k)
        speculate(make, verify, prompt, k, max_new_tokens, one)
        mil.append(one)
    ours, theirs = _summed(backend, k), _summed(mil, k)
    base = theirs.mean_accepted
    rng = np.random.default_rng(0)
    shares = []
    for _ in range(BOOTSTRAP):
        pick = rng.integers(0, len(mil), len(mil))
        a, b = _summed([backend[i] for i in pick], k), _summed([mil[i] for i in pick], k)
        if b.mean_accepted:
            shares.append((a.mean_accepted - b.mean_accepted) / b.mean_accepted)
    low, high = (float(np.percentile(shares, q)) for q in (2.5, 97.5)) if shares else (0.0, 0.0)
    return {
        "texts": len(prompts),
        "backend_mean_accepted": round(ours.mean_accepted, 4),
        "mil_mean_accepted": round(base, 4),
        "relative_difference": abs(ours.mean_accepted - base) / base if base else 0.0,
        "backend_cycles": ours.cycles,
        "mil_cycles": theirs.cycles,
        "cycle_difference": ours.cycles - theirs.cycles,
        "relative_difference_95": [round(low, 4), round(high, 4)],
        "interval_covers_zero": low <= 0.0 <= high,
        "first_difference": _first_difference(backend, mil),
    }


def _summed(texts: list[Any], k: int) -> Any:
    """One `Acceptance` summing ``texts``'."""
    from converter.drafts.speculation import Acceptance

    total = Acceptance(k)
    for one in texts:
        total.add(one)
    return total


def _first_difference(backend: list[Any], mil: list[Any]) -> dict[str, int] | None:
    """The first cycle, text by text, where the two loops accepted differently."""
    for i, (a, b) in enumerate(zip(backend, mil, strict=True)):
        for (start, mine), (other_start, theirs) in zip(a.trace, b.trace, strict=False):
            if (start, mine) != (other_start, theirs):
                return {"text": i, "continuation_index": start, "backend_accepted": mine,
                        "mil_accepted": theirs}  # fmt: skip
    return None


@dataclass(frozen=True)
class Continuations:
    """What the target says on the texts, computed once per target and shared by every draft
    judged against it: per text, its greedy continuation (for the replayed T = 0 cycles; None
    when the cycles run) and, per T > 0, its sampled continuation with its logits."""

    greedy: list[list[int]] | None
    sampled: dict[float, list[Any]]  # T -> per text, a speculation.TargetSample


def continuations(
    model: Any, prompts: list[list[int]], steps: int, temps: list[float], greedy: bool,
    advance: Any,
) -> Continuations:  # fmt: skip
    """The target's `Continuations` of ``steps`` tokens; ``advance()`` after each text's."""
    from converter.drafts.speculation import target_sample
    from parity.reference import greedy_ids

    greedy_rows = None
    if greedy:
        greedy_rows = []
        for prompt in prompts:
            greedy_rows.append(greedy_ids(model, tuple(prompt), steps))
            advance()
    sampled: dict[float, list[Any]] = {}
    for t in temps:
        if t > 0:
            sampled[t] = []
            for seed, prompt in enumerate(prompts):  # seeded by the text's index
                sampled[t].append(target_sample(model, prompt, steps, t, seed))
                advance()
    return Continuations(greedy_rows, sampled)


def replay_agreements(
    make: Any, prompts: list[list[int]], greedy: list[list[int]], advance: Any = None
) -> list[list[bool]]:
    """Per text, whether the draft's greedy token matches the target's greedy continuation
    after each prefix (`draft_agreement`)."""
    from converter.drafts.speculation import draft_agreement

    out = []
    for prompt, cont in zip(prompts, greedy, strict=True):
        out.append(draft_agreement(make, prompt, cont))
        if advance is not None:
            advance()
    return out


def depth_counts(
    make: Any, verify: Any, prompts: list[list[int]], k: int, max_new_tokens: int,
    agreements: list[list[bool]] | None,
) -> tuple[Any, list[Any]]:  # fmt: skip
    """Depth ``k``'s counts over every text, and each text's own: replayed from
    ``agreements`` (`replay_agreements`), or by running the cycles."""
    from converter.drafts.speculation import Acceptance, replay, speculate

    stats, texts = Acceptance(k), []
    for i, prompt in enumerate(prompts):
        one = Acceptance(k)
        if agreements is None:
            speculate(make, verify, prompt, k, max_new_tokens, one)
        else:
            replay(agreements[i], max_new_tokens, k, one)
        stats.add(one)
        texts.append(one)
    return stats, texts


def interval(texts: list[Any], k: int) -> list[float]:
    """The 95 % interval of mean accepted per cycle, by a bootstrap over the texts (seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    means = [_summed([texts[i] for i in rng.integers(0, len(texts), len(texts))], k).mean_accepted
             for _ in range(BOOTSTRAP)]  # fmt: skip
    return [round(float(np.percentile(means, q)), 4) for q in (2.5, 97.5)]


def sampled_rows(alphas: list[list[float]], k: int, max_new_tokens: int) -> dict[str, Any]:
    """Depth ``k`` under sampling from each text's acceptance probabilities (`sampling_alphas`):
    expected acceptance per position and mean accepted per cycle, with its interval."""
    from converter.drafts.speculation import Acceptance, expected_replay

    texts = []
    for alpha in alphas:
        one = Acceptance(k)
        expected_replay(alpha, max_new_tokens, k, one)
        texts.append(one)
    total = _summed(texts, k)
    return {
        "acceptance_per_position": [round(total.rate(i), 4) for i in range(k)],
        "mean_accepted_per_cycle": round(total.mean_accepted, 4),
        "mean_accepted_95": interval(texts, k),
        "tokens_per_target_call": round(total.tokens_per_call, 4),
    }


TEMPERATURES = (0.0, 0.7, 1.0)  # the default sweep when the draft returns logits


def parse_temperatures(
    values: tuple[float, ...], manifest: dict[str, Any], name: str
) -> list[float]:
    """The temperatures to measure: the given ones, else `TEMPERATURES` (0 alone for a draft
    whose head returns its choice, not logits); T > 0 for such a draft is an InputError."""
    choice = (manifest.get("head_output") or {}).get("choice", "logits")
    if any(t < 0 for t in values):
        raise InputError(f"--temperature {min(values)}: expected 0 (greedy) or more")
    if not values:
        return list(TEMPERATURES) if choice == "logits" else [0.0]
    if choice != "logits" and any(t > 0 for t in values):
        raise InputError(
            f"{name}: its head returns {choice}, not logits: sampling acceptance (T > 0) needs "
            "the draft's distribution (convert with io.output: logits)"
        )
    return sorted(set(values))


def refuse_failed(directory: Path) -> None:
    """A draft whose gates failed (or that has no parity report) is refused by name."""
    from converter.pipeline.publish import FAILED_SUFFIX

    report = directory / "parity.json"
    if directory.name.endswith(FAILED_SUFFIX):
        raise InputError(
            f"{directory}: a failed conversion ({FAILED_SUFFIX}); its gates did not pass"
        )
    if not report.is_file():
        raise InputError(f"{directory}: no parity.json: the draft's gates cannot be checked")
    if not json.loads(report.read_text(encoding="utf-8")).get("passed", False):
        raise InputError(f"{directory}: its parity gates failed (parity.json): not compared")


@dataclass(frozen=True)
class Sweep:
    """What every draft of one ``anec speculate`` run is measured on, and how."""

    ks: list[int]
    max_new_tokens: int
    texts: int | None
    draft_backend: str
    check_mil: int
    cycles: bool
    temperatures: tuple[float, ...]

    @property
    def steps(self) -> int:
        """Continuation tokens per text: the last cycle drafts past the end."""
        return self.max_new_tokens + max(self.ks) - 1

    @property
    def replayed(self) -> bool:
        """Greedy cycles counted from teacher-forced tokens (`replay`), not run."""
        return self.draft_backend == "torch" and not self.cycles


def open_draft(directory: Path, sweep: Sweep) -> tuple[Any, list[list[int]]]:
    """The draft's `Runtime` and the built-in texts in its tokens, checked to fit its cache."""
    from converter.drafts.host_loop import Runtime
    from converter.drafts.speculation import TEXTS

    draft = Runtime.from_artifact(directory)
    if draft.tokenizer is None:
        raise InputError(f"{directory}: the draft ships no tokenizer.json")
    prompts = [list(draft.tokenizer.encode(t).ids) for t in TEXTS[: sweep.texts]]
    capacity = int(draft.kv["cache_length"])
    for i, prompt in enumerate(prompts):
        if len(prompt) + sweep.steps > capacity:
            raise InputError(
                f"{directory}: text {i} ({len(prompt)} tokens) and {sweep.steps} tokens of "
                f"continuation exceed the {capacity}-slot cache: lower --max-new-tokens"
            )
    return draft, prompts


def measure_draft(
    draft: Any, prompts: list[list[int]], temps: list[float], target: Target,
    said: Continuations, sweep: Sweep, progress: Any, echo: Any,
) -> dict[str, Any]:  # fmt: skip
    """One draft's acceptance sweep (every K, every temperature) against ``target``, which
    ``said`` what it continues the texts with; ``echo`` gets each K's lines as they are
    measured, ``progress`` (`Steps`) shows the long steps."""
    from converter.drafts.comparison import row_text
    from converter.drafts.host_loop import coreml_backend, mil_backend, torch_backend
    from converter.drafts.speculation import sampling_alphas, target_tokens

    own, name = target_name(draft, target)
    backends = {"torch": torch_backend, "mil": mil_backend, "coreml": coreml_backend}
    with progress.step(f"{draft.directory.name}: load"):
        make = backends[sweep.draft_backend](draft)
        check = mil_backend(draft) if sweep.check_mil and sweep.draft_backend != "mil" else None
    verify = partial(target_tokens, target.model)
    forced = len(prompts) * ((said.greedy is not None) + len(said.sampled))
    with progress.step(f"{draft.directory.name}: teacher-forced", forced) as advance:
        agreements = None
        if said.greedy is not None:
            agreements = replay_agreements(make, prompts, said.greedy, advance)
        # Per temperature, per text: the acceptance probability along the target's sampled
        # continuation, shared by every K.
        alphas: dict[float, list[list[float]]] = {}
        for t, samples in said.sampled.items():
            alphas[t] = []
            for prompt, sample in zip(prompts, samples, strict=True):
                alphas[t].append(sampling_alphas(make, prompt, sample, t))
                advance()
    rows = []
    with progress.step(f"{draft.directory.name}: depths", len(sweep.ks)) as advance:
        for k in sweep.ks:
            stats, per_text = depth_counts(make, verify, prompts, k, sweep.max_new_tokens,
                                           agreements)  # fmt: skip
            row: dict[str, Any] = {
                "k": k,
                "acceptance_per_position": [round(stats.rate(i), 4) for i in range(k)],
                "mean_accepted_per_cycle": round(stats.mean_accepted, 4),
                "mean_accepted_95": interval(per_text, k),
                "tokens_per_target_call": round(stats.tokens_per_call, 4),
                "cycles": stats.cycles,
            }
            if alphas:
                row["sampling"] = {str(t): sampled_rows(a, k, sweep.max_new_tokens)
                                   for t, a in alphas.items()}  # fmt: skip
            if check is not None:
                row["mil_check"] = mil_check(check, verify, prompts[: sweep.check_mil], k,
                                             sweep.max_new_tokens,
                                             per_text[: sweep.check_mil])  # fmt: skip
            rows.append(row)
            echo(row_text(row, sweep.draft_backend))
            advance()
    label = "self-acceptance (the draft against its own checkpoint in fp32: a fidelity figure)" \
        if own else "acceptance"  # fmt: skip
    return {"draft": str(draft.directory), "draft_backend": sweep.draft_backend, "target": name,
            "own_target": own, "label": label, "rows": rows, "texts": len(prompts),
            "max_new_tokens": sweep.max_new_tokens,
            "positions": len(prompts) * sweep.max_new_tokens,
            "temperatures": temps, "estimator": ESTIMATOR,
            "loop": "replay" if sweep.replayed else "cycles",
            "extend_tokens": draft.functions["extend"].shape.tokens,
            "packages": [str(p) for p in draft.packages or [draft.package]],
            "function_packages": {f: str(p) for f, p in draft.function_packages.items()},
            }  # fmt: skip


ESTIMATOR = (
    "T = 0: greedy cycles over the target's greedy continuation (replayed from the draft's "
    "greedy tokens, teacher-forced in extend calls, or run); T > 0: per text, the target's "
    "continuation sampled at T (seeded by the text's index), the exact acceptance probability "
    "sum_x min(p_T, q_T) at each of its positions from the draft's logits after the same "
    "prefix (teacher-forced in extend calls), and the expected counts of the cycles, a cycle "
    "accepting its j-th draft with the product of the first j probabilities "
    "(converter.drafts.speculation.expected_replay); 95 % intervals by a bootstrap over the "
    "texts"
)


@click.command("speculate")
@click.option("--draft", "draft_dirs", required=True, multiple=True,
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="A cached draft artifact; repeat to compare drafts (one report).")  # fmt: skip
@click.option("--target", "target_dir", default=None,
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="A Hugging Face checkpoint directory (default: the draft's own checkpoint: "
              "self-acceptance, a fidelity measure).")  # fmt: skip
@click.option("--k", "depths", default="1..8", show_default=True, help="Draft depths.")
@click.option("--max-new-tokens", type=click.IntRange(1, 1024), default=48, show_default=True)
@click.option("--texts", type=click.IntRange(1), default=None,
              help="Use the first N built-in texts.")  # fmt: skip
@click.option("--temperature", "temperatures", type=float, multiple=True,
              help="Sampling temperature, repeatable; 0 is greedy [0, 0.7 and 1.0 for a draft "
              "returning logits, else 0].")  # fmt: skip
@click.option("--verify-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The target's time for one merged verify call of K + 1 positions (ms), on "
              "its own device: turns on the predicted loop model per chip.")  # fmt: skip
@click.option("--target-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The target's time per token alone (ms) [--verify-ms].")  # fmt: skip
@click.option(
    "--draft-backend",
    type=click.Choice(["torch", "mil", "coreml"]),
    default="torch",
    show_default=True,
    help="torch: the fp16 torch module the draft's program was converted from, holding a "
    "compressed variant's decoded weights (the gates hold both to one reference; many times "
    "faster); mil: the emitted program in anec's MIL evaluator (fp16 profile); coreml: Core "
    "ML on macOS (never run here).",
)
@click.option(
    "--check-mil",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Also run the first N texts with the draft in the MIL evaluator and report, per K, "
    "both mean accepted per cycle and their relative difference on those texts.",
)
@click.option(
    "--cycles",
    is_flag=True,
    help="With the torch backend, run every speculative cycle (draft, verify, roll back, "
    "extend) instead of replaying them: by default the torch draft decodes each text's "
    "target continuation once and the cycles of every K are counted from its greedy tokens "
    "(exact for greedy verification; mil and coreml always run the cycles).",
)
@click.option("--out", "out_dir", default=None, type=click.Path(path_type=Path, file_okay=False),
              help="Write speculate.txt, speculate.json and speculate.html here.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def speculate_command(
    draft_dirs: tuple[Path, ...],
    target_dir: Path | None,
    depths: str,
    max_new_tokens: int,
    texts: int | None,
    temperatures: tuple[float, ...],
    verify_ms: float | None,
    target_ms: float | None,
    draft_backend: str,
    check_mil: int,
    cycles: bool,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """Speculative decoding on held-out human-written text: each draft (a cached decoder
    artifact, run by --draft-backend) against the target (transformers, fp32). Per K:
    acceptance per draft position and mean accepted drafts per cycle, greedy (T = 0) and
    under speculative sampling at each --temperature (the exact acceptance probability per
    position, measured), with 95 % intervals over the texts. With --verify-ms: the loop model
    per chip (the draft's step costs from the cost model, predicted), sequential and
    pipelined, and the drafts ranked by predicted speed-up."""
    from converter.drafts.comparison import comparison, write_reports
    from converter.pipeline.progress import Steps

    sweep = Sweep(parse_depths(depths), max_new_tokens, texts, draft_backend, check_mil, cycles,
                  temperatures)  # fmt: skip
    echo = (lambda _: None) if as_json else click.echo
    for directory in draft_dirs:  # before any measuring: a failed one stops the comparison
        refuse_failed(directory)
    # Drafts of one checkpoint share its loaded target, and drafts that also share tokens and
    # temperatures share what it said: loaded and computed once, here, for this run.
    targets: dict[str, Target] = {}
    said: dict[tuple[Any, ...], Continuations] = {}
    docs = []
    with Steps(quiet=as_json) as progress:
        for directory in draft_dirs:
            echo(f"== {directory}")
            draft, prompts = open_draft(directory, sweep)
            temps = parse_temperatures(temperatures, draft.manifest, str(directory))
            key = target_key(draft, target_dir)
            if key not in targets:
                with progress.step("target: load"):
                    targets[key] = load_target(draft, target_dir)
            texts_key = (key, tuple(tuple(p) for p in prompts), tuple(temps))
            if texts_key not in said:
                total = len(prompts) * (sweep.replayed + sum(t > 0 for t in temps))
                with progress.step("target: continuations", total) as advance:
                    said[texts_key] = continuations(targets[key].model, prompts, sweep.steps,
                                                    temps, sweep.replayed, advance)  # fmt: skip
            doc = measure_draft(draft, prompts, temps, targets[key], said[texts_key], sweep,
                                progress, echo)  # fmt: skip
            docs.append(doc)
            echo(f"{doc['label']}; target {doc['target']}; {doc['texts']} texts x "
                 f"{max_new_tokens} tokens ({doc['positions']} positions)")  # fmt: skip
    report = comparison(docs, verify_ms, target_ms)
    if out_dir is not None:
        for path in write_reports(report, out_dir):
            echo(f"wrote {path}")
    if as_json:
        click.echo(json.dumps(report if len(docs) > 1 or verify_ms is not None else docs[0]))
    elif report.get("ranking"):
        from converter.drafts.comparison import ranking_text

        click.echo(ranking_text(report))
