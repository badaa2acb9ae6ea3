"""The ``anec speculate`` command: drafts compared by greedy and sampled acceptance."""

from __future__ import annotations

import json
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
    from converter.drafts.sweep import (
        Continuations,
        Sweep,
        Target,
        continuations,
        load_target,
        measure_draft,
        open_draft,
        target_key,
    )
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
