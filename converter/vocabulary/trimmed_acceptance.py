"""A trimmed head judged as a draft: greedy acceptance against the untrimmed checkpoint (fp32,
the target), for the untrimmed and the trimmed fp16 draft side by side.

Judging prompts are cut from held-out human-written text (`corpora`); the target continues
each greedily; the draft module in fp16 reads every prompt plus its continuation once, and
`converter.drafts.speculation.replay` counts the cycles each depth K would run (exact for greedy
verification, see there). The trimmed draft's logits are the untrimmed draft's at the kept
rows (each head row is its own dot product; a kernel may add in another order, so equal up
to rounding), so one fp16 pass judges both.

Prompt plus continuation fit the draft's window (``length``): the window program then reads
the same context as this check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from converter.drafts.speculation import Acceptance, replay
from converter.errors import InputError
from converter.vocabulary.corpora import Corpus
from graph_passes.decoder import BC1LDecoder
from graph_passes.masks import key_mask_from_padding

DEPTHS = (1, 2, 3, 4)
GATED_DEPTH = 4
# Judged tokens per prompt, at most: half the window up to 32 (SmolLM2's 64-token window:
# 28-token prompts, 32 judged tokens, 4 drafted past them).
MAX_NEW = 32
MIN_PROMPT = 4


@dataclass(frozen=True)
class Judging:
    """The prompts' shape: prompt tokens, judged tokens and how many prompts."""

    prompt_tokens: int
    new_tokens: int
    prompts: int

    @property
    def positions(self) -> int:
        """Target tokens judged (each one a draft position some cycle reaches or skips)."""
        return self.new_tokens * self.prompts


