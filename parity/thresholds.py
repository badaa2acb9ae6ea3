"""Every parity gate's threshold and its default, in one place.

`Thresholds` holds each threshold under its gate's name (the recipe's ``gates:`` and
``decision:`` keys); a model kind reads the ones its gates check. The recipe schema takes its
defaults from `DEFAULTS`, so a default is written once. No heavy imports: the schema loads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Gate thresholds by gate name, fixed in the recipe before anything is measured. The
    defaults here are the recipe's too (`converter.recipe.sections` reads them): one place."""

    fp32_layer_rel_error: float = 1.0e-4
    fp32_logits_rel_error: float = 1.0e-4  # decoders: logits; encoders, decisions: outputs
    fp16_argmax_agreement: float = 1.0
    fp16_max_abs_dprob: float = 0.02
    mil_fp32_layer_rel_error: float = 1.0e-5  # the emitted program
    kv_max_abs_dprob: float = 0.03  # cached decoders, fp16 through the cache
    # Opt-in: None runs no device-margin profile and records no gate.
    device_margin_argmax_agreement: float | None = None
    # encoders
    fp32_min_cosine: float = 0.99999
    fp16_min_cosine: float = 0.9995
    # decision models
    fp32_marker_rows_rel_error: float = 1.0e-4
    candidate_argmax_agreement: float = 1.0
    action_argmax_agreement: float = 1.0
    max_abs_dprob_calibrated: float = 0.02
    max_abs_dprob_action: float = 0.02
    narrow_margin: float = 1.0  # scorer logits: top1 - top2 below this is the narrow slice


DEFAULTS = Thresholds()
