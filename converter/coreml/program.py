"""Trace a torch module and convert it to a Core ML ML Program (coremltools).

Works on Linux: conversion and saving need no macOS. ``skip_model_load`` keeps coremltools
from trying to compile the model, which only macOS can do.

``save_package`` is the one place a package is written: coremltools serializes the model spec
with protobuf maps in an order that varies between processes (two conversions of one recipe
differed in 50,039 of 723,098 bytes of SmolLM2's ``model.mlmodel``) and stamps the day into
its metadata, so the spec is rewritten canonically and the date moved to ``convert.log``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from converter.coreml.fast_paths import (
    fp16_checks_without_copies,
    same_arrays_compared_once,
    validated_once,
)
from converter.pipeline.runlog import warnings_to_log
from parity.memory import release_memory

log = logging.getLogger(__name__)

# coremltools writes the day of the conversion here; it is logged instead (save_package).
CONVERSION_DATE_KEY = "com.github.apple.coremltools.conversion_date"
SPEC_FILE = Path("Data") / "com.apple.CoreML" / "model.mlmodel"

DType = Literal["float16", "float32", "int32"]
_NP = {"float16": np.float16, "float32": np.float32, "int32": np.int32}
_TORCH = {"float16": torch.float16, "float32": torch.float32, "int32": torch.int32}


@dataclass(frozen=True)
class TensorIO:
    """One model input or output as the runtime sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    meaning: str

    def example(self) -> torch.Tensor:
        """A zero tensor of this shape for tracing (fp32 for float inputs: torch runs fp32)."""
        dtype = torch.int64 if self.dtype == "int32" else torch.float32
        return torch.zeros(self.shape, dtype=dtype)


