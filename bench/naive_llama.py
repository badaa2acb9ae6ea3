"""Moved to ``graph_passes/naive_llama.py`` (``anec plan-baseline`` builds the same port).

Re-exported here so ``from naive_llama import NaiveLlama`` in bench/convert.py keeps working.
"""

from graph_passes.naive_llama import NaiveConfig, NaiveLlama

__all__ = ["NaiveConfig", "NaiveLlama"]
