"""Run an ML Program's function on numpy inputs, op by op, under a numeric profile.

``Evaluator`` prepares a function once (kernels looked up, constants and compressed weights
decoded and stored as the profile says, each value's last use found) and then runs it on any
number of inputs. Every float an op reads is an fp32 array; under fp16 storage its values are
fp16 values. Every result's shape is checked against the shape the program declares.

An fp16 constant is held as the program's own fp16 array (its values are exactly fp16 values,
so the fp32 array an op reads is made from it when the op runs): fp32 copies of every weight,
kept for the evaluator's lifetime, were the largest single block of the MIL parity step's
memory (Qwen2.5-0.5B shape: 2 GB beside the program's own 1 GB).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import parity.mil.kernels  # noqa: F401  (registers every kernel)
from parity.mil.deviations import Perturbation
from parity.mil.errors import MILError, OpEvaluationError, UnsupportedOpError
from parity.mil.kernels.state import StateSlot
from parity.mil.numerics import (
    Arithmetic,
    has_fp16_subnormal,
    round_fp16,
    widen_fp16,
)
from parity.mil.profiles import Profile, get_profile
from parity.mil.program import const_array, dtype_name, is_constant
from parity.mil.registry import KERNELS, Call, KernelSpec, unsupported
from parity.mil.values import FLOAT_TYPES, INT_TYPES, coerce, pack_if_exact, packed_fp16, widen

# Where an op input comes from: a named value, a list of named values, or a fixed value
# (an optional input left at its default, which has no op of its own).
_Source = tuple[str, Any]


@dataclass
class _Step:
    op: Any
    spec: KernelSpec
    inputs: dict[str, _Source]
    outputs: list[tuple[str, str, tuple[int, ...] | None]]
    free: list[str] = field(default_factory=list)


@dataclass
class Evaluation:
    """The outputs of one run (by output name) and the captured intermediate values."""

    outputs: dict[str, np.ndarray]
    captured: dict[str, np.ndarray]
    # Float values (any op's output, in program order) holding an inf or NaN: an overflow
    # anywhere in the program, even one a later op hides (a max, a masked softmax).
    non_finite: list[str] = field(default_factory=list)


class BlasThreads:
    """Limits BLAS to ``count`` threads inside ``with limit():`` (None: leaves it as it is).

    The evaluator issues thousands of small products; on 2 shared cores OpenBLAS's threads
    made them 10 to 25 times slower than one thread (measured on SmolLM2's shapes). The BLAS
    libraries are found once, here: threadpoolctl's search on every run was 1.5 s of SmolLM2
    KV's cache parity (py-spy).
    """

    def __init__(self, count: int | None) -> None:
        from threadpoolctl import ThreadpoolController

        self.count = count
        self._controller = ThreadpoolController() if count is not None else None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self._controller is None:
            yield
            return
        with self._controller.limit(limits=self.count, user_api="blas"):
            yield


def _is_state(var: Any) -> bool:
    from coremltools.converters.mil.mil import types

    return bool(types.is_state(var.sym_type))


def _static_shape(var: Any) -> tuple[int, ...] | None:
    shape = var.shape
    if all(isinstance(d, int | np.integer) for d in shape):
        return tuple(int(d) for d in shape)
    return None


class Evaluator:
    """Evaluates one function of an ML Program under one numeric profile."""

    def __init__(
        self,
        program: Any,
        profile: Profile | str,
        function: str = "main",
        threads: int | None = 1,
        like: Evaluator | None = None,
        seed: int = 0,
    ) -> None:
        """Prepare ``function`` of ``program`` under ``profile``.

        ``like``: an evaluator of the same function under a profile without fp16 storage,
        whose decoded constants this one derives its own from instead of decoding the
        program's again (the same values; arrays are shared where they are equal).
        ``seed``: the signs of a profile's deviations (`reseed` changes it between runs).
        """
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.threads = threads
        self._blas = BlasThreads(threads)
        self.arith = Arithmetic(self.profile)
        self.perturbation: Perturbation | None = None
        self.reseed(seed)
        if function not in program.functions:
            raise MILError(
                f"no function {function!r} in the program; it has {sorted(program.functions)}"
            )
        self.function_name = function
        self.function = program.functions[function]
        # States (ct.StateType) are passed to `run` apart from the inputs: their values
        # persist between runs, as a runtime's MLState does.
        self.states = {
            name: (dtype_name(var), _static_shape(var))
            for name, var in self.function.inputs.items()
            if _is_state(var)
        }
        self.inputs = {
            name: (dtype_name(var), _static_shape(var))
            for name, var in self.function.inputs.items()
            if name not in self.states
        }
        self.output_names = [var.name for var in self.function.outputs]
        self._constants: dict[str, Any] = {}
        self._steps: list[_Step] = []
        self._scratch = np.empty(0, np.float32)  # `_borrowed`'s buffer, during a run
        usable = (
            like is not None
            and like.function is self.function
            and not like.profile.fp16_storage
            and not like.profile.flush_subnormals
        )
        self._like = like if usable else None
        self._prepare()
        self._like = None
        self._names = frozenset(self.var_names()) | set(self.inputs)  # what run may capture

    # ----------------------------------------------------------------------------------
    # preparation

    def _prepare(self) -> None:
        missing = []
        for op in self.function.operations:
            if op.blocks:
                missing.append(UnsupportedOpError(op.op_type, op.name, "nested blocks"))
                continue
            if op.op_type == "const":
                continue
            reason = unsupported(op)
            if reason is not None:
                missing.append(UnsupportedOpError(op.op_type, op.name, reason))
        if missing:
            if len(missing) == 1:
                raise missing[0]
            lines = "\n".join(f"  {e}" for e in missing)
            raise UnsupportedOpError(
                missing[0].op_type, missing[0].op_name, f"and {len(missing) - 1} more:\n{lines}"
            )

        for op in self.function.operations:
            if op.op_type == "const":
                var = op.outputs[0]
                self._constants[var.name] = self._const(var)
                continue
            step = self._step(op)
            if is_constant(op):
                # constexpr_* ops: compile-time decompression, done once here.
                env = dict(self._constants)
                self._execute(step, env)
                for name, dtype, _ in step.outputs:
                    value = env[name]
                    self._constants[name] = pack_if_exact(value) if dtype == "fp16" else value
                continue
            self._steps.append(step)
        self._plan_frees()

    def _const(self, var: Any) -> Any:
        """A ``const`` op's value under this profile, from ``like`` when there is one.

        ``like`` holds every float constant as ``value.astype(float32)`` (fp32 storage, no
        flushing), which is the first step of ``coerce`` too, so storing it under this profile
        gives the same bits. An fp16 constant is already an fp16 value: without flushing it
        is shared as it is; with flushing a copy is made only if it holds a subnormal.
        """
        dtype = dtype_name(var)
        if dtype == "fp16":
            packed = packed_fp16(const_array(var), self.arith)
            if packed is not None:
                return packed
        if self._like is None or var.name not in self._like._constants:
            return coerce(const_array(var), dtype, self.arith)
        value = self._like._constants[var.name]
        if dtype not in FLOAT_TYPES:
            return value
        if dtype == "fp16" and not self.profile.flush_subnormals:
            return value
        if dtype == "fp16" and not has_fp16_subnormal(value):
            return value
        return self.arith.store(value)

    def _step(self, op: Any) -> _Step:
        inputs: dict[str, _Source] = {}
        for name in op.input_spec.input_types:
            var = getattr(op, name, None)
            if var is None:
                continue
            if isinstance(var, list | tuple):
                inputs[name] = ("list", [v.name for v in var])
            elif var.op is None and var.name not in self.function.inputs:
                # A default for an optional input: a value without an op.
                inputs[name] = ("value", coerce(const_array(var), dtype_name(var), self.arith))
            else:
                inputs[name] = ("var", var.name)
        outputs = [(v.name, dtype_name(v), _static_shape(v)) for v in op.outputs]
        return _Step(op, KERNELS[op.op_type], inputs, outputs)

    def _plan_frees(self) -> None:
        last: dict[str, int] = {}
        for i, step in enumerate(self._steps):
            for kind, ref in step.inputs.values():
                for name in ref if kind == "list" else [ref] if kind == "var" else []:
                    last[name] = i
        keep = set(self.output_names) | set(self._constants)
        for name, i in last.items():
            if name not in keep:
                self._steps[i].free.append(name)

    # ----------------------------------------------------------------------------------
    # running

    def reseed(self, seed: int) -> None:
        """Draw the deviations' signs from ``seed`` from now on, with fresh counters (no
        effect under a profile without deviations)."""
        if self.profile.deviations:
            self.perturbation = Perturbation(self.profile.deviations, seed)

    def constant(self, name: str) -> Any:
        """A constant as an op reads it: decoded (``constexpr_*``) and stored under the
        profile."""
        return widen(self._constants[name])

    def constant_names(self) -> list[str]:
        """Names of every constant, decoded ``constexpr_*`` outputs included."""
        return list(self._constants)

    def var_names(self) -> list[str]:
        """Names of every value the function computes, in program order."""
        return [name for step in self._steps for name, _, _ in step.outputs]

    def result_bytes(self, capture: Iterable[str] = ()) -> int:
        """Bytes one run's outputs and ``capture`` values hold (fp32 or their integer type;
        values without a static shape count 0): what each input adds to `run_many`."""
        shapes = {name: (dtype, shape) for s in self._steps for name, dtype, shape in s.outputs}
        shapes.update(self.inputs)
        total = 0
        for name in {*self.output_names, *capture}:
            dtype, shape = shapes.get(name, ("fp32", None))
            if shape is not None:
                size = np.dtype(INT_TYPES.get(dtype, np.float32)).itemsize
                total += size * int(np.prod(shape, dtype=np.int64))
        return total

    def run(
        self,
        inputs: dict[str, np.ndarray],
        capture: Iterable[str] = (),
        states: dict[str, np.ndarray] | None = None,
    ) -> Evaluation:
        """Evaluate the function; ``capture`` names intermediate values to return as well.

        ``states`` holds the value of every state the function declares; the run replaces
        each with the state's value after the run (a state the function never writes keeps
        its value)."""
        return self.run_many([inputs], capture, [states])[0]

    def run_many(
        self,
        feeds: Sequence[dict[str, np.ndarray]],
        capture: Iterable[str] = (),
        states: Sequence[dict[str, np.ndarray] | None] | None = None,
    ) -> list[Evaluation]:
        """`run` on each of ``feeds`` (and its ``states``), op by op across them: each constant
        an op reads is made fp32 once for all of them instead of once per input (widening the
        packed fp16 weights was a sixth of SmolLM2's MIL parity step, run one batch at a
        time). Each input goes through the same kernels on the same values as alone, so each
        result has the bits of its own `run`; every input's live values exist at once."""
        wanted = set(capture)
        unknown = wanted - self._names
        if unknown:
            raise MILError(f"cannot capture {sorted(unknown)}: no such values in the function")
        given = list(states) if states is not None else [None] * len(feeds)
        runs = [
            self._begin(inputs, state, wanted) for inputs, state in zip(feeds, given, strict=True)
        ]
        try:
            with self._blas():
                for step in self._steps:
                    shared = self._constant_inputs(step)
                    for env, _, captured, non_finite in runs:
                        self._execute(step, env, shared)
                        for name, dtype, _ in step.outputs:
                            if name in wanted:
                                captured[name] = env[name]
                            if dtype in FLOAT_TYPES and not np.isfinite(env[name]).all():
                                non_finite.append(name)
                        for name in step.free:
                            env.pop(name, None)
        finally:
            # Held for one run only: several evaluators each keeping one for their lifetime
            # raised SmolLM2 KV's cache parity peak by 0.09 GiB.
            self._scratch = np.empty(0, np.float32)
        results = []
        for (env, slots, captured, non_finite), state in zip(runs, given, strict=True):
            if state is not None:
                for name, slot in slots.items():
                    state[name] = slot.value
            outputs = {name: widen(env[name]) for name in self.output_names}
            results.append(Evaluation(outputs, captured, non_finite))
        return results

    def _begin(
        self, inputs: dict[str, np.ndarray], states: dict[str, np.ndarray] | None, wanted: set[str]
    ) -> tuple[dict[str, Any], dict[str, StateSlot], dict[str, np.ndarray], list[str]]:
        """One run's environment (constants, states, inputs), its state slots, its captured
        inputs and its (empty) list of non-finite values."""
        env: dict[str, Any] = dict(self._constants)
        slots = self._state_slots(states or {})
        env.update(slots)
        for name, (dtype, shape) in self.inputs.items():
            if name not in inputs:
                raise MILError(f"missing input {name!r}")
            value = np.asarray(inputs[name])
            if shape is not None and value.shape != shape:
                raise MILError(f"input {name!r}: shape {value.shape}, expected {shape}")
            if dtype == "fp16" and self.profile.fp16_inputs:
                value = round_fp16(value.astype(np.float32))  # the runtime receives fp16
            env[name] = coerce(value, dtype, self.arith)
        extra = set(inputs) - set(self.inputs)
        if extra:
            raise MILError(f"unknown inputs {sorted(extra)}; expected {sorted(self.inputs)}")
        captured: dict[str, np.ndarray] = {n: env[n] for n in wanted if n in self.inputs}
        return env, slots, captured, []

    def _constant_inputs(self, step: _Step) -> dict[str, Any]:
        """The constants ``step`` reads, by name, as ops read them (`widen`; into the reused
        buffer for an input the kernel borrows, `_borrowed`)."""
        values: dict[str, Any] = {}
        for name, (kind, ref) in step.inputs.items():
            for n in ref if kind == "list" else [ref] if kind == "var" else []:
                if n in self._constants:
                    borrowed = name in step.spec.borrows
                    value = self._constants[n]
                    values[n] = self._borrowed(value) if borrowed else widen(value)
        return values

    def _borrowed(self, value: Any) -> Any:
        """A packed fp16 constant widened into this evaluator's one reused fp32 buffer (valid
        until the next op's): a new fp32 array per op and run made the kernel's memory fresh
        every time, and widening SmolLM2's weights was a quarter of its cache parity (py-spy).
        The same values as `widen`, so the same bits from the kernel; anything else as is."""
        if not isinstance(value, np.ndarray) or value.dtype != np.float16:
            return value
        if self._scratch.size < value.size:
            self._scratch = np.empty(value.size, np.float32)
        out = self._scratch[: value.size].reshape(value.shape)
        widen_fp16(value, out=out)
        return out

    def _state_slots(self, states: dict[str, np.ndarray]) -> dict[str, StateSlot]:
        slots = {}
        for name, (dtype, shape) in self.states.items():
            if name not in states:
                raise MILError(f"missing state {name!r} (shape {shape}, {dtype})")
            value = np.asarray(states[name])
            if shape is not None and value.shape != shape:
                raise MILError(f"state {name!r}: shape {value.shape}, expected {shape}")
            if dtype == "fp16" and not self.profile.fp16_storage and self.profile.fp16_inputs:
                value = round_fp16(value.astype(np.float32))  # the runtime holds fp16
            # (under fp16 storage ``coerce`` rounds it, once)
            slots[name] = StateSlot(name, coerce(value, dtype, self.arith))
        extra = set(states) - set(self.states)
        if extra:
            raise MILError(f"unknown states {sorted(extra)}; expected {sorted(self.states)}")
        return slots

    def _execute(
        self, step: _Step, env: dict[str, Any], shared: dict[str, Any] | None = None
    ) -> None:
        """Run ``step`` on ``env``; ``shared``: values of some of its inputs as ops read them
        (`_constant_inputs`), used instead of reading them from ``env``."""
        op = step.op
        read = shared or {}
        values: dict[str, Any] = {}
        for name, (kind, ref) in step.inputs.items():
            if kind == "var":
                values[name] = read[ref] if ref in read else widen(env[ref])
            elif kind == "list":
                values[name] = [read[r] if r in read else widen(env[r]) for r in ref]
            else:
                values[name] = ref
        try:
            call = Call(op, values, self.arith)
            result = step.spec.fn(call)
        except MILError:
            raise
        except Exception as e:  # a kernel bug or a value the kernel rejects: name the op
            raise OpEvaluationError(op.op_type, op.name, f"{type(e).__name__}: {e}") from e
        results: Sequence[Any] = result if isinstance(result, list | tuple) else [result]
        if len(results) != len(step.outputs):
            raise OpEvaluationError(
                op.op_type, op.name, f"{len(results)} results for {len(step.outputs)} outputs"
            )
        perturb = self.perturbation
        for (name, dtype, shape), value in zip(step.outputs, results, strict=True):
            # The one place a profile's deviations reach a result: after the kernel, before
            # the profile stores it (so a deviation is rounded like any result).
            exact = step.spec.exact or call.exact
            if perturb is not None and dtype in FLOAT_TYPES and perturb.applies_to(op.op_type):
                value = perturb.apply(op, values, np.asarray(value, dtype=np.float32))
                exact = step.spec.exact
            if exact and dtype in FLOAT_TYPES:
                value = np.asarray(value, dtype=np.float32)  # stored values, moved: no rounding
            else:
                value = coerce(value, dtype, self.arith)
            if shape is not None and np.shape(value) != shape:
                raise OpEvaluationError(
                    op.op_type,
                    op.name,
                    f"output {name!r} has shape {np.shape(value)}, the program declares {shape}",
                )
            env[name] = value


def evaluate(
    program: Any,
    inputs: dict[str, np.ndarray],
    profile: Profile | str = "fp32",
    function: str = "main",
    capture: Iterable[str] = (),
) -> Evaluation:
    """Prepare and run one function once (use ``Evaluator`` to run several inputs).

    BLAS runs single-threaded inside the evaluator (``Evaluator(threads=...)`` changes it).
    """
    return Evaluator(program, profile, function).run(inputs, capture)
