"""Size report of a variant: bytes of the weights it compresses and of the whole package.

Storage ratios only: a 4x smaller weight file is not a 4x faster call (SPEC section 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from converter.compression.records import WeightRecord


def package_bytes(package: Path) -> int:
    """Total bytes of every file in an ``.mlpackage`` directory."""
    return sum(p.stat().st_size for p in package.rglob("*") if p.is_file())


@dataclass(frozen=True)
class SizeReport:
    """Bytes before and after, as ratios to fp16, and bits per weight."""

    compressed_weights: int  # how many weight tensors the variant compresses
    kept_fp16_weights: int
    compressed_fp16_bytes: int  # those weights in fp16
    compressed_stored_bytes: int  # what the variant stores for them (indices, tables, scales)
    compressed_ratio: float
    compressed_bits_per_weight: float
    all_weights_fp16_bytes: int  # every weight constant of the program in fp16
    all_weights_stored_bytes: int
    all_weights_bits_per_weight: float
    package_fp16_bytes: int  # the fp16 artifact's .mlpackage on disk
    package_bytes: int
    package_ratio: float
    note: str = "storage ratios, not latency ratios"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data."""
        return asdict(self)

    def to_text(self) -> str:
        """Two readable lines."""
        return (
            f"compressed weights: {self.compressed_weights} tensors, "
            f"{self.compressed_fp16_bytes / 2**20:.1f} MiB fp16 -> "
            f"{self.compressed_stored_bytes / 2**20:.1f} MiB ({self.compressed_ratio:.3f}x, "
            f"{self.compressed_bits_per_weight:.2f} bits/weight); "
            f"{self.kept_fp16_weights} kept fp16\n"
            f"package: {self.package_fp16_bytes / 2**20:.1f} MiB -> "
            f"{self.package_bytes / 2**20:.1f} MiB ({self.package_ratio:.3f}x); all weights "
            f"{self.all_weights_bits_per_weight:.2f} bits/weight ({self.note})"
        )


def _total(packages: Path | list[Path]) -> int:
    return sum(map(package_bytes, packages if isinstance(packages, list) else [packages]))


def size_report(
    records: list[WeightRecord], fp16_package: Path | list[Path], package: Path | list[Path]
) -> SizeReport:
    """The size report of a variant whose records are ``records`` (packages: one, or the
    chunk packages of a chunked cached decoder, counted together)."""
    compressed = [r for r in records if r.method != "fp16"]
    c_fp16 = sum(r.fp16_bytes for r in compressed)
    c_stored = sum(r.stored_bytes for r in compressed)
    c_values = c_fp16 // 2
    a_fp16 = sum(r.fp16_bytes for r in records)
    a_stored = sum(r.stored_bytes for r in records)
    base, now = _total(fp16_package), _total(package)
    return SizeReport(
        compressed_weights=len(compressed),
        kept_fp16_weights=len(records) - len(compressed),
        compressed_fp16_bytes=c_fp16,
        compressed_stored_bytes=c_stored,
        compressed_ratio=c_stored / c_fp16 if c_fp16 else 1.0,
        compressed_bits_per_weight=c_stored * 8 / c_values if c_values else 16.0,
        all_weights_fp16_bytes=a_fp16,
        all_weights_stored_bytes=a_stored,
        all_weights_bits_per_weight=a_stored * 8 / (a_fp16 // 2) if a_fp16 else 16.0,
        package_fp16_bytes=base,
        package_bytes=now,
        package_ratio=now / base if base else 1.0,
    )
