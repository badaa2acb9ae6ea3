"""What a checkpoint's weight files hold, read from their headers without loading any tensor.

Two jobs, both about the weight files agreeing with what they claim:

* ``read_weight_table`` parses a safetensors or GGUF header and checks that every tensor's
  bytes lie inside the file, so a truncated or corrupt file is refused before any work, with
  the file and the tensor named;
* ``check_loading_info`` reads transformers' loading report and refuses a checkpoint whose
  config and weights disagree. transformers itself only warns about a missing tensor and
  initialises it at random: the converted model would then be a random model that passes
  every parity gate, because the reference is the same random model.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from converter.errors import InputError

# safetensors refuses headers above 100 MB; a larger length field means a corrupt file.
_MAX_SAFETENSORS_HEADER = 100_000_000
_SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "F4": 4,
}
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: fixed-size scalars by type id (8 = string, 9 = array).
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_MAX_LISTED = 5  # tensors named per kind of disagreement; the rest are counted


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file's header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int | None = None  # GGUF: where the tensor's data starts in the file

    @property
    def n_elements(self) -> int:
        """The number of values (1 for a scalar)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightTable:
    """The tensors of one weight file, and what its header says about the model."""

    file: Path
    format: Literal["safetensors", "gguf"]
    tensors: dict[str, TensorInfo]
    architecture: str | None = None  # GGUF `general.architecture`

    @property
    def n_parameters(self) -> int:
        """The number of values over all tensors."""
        return sum(t.n_elements for t in self.tensors.values())


