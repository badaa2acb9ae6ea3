"""Weight bytes a draft streams per decoded token, before and after trimming its head, and the
cost model's predicted floor of that step per chip (SPEC section 6: a prediction).

Per decoded token the NE reads every layer's weights, the final norm and the whole head once;
the embedding row is gathered (on the host, or one row in the program), not streamed. The
floor prices that work as `converter.placement.cost` prices a function: 2 FLOPs per weight (one
token), the weight bytes, the logits returned and one NE segment; the full plan of the
emitted program is in its plan.json.
"""

from __future__ import annotations

from typing import Any

from converter.evidence.labels import Evidence
from converter.placement.chips import cost_chips
from converter.placement.cost import MODEL_NOTE, Work, floor_of_work
from graph_passes.decoder import BC1LDecoder


def body_weights(module: BC1LDecoder) -> int:
    """Weights streamed per token besides the head: every layer's, the final norm's."""
    return sum(
        p.numel()
        for name, p in module.named_parameters()
        if not name.startswith(("lm_head.", "embed."))
    )


def _work(weights: int, rows: int, bytes_per_weight: float) -> Work:
    return Work(
        ne_flops=2 * weights,
        ne_weight_bytes=int(weights * bytes_per_weight),
        cpu_flops=0,
        cpu_weight_bytes=0,
        copy_bytes=0,
        output_bytes=int(rows * bytes_per_weight),
        ne_segments=1,
        w8a8=False,
    )


def streamed_section(
    body: int, hidden: int, vocab: int, rows: int, bytes_per_weight: float = 2.0
) -> dict[str, Any]:
    """Streamed bytes per decoded token with the whole head (``vocab`` rows) and the trimmed
    one (``rows``), each head ``rows x hidden``, and the predicted floors per chip."""
    before, after = body + vocab * hidden, body + rows * hidden
    floors = {}
    for chip in cost_chips():
        old = floor_of_work("decode", _work(before, vocab, bytes_per_weight), chip)
        new = floor_of_work("decode", _work(after, rows, bytes_per_weight), chip)
        floors[chip.name] = {
            "before_ms": round(old.ms, 4),
            "after_ms": round(new.ms, 4),
            "bound_before": old.bound,
            "bound_after": new.bound,
        }
    return {
        "bytes_per_weight": bytes_per_weight,
        "bytes_before": int(before * bytes_per_weight),
        "bytes_after": int(after * bytes_per_weight),
        "ratio": round(after / before, 4),
        "head_share_before": round(vocab * hidden / before, 4),
        "floors": {
            "evidence": Evidence.PREDICTED.value,
            "what": "the cost model on one decode step's weights (2 FLOPs per weight, the "
            "logits returned, one NE segment); the emitted program's own plan is plan.json",
            "note": MODEL_NOTE,
            "per_chip": floors,
        },
    }
