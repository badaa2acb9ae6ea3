"""One `anec speculate` sweep: a draft's acceptance against a target, every K and temperature.

The target and what it says on the texts (its greedy and sampled continuations) are loaded and
computed once per run and shared by the drafts judged against it (`Target`, `Continuations`);
each draft is then teacher-forced along them (`converter.drafts.speculation`) and each K's
cycles counted, greedy and under sampling, with bootstrap intervals over the texts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from converter.errors import InputError


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
