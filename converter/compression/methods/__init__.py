"""Compression methods, one module each, registered by the name a recipe's ``method:`` uses.

Every module here but ``base`` defines ``METHOD``, an instance of
`base.CompressionMethod`; it is found by name at import, so adding a method is adding one
file. Everything else asks the registry (the functions below) what a method is and does:
no other module names one. ``names()`` is the order recipes list them in (each method's
``order``: storing methods first, as they apply).
"""

from __future__ import annotations

import importlib
import pkgutil

from converter.compression.methods.base import CompressionMethod


def discover(path: list[str], package: str) -> dict[str, CompressionMethod]:
    """Every ``METHOD`` of the modules in ``path`` (the package ``package``) but ``base``."""
    found: dict[str, CompressionMethod] = {}
    for info in pkgutil.iter_modules(path):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        method = getattr(module, "METHOD", None)
        if not isinstance(method, CompressionMethod):
            raise TypeError(f"{module.__name__}: expected METHOD, a CompressionMethod")
        if method.name in found:
            raise TypeError(f"{module.__name__}: method {method.name!r} registered twice")
        found[method.name] = method
    return ranked(found)


def ranked(found: dict[str, CompressionMethod]) -> dict[str, CompressionMethod]:
    """``found`` in listing and applying order: each method's ``order``, then by name."""
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))


METHODS = discover(__path__, __name__)


def names() -> tuple[str, ...]:
    """Every registered method name."""
    return tuple(METHODS)


def get(name: str) -> CompressionMethod:
    """The method registered as ``name``."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(
            f"no compression method {name!r}; registered: {', '.join(METHODS)}"
        ) from None


def owners(field: str) -> list[str]:
    """The methods that accept the optional variant field ``field``."""
    return [n for n, m in METHODS.items() if field in m.fields]


def optional_fields() -> list[str]:
    """Variant fields only some methods accept."""
    return sorted({f for m in METHODS.values() for f in m.fields})


def calibrated() -> tuple[str, ...]:
    """The methods that read ``compression.calibration``."""
    return tuple(n for n, m in METHODS.items() if m.needs_calibration)


def kv_methods() -> tuple[str, ...]:
    """The methods a cached decoder's variants may use (``kv_cache``)."""
    return tuple(n for n, m in METHODS.items() if m.kv_cache)


def search_methods() -> tuple[str, ...]:
    """The methods the mixed search may choose per weight (``searchable``)."""
    return tuple(n for n, m in METHODS.items() if m.searchable)