def trace(module: torch.nn.Module, inputs: Sequence[TensorIO]) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` the module in eval mode on zero inputs of the declared shapes."""
    module = module.eval()
    examples = tuple(spec.example() for spec in inputs)
    # TracerWarnings (a tensor read as a Python value) are expected here: the shapes are
    # static. They and anything else go to convert.log, not the terminal.
    with torch.no_grad(), warnings_to_log("torch.jit.trace"):
        return torch.jit.trace(module, examples, check_trace=False)


def to_mlprogram(
    traced: torch.jit.ScriptModule,
    inputs: Sequence[TensorIO],
    outputs: Sequence[TensorIO],
    target: Any,
    precision: Literal["float16", "float32"],
    states: Sequence[TensorIO] = (),
) -> Any:
    """Convert a traced module to an ML Program; returns a ``ct.models.MLModel`` (not loaded).

    ``states`` name registered buffers that become Core ML states (``ct.StateType``, macOS 15
    / iOS 18). anec's own passes (`converter.coreml.mil_passes`) run after coremltools' defaults,
    and ``REPLACED_PASSES`` stand in for coremltools passes whose names were not reproducible.
    """
    import coremltools as ct

    from converter.coreml.mil_passes import FOLD_WHOLE_SLICE_UPDATE, REPLACED_PASSES

    compute_precision = ct.precision.FLOAT16 if precision == "float16" else ct.precision.FLOAT32
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.passes = [REPLACED_PASSES.get(name, name) for name in pipeline.passes]
    pipeline.append_pass(FOLD_WHOLE_SLICE_UPDATE)
    state_types = [
        ct.StateType(wrapped_type=ct.TensorType(shape=s.shape, dtype=_NP[s.dtype]), name=s.name)
        for s in states
    ]
    _restart_mil_names()
    with (
        warnings_to_log("ct.convert"),
        validated_once(),
        _activations_as_spelled(),
        fp16_checks_without_copies(),
    ):
        return ct.convert(
            traced,
            inputs=[ct.TensorType(name=i.name, shape=i.shape, dtype=_NP[i.dtype]) for i in inputs],
            outputs=[ct.TensorType(name=o.name, dtype=_NP[o.dtype]) for o in outputs],
            states=state_types or None,
            convert_to="mlprogram",
            compute_precision=compute_precision,
            minimum_deployment_target=target,
            skip_model_load=True,
            pass_pipeline=pipeline,
        )


# coremltools' ML Program backend folds mul(x, sigmoid(x)) into one silu op; it cannot be
# left out through ``pass_pipeline``, which only reaches the main pipeline's passes.
_SILU_FUSION = "mil_backend::fuse_activation_silu"


@contextlib.contextmanager
def _activations_as_spelled() -> Iterator[None]:
    """Keep each activation as the torch module spells it: without this a module that asks
    for ``x * sigmoid(x)`` (recipe silu_form: mul-sigmoid) would get a silu op back. A module
    that spells ``silu`` gets one silu op from the torch frontend either way."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline

    table = PassPipeline._PIPELINE_NAME_TO_PASSES
    backend = table["backend_mlprogram"]
    table["backend_mlprogram"] = [p for p in backend if p != _SILU_FUSION]
    try:
        yield
    finally:
        table["backend_mlprogram"] = backend


def _restart_mil_names() -> None:
    """Start coremltools' generated op and block names from 0 for a new program.

    coremltools numbers generated names (``transpose_90``, ``tile_0``, ``block3``) with
    class-level counters that live as long as the process, so a program's bytes depended on
    what was converted before it in the same process (measured on SmolLM2: ``transpose_91``
    in a test session against ``transpose_90`` in a fresh process). Each program is built from
    scratch, so restarting the numbering cannot collide with a name inside it.
    """
    from coremltools.converters.mil.mil import Block, Builder
    from coremltools.converters.mil.mil.program import Placeholder

    Builder.name_count.clear()
    Block.counter = 0
    Placeholder.counter = 0


def save_package(mlmodel: Any, package: Path) -> Path:
    """Save ``mlmodel`` as ``package`` (an ``.mlpackage``), canonically; returns its path.

    The same program gives the same ``model.mlmodel`` bytes in every process and on every
    day (so the content hash in the manifest is reproducible); the weights file is
    deterministic already. The package's own ``Manifest.json`` keeps coremltools' fresh
    UUIDs and is outside the content hash.

    The temporary package ``ct.convert`` wrote is moved, not copied as ``MLModel.save`` does
    (2.5 s for SmolLM2's weights on this machine), and its spec replaced by the model's own,
    which holds the metadata set after the package was written, as ``save`` writes it;
    ``mlmodel`` then refers to ``package``.
    """
    source = Path(mlmodel.package_path) if mlmodel.is_package else None
    if source is not None and mlmodel.is_temp_package and not package.exists():
        shutil.move(source, package)  # a rename where both are on one filesystem
        mlmodel.package_path, mlmodel.is_temp_package = str(package), False
    else:
        mlmodel.save(str(package))
    canonicalize_spec(package, mlmodel.get_spec())
    return package


def combine_functions(packages: dict[str, Path], package: Path, default: str) -> Path:
    """One multifunction package from single-function ones (function name -> package whose
    ``main`` it becomes), saved as ``package``; coremltools stores a weight blob that several
    functions hold byte for byte once (``ct.utils.save_multifunction``)."""
    import coremltools as ct

    from parity.mil.program import loads_sharing_equal_constants

    descriptor = ct.utils.MultiFunctionDescriptor()
    for name, path in packages.items():
        descriptor.add_function(str(path), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = default
    with (
        warnings_to_log("ct.utils.save_multifunction"),
        loads_sharing_equal_constants(),
        validated_once(),  # half of the combine's time went to validating after every pass
        same_arrays_compared_once(),
    ):
        ct.utils.save_multifunction(descriptor, str(package))
    release_memory()  # the loaded programs are cyclic garbage: gone only when collected
    canonicalize_spec(package)
    return package


def canonicalize_spec(package: Path, spec: Any = None) -> None:
    """Rewrite the package's model spec (or write ``spec`` there) with deterministic protobuf
    serialization (map entries sorted by key) and without coremltools' conversion date."""
    from coremltools.proto import Model_pb2

    spec_file = package / SPEC_FILE
    if spec is None:
        spec = Model_pb2.Model()
        spec.ParseFromString(spec_file.read_bytes())
    metadata = spec.description.metadata.userDefined
    if CONVERSION_DATE_KEY in metadata:
        log.info(
            "%s: coremltools conversion date %s (left out of the package: it would make "
            "the package differ between days)",
            package.name,
            metadata[CONVERSION_DATE_KEY],
        )
        del metadata[CONVERSION_DATE_KEY]
    spec_file.write_bytes(spec.SerializeToString(deterministic=True))


def function_ops(function: Any) -> dict[str, int]:
    """Live op counts of one MIL function (constants excluded), by op type in order: what a
    manifest records of a package's function."""
    counts = collections.Counter(op.op_type for op in function.operations if op.op_type != "const")
    return dict(sorted(counts.items()))


def live_ops(mlmodel: Any) -> collections.Counter[str]:
    """Op types of every function in the program, constants excluded."""
    counts: collections.Counter[str] = collections.Counter()
    for function in mlmodel._mil_program.functions.values():
        counts.update(function_ops(function))
    return counts
