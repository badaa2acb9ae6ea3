"""Errors of the MIL evaluator; each names the op type and the op it concerns."""

from __future__ import annotations


class MILError(Exception):
    """Base class: the program cannot be evaluated as asked."""


class UnsupportedOpError(MILError):
    """An op type, or an attribute value of a known op, has no kernel in this evaluator."""

    def __init__(self, op_type: str, op_name: str, reason: str = "") -> None:
        self.op_type = op_type
        self.op_name = op_name
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"no kernel for MIL op type {op_type!r} (op {op_name!r}){detail}")


class OpEvaluationError(MILError):
    """A kernel failed, or produced a result whose shape differs from the declared one."""

    def __init__(self, op_type: str, op_name: str, problem: str) -> None:
        self.op_type = op_type
        self.op_name = op_name
        super().__init__(f"MIL op {op_type!r} (op {op_name!r}): {problem}")
