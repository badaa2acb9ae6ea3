"""The former adapter entry points, kept for their callers: see `graph_passes.archs`."""

from __future__ import annotations

from graph_passes.archs import ADAPTERS, ENCODER_ADAPTERS, adapt, adapt_encoder

__all__ = ["ADAPTERS", "ENCODER_ADAPTERS", "adapt", "adapt_encoder"]
