"""The ``anec speculate`` command: greedy speculative decoding with a cached draft artifact."""

from __future__ import annotations

import hashlib
import json
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


def load_target(draft: Any, target: Path | None) -> tuple[Any, bool, str]:
    """The target model (fp32), whether it is the draft's own checkpoint, and its name."""
    from converter.checkpoint import load_checkpoint
    from converter.generate import artifact_checkpoint, artifact_source
    from converter.recipe.sources import ResolvedSource

    manifest = draft.manifest
    if target is None:
        source, _ = artifact_source(draft.directory)
        model = artifact_checkpoint(draft.directory).model
        return model.float().eval(), True, f"{source.directory} (the draft's own)"
    ckpt = load_checkpoint(ResolvedSource("hf-dir", target, None), "text-generation")
    if ckpt.sha256 == manifest["checkpoint"]["sha256"]:
        return ckpt.model.float().eval(), True, f"{target} (the draft's own)"
    if draft.tokenizer is None or ckpt.tokenizer is None:
        raise InputError(f"{target}: a vocabulary check needs both tokenizers")
    shared = min(manifest["vocab_size"], len(ckpt.tokenizer.get_vocab()))
    if vocab_hash(draft.tokenizer.get_vocab(), shared) != vocab_hash(
        ckpt.tokenizer.get_vocab(), shared
    ):
        raise InputError(
            f"{target}: its vocabulary differs from the draft's on ids 0..{shared - 1}"
        )
    return ckpt.model.float().eval(), False, str(target)


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

    from converter.speculate import Acceptance, speculate

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
    from converter.speculate import Acceptance

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


def replay_agreements(
    make: Any, model: Any, prompts: list[list[int]], tokens: int
) -> list[list[bool]]:
    """Per text, the target's greedy continuation of ``tokens`` (fp32, transformers' cache)
    and whether the draft's greedy token matches it after each prefix (`draft_agreement`)."""
    from converter.speculate import draft_agreement
    from parity.reference import greedy_ids

    return [
        draft_agreement(make, prompt, greedy_ids(model, tuple(prompt), tokens))
        for prompt in prompts
    ]


def depth_counts(
    make: Any, verify: Any, prompts: list[list[int]], k: int, max_new_tokens: int,
    agreements: list[list[bool]] | None, check_mil: int,
) -> tuple[Any, list[Any]]:  # fmt: skip
    """Depth ``k``'s counts over every text, and each of the first ``check_mil`` texts' own:
    replayed from ``agreements`` (`replay_agreements`), or by running the cycles."""
    from converter.speculate import Acceptance, replay, speculate

    stats, subset = Acceptance(k), []
    for i, prompt in enumerate(prompts):
        one = Acceptance(k)
        if agreements is None:
            speculate(make, verify, prompt, k, max_new_tokens, one)
        else:
            replay(agreements[i], max_new_tokens, k, one)
        stats.add(one)
        if i < check_mil:
            subset.append(one)
    return stats, subset


def row_text(row: dict[str, Any], backend: str) -> str:
    """One K's row of the sweep as text (and its MIL check, when one ran)."""
    rates = " ".join(f"{r:.2f}" for r in row["acceptance_per_position"])
    text = (
        f"K={row['k']}: acceptance per position [{rates}]  mean accepted "
        f"{row['mean_accepted_per_cycle']:.2f}  tokens/target call "
        f"{row['tokens_per_target_call']:.2f}"
        + (f"  predicted {row['predicted_speedup']}" if "predicted_speedup" in row else "")
    )
    if "mil_check" in row:
        c = row["mil_check"]
        text += (
            f"\n  MIL check on {c['texts']} text(s): mean accepted {backend} "
            f"{c['backend_mean_accepted']:.4f}, mil {c['mil_mean_accepted']:.4f} "
            f"(relative difference {c['relative_difference']:.2%}; cycles {c['backend_cycles']}"
            f" / {c['mil_cycles']}; 95 % interval of the difference "
            f"[{c['relative_difference_95'][0]:.2%}, {c['relative_difference_95'][1]:.2%}])"
        )
        if c["first_difference"] is not None:
            d = c["first_difference"]
            text += (f"\n  first parting cycle: text {d['text']}, continuation index "
                     f"{d['continuation_index']}: {backend} accepted {d['backend_accepted']}, "
                     f"mil {d['mil_accepted']}")  # fmt: skip
    return text


@click.command("speculate")
@click.option("--draft", "draft_dir", required=True,
              type=click.Path(path_type=Path, exists=True, file_okay=False))  # fmt: skip
