"""A decoder variant's acceptance as a speculative draft for the fp16 model (issue 12 item 2).

Both models run in torch, fp32, through a KV cache (``graph_passes.cached_decoder``, the
modules the stateful artifacts are built from): the draft holds the variant's decoded weights,
the target the fp16 artifact's weights (the BC1L module rounded through fp16). Greedy
speculative decoding (``converter.drafts.speculation``) on the first tokens of held-out texts: the
draft proposes K tokens one decode at a time; the target verifies them in one call over the
last context token and the K drafts, as a verifier does. Acceptance per draft position, mean
accepted drafts per cycle and tokens per target call are measurements of these weights in
fp32 torch, not of a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from converter.drafts.speculation import Acceptance, speculate
from graph_passes.decoder import BC1LDecoder
from parity.kv_session import CacheSession, session_for, torch_runner

_PREFILL = 16  # tokens per prefill call (any prompt length runs in calls of this many)


@dataclass(frozen=True)
class AcceptanceSetup:
    """What the measurement runs: depths, prompts (token ids) and tokens generated each."""

    depths: list[int]
    prompts: list[list[int]]
    new_tokens: int

    @property
    def cache_length(self) -> int:
        """Slots for the longest prompt, its continuation and a last draft (a multiple of 32)."""
        need = max(len(p) for p in self.prompts) + self.new_tokens + max(self.depths) + 1
        return -(-need // 32) * 32


def session(module: BC1LDecoder, setup: AcceptanceSetup, table: torch.Tensor, verify: int) -> Any:
    """A fresh cached session over ``module`` in fp32: prefill, decode, extend (K tokens) and
    verify (K + 1 tokens, logits at every one)."""
    from graph_passes.cached_decoder import cached_functions

    calls = {
        "prefill": (_PREFILL, "last"),
        "decode": (1, "last"),
        "extend": (max(setup.depths), "last"),
        "verify": (verify, "all"),
    }
    functions = cached_functions(module, "state", setup.cache_length, calls)
    for m in functions.values():
        m.reset_cache()

    def embed(ids: list[int]) -> np.ndarray:
        return table[ids].float().numpy()

    return session_for(functions, torch_runner(functions, torch.float32), None, embed)


class SessionVerifier:
    """The target's greedy tokens from a cached session: one ``verify`` call over the last
    context token and the drafts, after absorbing whatever context it has not seen."""

    def __init__(self, session: CacheSession) -> None:
        self.session = session
        self.seen: list[int] = []  # the ids whose cache entries the session holds

    def __call__(self, ids: list[int], first: int) -> list[int]:
        same = 0
        while same < min(len(self.seen), first) and self.seen[same] == ids[same]:
            same += 1
        self.session.rollback(same)
        if same < first:
            self.session.prefill("prefill", ids[same:first])
        tokens = ids[first:]
        width = self.session.functions["verify"].shape.tokens
        if len(tokens) > width:
            raise ValueError(f"{len(tokens)} tokens to verify, the verifier takes {width}")
        logits = self.session.call("verify", tokens)[:, -len(tokens) :]
        self.seen = list(ids)
        return [int(t) for t in logits.argmax(axis=0)]


def draft_acceptance(
    draft: BC1LDecoder,
    target: BC1LDecoder,
    table: torch.Tensor,
    setup: AcceptanceSetup,
    advance: Callable[[], None] = lambda: None,
) -> list[Acceptance]:
    """Acceptance of ``draft`` for ``target`` at every depth of ``setup`` (``advance`` after
    each depth)."""
    verify_width = max(setup.depths) + 1
    out = []
    for k in setup.depths:
        stats = Acceptance(k)
        for prompt in setup.prompts:
            verifier = SessionVerifier(session(target, setup, table, verify_width))
            speculate(
                lambda: session(draft, setup, table, verify_width),
                verifier, prompt, k, setup.new_tokens, stats,
            )  # fmt: skip
        out.append(stats)
        advance()
    return out


def acceptance_json(rows: list[Acceptance], setup: AcceptanceSetup) -> dict[str, Any]:
    """The report section."""
    return {
        "draft": "the variant's decoded weights, torch fp32 through a KV cache",
        "target": "the fp16 artifact's weights, torch fp32 through a KV cache",
        "prompts": len(setup.prompts),
        "prompt_tokens": [len(p) for p in setup.prompts],
        "new_tokens": setup.new_tokens,
        "evidence": "measured (torch on the CPU), not a device",
        "depths": [
            {
                "k": s.k,
                "acceptance_per_position": [round(s.rate(i), 4) for i in range(s.k)],
                "mean_accepted_per_cycle": round(s.mean_accepted, 4),
                "tokens_per_target_call": round(s.tokens_per_call, 4),
                "cycles": s.cycles,
            }
            for s in rows
        ],
    }


def acceptance_text(doc: dict[str, Any]) -> str:
    """Readable lines of ``acceptance_json``."""
    lines = [
        f"Acceptance as a draft for the fp16 model ({doc['draft']}; target {doc['target']}; "
        f"greedy, {doc['prompts']} held-out prompts, {doc['new_tokens']} new tokens each):"
    ]
    for d in doc["depths"]:
        rates = " ".join(f"{r:.2f}" for r in d["acceptance_per_position"])
        lines.append(
            f"  K={d['k']}: per position {rates}; mean accepted {d['mean_accepted_per_cycle']:.2f}"
            f" per cycle; {d['tokens_per_target_call']:.2f} tokens per target call"
        )
    return "\n".join(lines)