def read_weight_table(path: Path) -> WeightTable | None:
    """Read and verify the header of a ``.safetensors`` or ``.gguf`` file.

    Returns None for other files (pickle checkpoints have no header to check without
    unpickling). Raises InputError naming the file, and the tensor where one is at fault.
    """
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix == ".gguf":
        return read_gguf(path)
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def read_safetensors(path: Path) -> WeightTable:
    """Parse a safetensors header and check every tensor's bytes against the file size."""
    size = _size(path)
    if size < 8:
        raise InputError(f"{path}: truncated safetensors file: {size} bytes, no header")
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(_MAX_SAFETENSORS_HEADER, size - 8):
                raise InputError(
                    f"{path}: truncated or corrupt safetensors file: the header claims "
                    f"{header_len} bytes, the file has {size} bytes"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (expected a JSON object)")

    data_size = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    end_max = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, begin, end = _safetensors_entry(path, name, entry)
        if end > data_size:
            raise InputError(
                f"{path}: truncated: tensor {name} needs data bytes {begin}..{end}, the file "
                f"holds {data_size} bytes of data"
            )
        tensors[name] = info
        end_max = max(end_max, end)
    if end_max != data_size:
        raise InputError(
            f"{path}: corrupt: {data_size - end_max} bytes after the last tensor's data "
            "(the header does not describe the whole file)"
        )
    return WeightTable(path, "safetensors", tensors)


def _safetensors_entry(path: Path, name: str, entry: Any) -> tuple[TensorInfo, int, int]:
    where = f"{path}: corrupt safetensors header: tensor {name}"
    if not isinstance(entry, dict):
        raise InputError(f"{where}: expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    bits = _SAFETENSORS_DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise InputError(f"{where}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise InputError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise InputError(f"{where}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
    begin, end = offsets
    nbytes = math.prod(shape) * bits // 8
    if end - begin != nbytes:
        raise InputError(
            f"{where}: data_offsets cover {end - begin} bytes, dtype {dtype} and shape "
            f"{shape} need {nbytes}"
        )
    return TensorInfo(name, tuple(shape), str(dtype), nbytes), begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _GGUFCursor:
    """Little-endian reads from a memory-mapped GGUF file; running off the end is an error."""

    def __init__(self, buffer: Any, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buffer):
            raise InputError(
                f"{self.path}: truncated GGUF header: the file ends at byte {len(self.buffer)} "
                f"while reading byte {self.pos}"
            )
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> bytes:
        length = self.unpack("Q")
        if self.pos + length > len(self.buffer):
            raise InputError(
                f"{self.path}: truncated or corrupt GGUF header: a {length}-byte string at byte "
                f"{self.pos} runs past the end of the file ({len(self.buffer)} bytes)"
            )
        value = bytes(self.buffer[self.pos : self.pos + length])
        self.pos += length
        return value

    def value(self, kind: int) -> Any:
        """Read one metadata value; arrays of numbers are skipped, not decoded (None)."""
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind == _GGUF_ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _GGUF_SCALARS:
                # Token scores and types: tens of thousands of numbers, never needed here.
                skip = struct.calcsize("<" + _GGUF_SCALARS[item]) * count
                if self.pos + skip > len(self.buffer):
                    raise InputError(
                        f"{self.path}: truncated GGUF header: an array of {count} values at "
                        f"byte {self.pos} runs past the end of the file"
                    )
                self.pos += skip
                return None
            for _ in range(count):
                self.value(item)
            return None
        raise InputError(f"{self.path}: corrupt GGUF header: unknown value type {kind}")


@contextmanager
def _mapped_gguf(path: Path) -> Iterator[tuple[_GGUFCursor, int, int]]:
    """``path`` memory-mapped with its magic and version checked: a cursor just after the
    header's counts, the number of tensors and the number of metadata fields."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _GGUFCursor(buffer, path)
            if buffer[:4] != _GGUF_MAGIC:
                raise InputError(
                    f"{path}: not a GGUF file (it starts with {bytes(buffer[:4])!r}, "
                    f"expected {_GGUF_MAGIC!r})"
                )
            cursor.pos = 4
            version = cursor.unpack("I")
            if version not in _GGUF_VERSIONS:
                raise InputError(
                    f"{path}: corrupt or unsupported GGUF file: version {version}, "
                    f"expected one of {_GGUF_VERSIONS}"
                )
            n_tensors, n_fields = cursor.unpack("Q"), cursor.unpack("Q")
            yield cursor, n_tensors, n_fields
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:  # mmap of an unmappable file
        raise InputError(f"{path}: cannot read: {e}") from None


def _gguf_fields(cursor: _GGUFCursor, n_fields: int) -> Iterator[tuple[bytes, Any]]:
    """Each metadata field's key and value (``_GGUFCursor.value``), in file order."""
    for _ in range(n_fields):
        key = cursor.string()
        yield key, cursor.value(cursor.unpack("I"))


def read_gguf_metadata(path: Path, keys: Collection[str]) -> dict[str, Any]:
    """The values of those metadata ``keys`` the GGUF file has: strings decoded, arrays None.

    Reads only as far as the last key asked for (``general.*`` keys come before the
    vocabulary): SmolLM2's licence in 0.07 ms, where ``gguf.GGUFReader`` decodes the whole
    file first (3-4 s on a busy 2-core machine, measured). Raises InputError naming the file
    when the header is not GGUF.
    """
    wanted = {key.encode(): key for key in keys}
    found: dict[str, Any] = {}
    if not wanted:
        return found
    with _mapped_gguf(path) as (cursor, _, n_fields):
        for key, value in _gguf_fields(cursor, n_fields):
            if key in wanted:
                text = isinstance(value, bytes)
                found[wanted[key]] = value.decode("utf-8", errors="replace") if text else value
                if len(found) == len(wanted):
                    break
    return found


def read_gguf(path: Path) -> WeightTable:
    """Parse a GGUF header (metadata and tensor table) and check the tensor data fits the file.

    A small parser of its own: ``gguf.GGUFReader`` decodes every metadata array (15 s for
    SmolLM2's vocabulary on a busy 2-core machine, measured) and fails on truncated files
    with numpy reshape errors that name neither the file nor the tensor.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = _size(path)
    if size == 0:
        raise InputError(f"{path}: empty file, expected a GGUF checkpoint")
    with _mapped_gguf(path) as (cursor, n_tensors, n_fields):
        architecture, alignment = None, _GGUF_DEFAULT_ALIGNMENT
        for key, value in _gguf_fields(cursor, n_fields):
            if key == b"general.architecture" and isinstance(value, bytes):
                architecture = value.decode("utf-8", errors="replace")
            elif key == b"general.alignment" and isinstance(value, int):
                alignment = value
        entries = []
        for _ in range(n_tensors):
            name = cursor.string().decode("utf-8", errors="replace")
            n_dims = cursor.unpack("I")
            if n_dims > 8:
                raise InputError(f"{path}: corrupt GGUF header: tensor {name} has {n_dims} dims")
            dims = tuple(cursor.unpack("Q") for _ in range(n_dims))
            entries.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
        header_end = cursor.pos

    if alignment <= 0 or alignment & (alignment - 1):
        raise InputError(f"{path}: corrupt GGUF header: alignment {alignment}")
    data_start = -(-header_end // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, kind, offset in entries:
        try:
            qtype = GGMLQuantizationType(kind)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise InputError(f"{path}: tensor {name}: unknown GGML type {kind}") from None
        count = math.prod(dims)
        nbytes = count // block * block_bytes
        end = data_start + offset + nbytes
        if end > size:
            raise InputError(
                f"{path}: truncated: tensor {name} needs bytes up to {end}, the file has {size}"
            )
        # GGUF stores dims fastest-varying first; report them the way torch shapes read.
        tensors[name] = TensorInfo(
            name, tuple(reversed(dims)), qtype.name, nbytes, data_start + offset
        )
    return WeightTable(path, "gguf", tensors, architecture)


def read_weight_tables(files: Iterable[Path]) -> list[WeightTable]:
    """The verified tables of every file that has a header (see ``read_weight_table``)."""
    tables = [read_weight_table(f) for f in files]
    return [t for t in tables if t is not None]


def _names(keys: Iterable[Any]) -> str:
    keys = sorted(keys, key=str)
    shown = ", ".join(str(k) for k in keys[:_MAX_LISTED])
    more = len(keys) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def check_loading_info(
    info: Mapping[str, Any], where: Path, unused_heads_ok: bool = False
) -> list[str]:
    """Refuse a checkpoint whose weights do not match its config, listing every disagreement.

    ``info`` is what ``from_pretrained(..., output_loading_info=True)`` returns: the tensors
    the config needs but the file lacks, those the file has but the config has no place for,
    and ``(name, shape in the file, shape the config expects)`` for wrong shapes. With
    ``unused_heads_ok`` (an encoder task that reads the base model only, e.g. the hidden
    states of a classifier checkpoint) extra tensors are not an error: their names are
    returned so the caller records them.
    """
    problems = []
    missing = list(info.get("missing_keys") or ())
    unexpected = list(info.get("unexpected_keys") or ())
    unused = sorted(unexpected) if unused_heads_ok else []
    if unused_heads_ok:
        unexpected = []
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    if missing:
        problems.append(f"missing tensor(s) the config needs: {_names(missing)}")
    if unexpected:
        problems.append(f"extra tensor(s) the config has no place for: {_names(unexpected)}")
    for name, got, expected in mismatched[:_MAX_LISTED]:
        problems.append(
            f"tensor {name} has shape {list(got)} in the file, the config expects {list(expected)}"
        )
    if len(mismatched) > _MAX_LISTED:
        problems.append(f"{len(mismatched) - _MAX_LISTED} more tensors with wrong shapes")
    errors = list(info.get("error_msgs") or ())
    if errors:
        problems.append(f"load errors: {'; '.join(str(e) for e in errors[:_MAX_LISTED])}")
    if problems:
        raise InputError(f"{where}: the config and the weights disagree: " + "; ".join(problems))
    return unused
