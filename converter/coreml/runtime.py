"""Where anec runs Core ML: one function of a package loaded as a model, and what the Mac
reports about memory while it is loaded.

Everything that calls Core ML goes through a `ModelLoader`: `coreml_loader` on macOS, a
stand-in with the same shape in the tests (``predict(data, state=None)`` and ``make_state()``,
as coremltools' ``MLModel``), so that on a Mac only Core ML itself is new code.

MACOS ONLY, NEVER RUN HERE: `coreml_loader` and `memory_now` need macOS; anec is developed on
Linux, where Core ML cannot run a model. `parse_vm_stat` is tested on recorded-format text.

State shared by the functions of one package (``cache.style: state``): the host makes one
state with ``make_state()`` of the decode function's model and passes it to every function's
``predict``. coremltools' own guides do not say that a state made by one function's model may
be used with another function of the same package (docs-guides ``stateful-models.md`` shows
one function; ``multifunction-models.md`` has no state); an open coremltools pull request, a
guide for prefill/decode multifunction LLMs (apple/coremltools#2686, 2026-05), shares one
``make_state()`` between ``prefill.predict()`` and ``decode.predict()``. The choice is
UNVERIFIED until `anec device-check` has run on a Mac: its cache gates run prefill, decode and
extend on that one state first (`STATE_SHARING`).
"""

from __future__ import annotations

import ctypes
import platform
import re
import subprocess
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Core ML's compute-unit settings, as coremltools names them (ct.ComputeUnit).
UNITS = ("CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE", "ALL")
STATE_SHARING = (
    "one make_state() of the decode function's model, passed to every function of the "
    "package; not stated by coremltools' docs (apple/coremltools#2686 does it): unverified "
    "until the cache gates pass on a Mac"
)


class CoreMLModel(Protocol):
    """The part of coremltools' ``MLModel`` anec calls."""

    def predict(self, data: dict[str, np.ndarray], state: Any = None) -> dict[str, Any]:
        """Outputs by name for named inputs (``state``: a stateful function's ``MLState``)."""
        ...

    def make_state(self) -> Any:
        """A fresh (zero) state of the model's state tensors."""
        ...


class StateView(MutableMapping[str, np.ndarray]):
    """The tensors of an ``MLState`` (``state()`` gives it) by name, read and written whole
    through its ``read_state`` / ``write_state`` (coremltools 8+): the host loop's stale-row
    check writes into the cache this way."""

    def __init__(self, state: Callable[[], Any], names: list[str]) -> None:
        self.state, self.names = state, names

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.state().read_state(name))

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self.state().write_state(name, np.asarray(value, dtype=np.float16))

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"{name}: a Core ML state's tensors cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class StateRelay:
    """The cache of a per-function layout (one package per function, one state each): before
    a call to another package, the state of the package called last is copied into its state
    (``read_state`` / ``write_state``), so the cache follows the calls."""

    def __init__(self, states: dict[str, Any], name: str, first: str) -> None:
        self.states, self.name, self.current = states, name, first

    def state_for(self, function: str) -> Any:
        """``function``'s state, holding the cache as the last call left it."""
        if function != self.current:
            value = self.states[self.current].read_state(self.name)
            self.states[function].write_state(self.name, value)
            self.current = function
        return self.states[function]

    def view(self) -> StateView:
        """The cache as the state of the package called last holds it."""
        return StateView(lambda: self.states[self.current], [self.name])


class ModelLoader(Protocol):
    """Loads ``function`` of ``package`` with compute units ``units`` (one of `UNITS`)."""

    def __call__(self, package: Path, function: str, units: str) -> CoreMLModel: ...


def coreml_loader(package: Path, function: str, units: str) -> CoreMLModel:  # pragma: no cover
    """Core ML's own model of one function (macOS only; NEVER RUN HERE)."""
    import coremltools as ct

    model: CoreMLModel = ct.models.MLModel(
        str(package), function_name=function, compute_units=ct.ComputeUnit[units]
    )
    return model


@dataclass(frozen=True)
class MemoryReading:
    """This process's physical footprint and the system's wired memory, in bytes."""

    footprint: int
    wired: int


class MemoryProbe(Protocol):
    """Reads memory now (`memory_now` on macOS; a stand-in in the tests)."""

    def __call__(self) -> MemoryReading: ...


_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_WIRED = re.compile(r"^Pages wired down:\s+(\d+)\.?\s*$", re.MULTILINE)


def parse_vm_stat(text: str) -> int:
    """Wired bytes from ``vm_stat`` output (its page size times "Pages wired down")."""
    size, wired = _PAGE_SIZE.search(text), _WIRED.search(text)
    if size is None or wired is None:
        raise ValueError("vm_stat output without its page size or 'Pages wired down'")
    return int(size.group(1)) * int(wired.group(1))


class _RusageInfoV2(ctypes.Structure):
    # <sys/resource.h> rusage_info_v2, up to ri_phys_footprint (the fields after it unused)
    _fields_ = [
        ("ri_uuid", ctypes.c_uint8 * 16),
        *((name, ctypes.c_uint64) for name in (
            "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups",
            "ri_pageins", "ri_wired_size", "ri_resident_size", "ri_phys_footprint",
            "ri_proc_start_abstime", "ri_proc_exit_abstime", "ri_child_user_time",
            "ri_child_system_time", "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups",
            "ri_child_pageins", "ri_child_elapsed_abstime", "ri_diskio_bytesread",
            "ri_diskio_byteswritten",
        )),
    ]  # fmt: skip


def memory_now() -> MemoryReading:  # pragma: no cover - macOS only, NEVER RUN HERE
    """This process's ``ri_phys_footprint`` (libproc's ``proc_pid_rusage``, what Activity
    Monitor calls Memory) and the system's wired memory (``vm_stat``)."""
    import os

    if platform.system() != "Darwin":
        raise OSError("memory_now reads macOS's process and VM statistics")
    libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
    info = _RusageInfoV2()
    if libproc.proc_pid_rusage(os.getpid(), 2, ctypes.byref(info)) != 0:  # RUSAGE_INFO_V2
        raise OSError("proc_pid_rusage failed")
    text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
    return MemoryReading(int(info.ri_phys_footprint), parse_vm_stat(text))
