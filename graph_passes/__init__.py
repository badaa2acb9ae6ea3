"""Model rewrites: the canonical transformer spec, per-architecture adapters, the BC1L module."""
