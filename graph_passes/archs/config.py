"""Reading a transformers config object for the architecture files: values, refusals by key.

A config feature anec does not implement is an `InputError` naming the config key, never a
silently different model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graph_passes.errors import InputError
from graph_passes.spec import RopeScaling

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` or ``default``; transformers configs are attribute bags."""
    return getattr(config, key, default)


def require(config: object, key: str, expected: object, why: str) -> None:
    """Fail naming ``key`` unless the config's effective value equals ``expected``."""
    value = config_value(config, key, expected)
    if value != expected:
        raise InputError(f"config.{key} = {value!r}: {why}; only {expected!r} is implemented")


def refuse_set(config: object, key: str, why: str) -> None:
    """Fail naming ``key`` when the config sets it (to anything but None / False / 0)."""
    value = config_value(config, key)
    if value:
        raise InputError(f"config.{key} = {value!r}: {why} is not implemented")


def rope_parameters(params: Mapping[str, Any], where: str) -> float:
    """RoPE theta of one ``rope_parameters`` entry; refuses any RoPE scaling by its key."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InputError(
            f"config.{where}.rope_type = {rope_type!r}: RoPE scaling is not implemented; "
            "only 'default' RoPE is supported"
        )
    if "rope_theta" not in params:
        raise InputError(f"config.{where}: no 'rope_theta' given")
    return float(params["rope_theta"])


def rope_theta(config: object) -> float:
    """RoPE theta, from ``rope_parameters`` (transformers 5) or ``rope_theta`` (older)."""
    params = config_value(config, "rope_parameters")
    if isinstance(params, Mapping):
        return rope_parameters(params, "rope_parameters")
    scaling = config_value(config, "rope_scaling")
    if scaling:
        raise InputError(f"config.rope_scaling = {scaling!r}: RoPE scaling is not implemented")
    theta = config_value(config, "rope_theta")
    if theta is None:
        raise InputError("config: neither rope_parameters nor rope_theta is set")
    return float(theta)


def layer_types(config: object, num_layers: int, allowed: tuple[str, ...]) -> list[str]:
    """``config.layer_types``: one of ``allowed`` per layer, or an InputError naming it."""
    types = list(config_value(config, "layer_types") or [])
    if len(types) != num_layers or set(types) - set(allowed):
        raise InputError(f"config.layer_types = {types!r}: expected one of {allowed} per layer")
    return types


def llama3_scaling(params: Mapping[str, Any], where: str) -> RopeScaling:
    """The ``llama3`` rescaling parameters of a RoPE entry, each key required."""
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise InputError(f"config.{where}: rope_type 'llama3' needs {', '.join(missing)}")
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise InputError(
            f"config.{where}.high_freq_factor = {scaling.high_freq_factor} must exceed "
            f"low_freq_factor = {scaling.low_freq_factor}"
        )
    return scaling


def rope_with_llama3(config: object) -> tuple[float, RopeScaling | None]:
    """RoPE theta and, for ``rope_type: llama3``, its rescaling; any other RoPE scaling is
    refused by key. Reads ``rope_parameters`` (transformers 5) or the older ``rope_theta`` and
    ``rope_scaling`` attributes."""
    params = config_value(config, "rope_parameters")
    where = "rope_parameters"
    if not isinstance(params, Mapping):
        params = config_value(config, "rope_scaling")
        where = "rope_scaling"
        if not params:
            return rope_theta(config), None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "llama3":
        if where == "rope_scaling":
            raise InputError(
                f"config.rope_scaling = {dict(params)!r}: RoPE scaling {rope_type!r} is not "
                "implemented; only 'llama3' is"
            )
        return rope_parameters(params, where), None
    theta = params.get("rope_theta", config_value(config, "rope_theta"))
    if theta is None:
        raise InputError(f"config.{where}: no 'rope_theta' given")
    return float(theta), llama3_scaling(params, where)
