"""Errors anec reports without a traceback, shared by every layer.

They live here, in the lowest layer, so graph_passes raises them without importing converter;
``converter.errors`` re-exports them (with the CLI's printer), so every ``except`` names the
same classes. Exit codes: 0 converted and every gate passed, 1 a gate failed, 2 bad input.
"""

from __future__ import annotations


class AnecError(Exception):
    """Base class for errors anec reports without a traceback."""

    exit_code = 2


class InputError(AnecError):
    """Bad input: a recipe, checkpoint, path or option that cannot be used as given.

    The message names the file, field or tensor and what was expected.
    """

    exit_code = 2


class GateFailure(AnecError):
    """A parity gate failed: the converted model does not compute the checkpoint's function."""

    exit_code = 1
