"""Parity on the emitted program itself: a MIL evaluator that runs on Linux.

Core ML cannot run a model on Linux, but coremltools reads an ``.mlpackage``'s MIL program and
weights there. ``Evaluator`` runs a function of that program op by op in numpy under a numeric
profile (``fp32``, ``fp16``, ``fp16-acc``; see ``parity.mil.profiles``), so what coremltools
made of the torch graph - op lowering, fp16 casts, clamped epsilons, folded constants, fused
ops, compressed weights - is checked against torch and the original checkpoint.
"""

from parity.mil.errors import MILError, OpEvaluationError, UnsupportedOpError
from parity.mil.evaluator import Evaluation, Evaluator, evaluate
from parity.mil.profiles import GATED, PROFILES, Profile, get_profile
from parity.mil.program import load_package, walk_ops
from parity.mil.registry import KERNELS, signature, unsupported

__all__ = [
    "GATED",
    "KERNELS",
    "PROFILES",
    "Evaluation",
    "Evaluator",
    "MILError",
    "OpEvaluationError",
    "Profile",
    "UnsupportedOpError",
    "evaluate",
    "get_profile",
    "load_package",
    "signature",
    "unsupported",
    "walk_ops",
]