@click.option("--target", "target_dir", default=None,
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="A Hugging Face checkpoint directory (default: the draft's own checkpoint: "
              "self-acceptance, a fidelity measure).")  # fmt: skip
@click.option("--k", "depths", default="1..8", show_default=True, help="Draft depths.")
@click.option("--max-new-tokens", type=click.IntRange(1, 1024), default=48, show_default=True)
@click.option("--texts", type=int, default=None, help="Use the first N built-in texts.")
@click.option("--draft-ms", type=float, default=None, help="Draft time per token (ms).")
@click.option("--verify-ms", type=float, default=None, help="Target time to verify K tokens.")
@click.option("--target-ms", type=float, default=None, help="Target time per token alone.")
@click.option(
    "--draft-backend",
    type=click.Choice(["torch", "mil", "coreml"]),
    default="torch",
    show_default=True,
    help="torch: the fp16 torch module the draft's program was converted from (the gates hold "
    "both to one reference; many times faster); mil: the emitted program in anec's MIL "
    "evaluator (fp16 profile); coreml: Core ML on macOS (never run here).",
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
@click.option("--json", "as_json", is_flag=True)
def speculate_command(
    draft_dir: Path,
    target_dir: Path | None,
    depths: str,
    max_new_tokens: int,
    texts: int | None,
    draft_ms: float | None,
    verify_ms: float | None,
    target_ms: float | None,
    draft_backend: str,
    check_mil: int,
    cycles: bool,
    as_json: bool,
) -> None:
    """Greedy speculative decoding on held-out human-written text: the draft (a cached
    decoder artifact, run by --draft-backend), the target by transformers in fp32. Prints
    acceptance per draft position, mean accepted drafts per cycle and tokens per target call
    for each K; with --draft-ms, --verify-ms and --target-ms, a predicted speed-up (never for
    the draft's own checkpoint, whose figure is self-acceptance)."""
    from converter.generate import Runtime, coreml_backend, mil_backend, torch_backend
    from converter.speculate import TEXTS, speedup, target_tokens

    draft = Runtime.from_artifact(draft_dir)
    if draft.tokenizer is None:
        raise InputError(f"{draft_dir}: the draft ships no tokenizer.json")
    model, own, target_name = load_target(draft, target_dir)
    backends = {"torch": torch_backend, "mil": mil_backend, "coreml": coreml_backend}
    make = backends[draft_backend](draft)
    check = mil_backend(draft) if check_mil and draft_backend != "mil" else None
    prompts = [list(draft.tokenizer.encode(t).ids) for t in TEXTS[:texts]]
    verify = partial(target_tokens, model)
    ks = parse_depths(depths)
    agreements = None
    if draft_backend == "torch" and not cycles:
        agreements = replay_agreements(make, model, prompts, max_new_tokens + max(ks) - 1)
    rows = []
    for k in ks:
        stats, subset = depth_counts(make, verify, prompts, k, max_new_tokens, agreements,
                                     check_mil)  # fmt: skip
        row: dict[str, Any] = {
            "k": k,
            "acceptance_per_position": [round(stats.rate(i), 4) for i in range(k)],
            "mean_accepted_per_cycle": round(stats.mean_accepted, 4),
            "tokens_per_target_call": round(stats.tokens_per_call, 4),
            "cycles": stats.cycles,
        }
        if check is not None:
            row["mil_check"] = mil_check(check, verify, prompts[:check_mil], k,
                                         max_new_tokens, subset)  # fmt: skip
        if not own and None not in (draft_ms, verify_ms, target_ms):
            assert draft_ms is not None and verify_ms is not None and target_ms is not None
            row["predicted_speedup"] = speedup(
                stats.mean_accepted, k, draft_ms, verify_ms, target_ms
            )
        rows.append(row)
        if not as_json:
            click.echo(row_text(row, draft_backend))
    label = "self-acceptance (fidelity; no speed-up)" if own else "acceptance"
    doc = {"draft": str(draft_dir), "draft_backend": draft_backend, "target": target_name,
           "label": label, "rows": rows, "texts": len(prompts),
           "max_new_tokens": max_new_tokens,
           "loop": "cycles" if agreements is None else "replay"}  # fmt: skip
    if as_json:
        click.echo(json.dumps(doc))
    else:
        click.echo(f"{label}; target {target_name}; {len(prompts)} texts x {max_new_tokens} tokens")
        if not own:
            click.echo(
                "predicted speed-up: sequential = (mean accepted + 1) * target_ms / "
                "(K * draft_ms + verify_ms); pipelined = (mean accepted + 1) * target_ms / "
                "max(K * draft_ms, verify_ms)"
            )