def judging_shape(length: int, positions: int) -> Judging:
    """Prompt and continuation sizes within a window of ``length`` slots, and the prompts
    needed for at least ``positions`` judged tokens."""
    new = min(MAX_NEW, length // 2)
    prompt = length - new - max(DEPTHS)
    if prompt < MIN_PROMPT:
        raise InputError(
            f"shapes.sequence_length: {length} slots leave {prompt} prompt tokens for judging "
            f"a draft vocabulary; at least {MIN_PROMPT + max(DEPTHS) + 2 * MIN_PROMPT} needed"
        )
    return Judging(prompt, new, -(-positions // new))


def judging_prompts(tokenizer: Any, corpus: Corpus, shape: Judging) -> list[list[int]]:
    """``shape.prompts`` prompts of ``shape.prompt_tokens`` tokens, evenly spaced over the
    judging text (its texts joined by blank lines)."""
    ids = tokenizer("\n\n".join(corpus.texts), add_special_tokens=False)["input_ids"]
    step = len(ids) // shape.prompts
    if step < shape.prompt_tokens:
        raise InputError(
            f"vocabulary.judging_text: {corpus.name!r} has {len(ids)} tokens, too few for "
            f"{shape.prompts} prompts of {shape.prompt_tokens}"
        )
    return [ids[i * step : i * step + shape.prompt_tokens] for i in range(shape.prompts)]


@dataclass
class AcceptanceReport:
    """Both drafts' acceptance per depth on the judging prompts."""

    shape: Judging
    outside_share: float  # judged target tokens the trimmed head cannot draft
    full: list[Acceptance]
    trimmed: list[Acceptance]

    @property
    def loss(self) -> float:
        """Relative drop of mean accepted drafts per cycle at the gated depth."""
        full = self.full[DEPTHS.index(GATED_DEPTH)].mean_accepted
        trimmed = self.trimmed[DEPTHS.index(GATED_DEPTH)].mean_accepted
        return (full - trimmed) / full if full else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures (vocabulary.json, the manifest's draft_vocabulary)."""

        def depth(a: Acceptance) -> dict[str, Any]:
            return {
                "k": a.k,
                "mean_accepted": round(a.mean_accepted, 4),
                "rate_per_position": [round(a.rate(i), 4) for i in range(a.k)],
                "cycles": a.cycles,
            }

        return {
            "prompts": self.shape.prompts,
            "prompt_tokens": self.shape.prompt_tokens,
            "judged_tokens_per_prompt": self.shape.new_tokens,
            "positions": self.shape.positions,
            "outside_share": round(self.outside_share, 4),
            "untrimmed": [depth(a) for a in self.full],
            "trimmed": [depth(a) for a in self.trimmed],
            "loss_at_k4": round(self.loss, 4),
        }


# Sequences per batched call: the target's greedy steps and the draft's passes run the
# judging prompts together (all of one length), in groups of this many for memory (Gemma 3's
# fp16 logits: 8 x 262,144 x 64 x 2 bytes = 268 MB).
GROUP = 8


def draft_logits(module: BC1LDecoder, table: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The module's logits (n, V) at every position of ``ids`` (n <= its window), left-padded
    to the window in the module's dtype."""
    return batch_draft_logits(module, table, [ids])[0]


def batch_draft_logits(
    module: BC1LDecoder, table: torch.Tensor, rows: list[list[int]]
) -> torch.Tensor:
    """`draft_logits` of equally long ``rows`` in one call: (B, n, V) fp32."""
    length, n = module.io.length, len(rows[0])
    pad = length - n
    tokens = torch.tensor([[0] * pad + ids for ids in rows])
    real = torch.tensor([[0] * pad + [1] * n] * len(rows))
    dtype = next(module.parameters()).dtype
    key_mask = key_mask_from_padding(real).to(dtype)
    x = tokens if module.io.inputs == "token-ids" else table[tokens].to(dtype)
    with torch.no_grad():
        last = module.run_layers(x, key_mask)[-1]
        logits = torch.cat(module.head(last), dim=1)  # (B, V, 1, L)
    return logits[:, :, 0, pad:].transpose(1, 2).float()


@torch.no_grad()
def batch_greedy(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """The target's greedy continuation of equally long ``prompts``, ``steps`` tokens each,
    in one batch with transformers' cache (no padding: every row has the same length)."""
    out = model(input_ids=torch.tensor(prompts), use_cache=True)
    chosen: list[torch.Tensor] = []
    for _ in range(steps):
        token = out.logits[:, -1].float().argmax(-1, keepdim=True)  # (B, 1)
        chosen.append(token)
        out = model(input_ids=token, cache=out.cache, use_cache=True)
    return torch.cat(chosen, dim=1).tolist()


def judge(
    target: torch.nn.Module,
    draft16: BC1LDecoder,
    table: torch.Tensor,
    prompts: list[list[int]],
    shape: Judging,
    kept_sets: list[np.ndarray],
    advance: Callable[[], None] = lambda: None,
) -> list[AcceptanceReport]:
    """Greedy acceptance of the untrimmed fp16 draft (``draft16``, the whole head) and of
    each trimmed one (``kept_sets``: each head's ascending ids) with ``target`` in fp32, one
    report per trimmed head; the drafts share the target's continuations and one fp16 pass."""
    full = [Acceptance(k) for k in DEPTHS]
    trimmed = [[Acceptance(k) for k in DEPTHS] for _ in kept_sets]
    kept_ts = [torch.from_numpy(kept) for kept in kept_sets]
    outside = [0] * len(kept_sets)
    extra = max(DEPTHS) - 1
    for start in range(0, len(prompts), GROUP):
        group = prompts[start : start + GROUP]
        conts = batch_greedy(target, group, shape.new_tokens + extra)
        rows = [p + c[:-1] for p, c in zip(group, conts, strict=True)]
        batch = batch_draft_logits(draft16, table, rows)[:, shape.prompt_tokens - 1 :]
        for logits, cont in zip(batch, conts, strict=True):
            want = torch.tensor(cont)
            _replay_all((logits.argmax(-1) == want).tolist(), shape, full)
            judged = want[: shape.new_tokens]
            for i, kept in enumerate(kept_ts):
                agree = (kept[logits[:, kept].argmax(-1)] == want).tolist()
                _replay_all(agree, shape, trimmed[i])
                outside[i] += int((~torch.isin(judged, kept)).sum())
            advance()
    return [
        AcceptanceReport(shape, out / shape.positions, full, t)
        for out, t in zip(outside, trimmed, strict=True)
    ]


def _replay_all(agree: list[bool], shape: Judging, depths: list[Acceptance]) -> None:
    for stats in depths:
        replay(agree, shape.new_tokens, stats.k, stats)
