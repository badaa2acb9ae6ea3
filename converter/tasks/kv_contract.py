"""A cached draft decoder's contract with its runtime: each function's tensors, the cache, and
the conventions a host loop needs (`graph_passes.cache_host` implements them)."""

from __future__ import annotations

from typing import Any

from converter.coreml.program import DType, TensorIO
from converter.tasks.decoder_contract import head_contract, head_convention
from graph_passes.cache_host import __doc__ as HOST_DOC
from graph_passes.cached_decoder import CACHE_NAME, HIDDEN_IN, HIDDEN_OUT, CachedDecoder
from graph_passes.masks import MASKED

FUNCTIONS = ("prefill", "decode", "extend")
DEFAULT_FUNCTION = "decode"


def function_calls(prefill: int, extend: int) -> dict[str, tuple[int, str]]:
    """Each function's tokens per call and which logits it returns."""
    return {"prefill": (prefill, "last"), "decode": (1, "last"), "extend": (extend, "all")}


def function_contract(module: CachedDecoder, dtype: DType) -> tuple[list[TensorIO], list[TensorIO]]:
    """The inputs and outputs of one function, with their meaning."""
    io, spec = module.io, module.spec
    t, s, d = io.tokens, io.cache_length, spec.hidden_size
    if not module.first:
        first = TensorIO(
            HIDDEN_IN, (1, d, 1, t), dtype,
            f"the previous chunk's {HIDDEN_OUT}, as it returned it",
        )  # fmt: skip
    elif io.inputs == "token-ids":
        first = TensorIO("input_ids", (1, t), "int32", "token ids, left-padded to T")
    else:
        first = TensorIO(
            "inputs_embeds", (1, t, d), dtype,
            "rows of embeddings.npy for each token id, left-padded to T",
        )  # fmt: skip
    inputs = [first]
    for g in module.used_groups:
        r = module.groups[g].rotary_dim
        for kind in ("cos", "sin"):
            inputs.append(
                TensorIO(
                    f"rope_{kind}_{g}", (1, 1, r, t), dtype,
                    f"rows of rope.npy[{g}, {0 if kind == 'cos' else 1}] at each slot's "
                    "position (a padding slot: any row)",
                )
            )  # fmt: skip
    keys = (
        f"the {s} cache slots, the {t} new tokens written into theirs"
        if module.writes_in_place
        else f"the {s} cache slots then the {t} new slots"
    )
    if module.uses_global_mask:
        inputs.append(
            TensorIO("mask", (1, module.mask_keys(), 1, t), dtype,
                     f"additive mask [0, key, 0, query]: keys are {keys}; 0 visible, "
                     f"{MASKED:g} hidden (causal, global layers)")
        )  # fmt: skip
    for w in module.chunk_windows:
        inputs.append(
            TensorIO(f"mask_window_{w}", (1, module.mask_keys(), 1, t), dtype,
                     f"as mask, for the local layers: also hidden where key <= query - {w}")
        )  # fmt: skip
    inputs.append(
        TensorIO("cache_valid", (1, 1, s, 1), dtype,
                 "1 for a slot below the position (holds context), 0 otherwise")
    )  # fmt: skip
    if io.style == "state":
        inputs.append(
            TensorIO("write_slots", (1, 1, s, t), dtype,
                     "one-hot [0, 0, slot, t]: 1 at the slot token t is written to; a "
                     "padding token's column is all 0")
        )  # fmt: skip
    else:
        inputs.append(TensorIO("kv_cache_in", module.cache_shape(), dtype, cache_meaning()))
    n = t if io.logits == "all" else 1
    if module.last:
        outputs = head_contract(module.window, 1, n, dtype, f"at the last {n} slot(s)")
    else:
        outputs = [
            TensorIO(HIDDEN_OUT, (1, d, 1, t), dtype,
                     f"the residual stream after layer {module.stop - 1} at every slot "
                     f"[0, channel, 0, slot]: the next chunk's {HIDDEN_IN}")
        ]  # fmt: skip
    if io.style == "io":
        outputs.append(
            TensorIO("new_kv", module.rows_shape(), dtype,
                     "the T new rows in the cache's layout; write rows T-n..T-1 at slots "
                     "position..position+n-1")
        )  # fmt: skip
    return inputs, outputs


def cache_meaning() -> str:
    """The cache layout in one sentence."""
    return (
        "[2N, KV, S, d]: row i the keys of layer i, row N+i its values, slot s the token at "
        "position s, after RoPE and k norm"
    )


def state_contract(module: CachedDecoder) -> list[TensorIO]:
    """The Core ML state of a ``state`` style package (none for ``io``)."""
    if module.io.style != "state":
        return []
    return [TensorIO(CACHE_NAME, module.cache_shape(), "float16", cache_meaning())]


def kv_manifest_section(
    modules: dict[str, CachedDecoder],
    contracts: dict[str, tuple[list[TensorIO], list[TensorIO]]],
    sizes: dict[str, Any],
    rope_file: dict[str, Any],
) -> dict[str, Any]:
    """The manifest's ``kv_cache`` section: everything a host loop reads."""
    first = modules[DEFAULT_FUNCTION]

    def tensors(items: list[TensorIO]) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "meaning": t.meaning}
            for t in items
        ]

    return {
        "style": first.io.style,
        "cache": {
            "name": CACHE_NAME,
            "shape": list(first.cache_shape()),
            "dtype": "float16",
            "layout": cache_meaning(),
            "kind": "Core ML state (MLState; make_state() starts it at zero)"
            if first.io.style == "state"
            else "host array passed as kv_cache_in; the host writes new_kv into it",
        },
        "cache_length": first.io.cache_length,
        "windows": list(first.windows),
        "default_function": DEFAULT_FUNCTION,
        "functions": {
            name: {
                "tokens": m.io.tokens,
                "logits": m.io.logits,
                "inputs": tensors(contracts[name][0]),
                "outputs": tensors(contracts[name][1]),
            }
            for name, m in modules.items()
        },
        "rope": rope_file,
        "conventions": {
            "host": " ".join((HOST_DOC or "").split()),
            "position": "slot s holds position s; position = the number of context slots "
            "before a call; a call of n tokens advances it by n",
            "mask": f"host-built; {MASKED:g} hides a key (finite, so a fully hidden padding "
            "query stays finite); cache slots at or beyond the position are zeroed by "
            "cache_valid and hidden, except, in a function whose mask has cache_length keys "
            "(its tokens written into their slots before attending), the slots of the call's "
            "own tokens, visible causally",
            "eviction": "when position + n would exceed cache_length, the host keeps the last "
            "tokens that fit (at most cache_length - T), resets the position to 0 and prefills "
            "them again (RoPE is relative, so restarting positions at 0 is exact for the kept "
            "window); nothing is shifted inside the cache",
            "rollback": "after rejecting drafted tokens, set the position back to the first "
            "rejected token's; their slots become stale, are hidden by cache_valid and the "
            "mask, and the next call overwrites them; nothing else is reset",
            "logits": head_convention(first.window.io.output),
            "draft_cycle": "draft one token at a time with decode; absorb a cycle's accepted "
            "tokens with extend (up to K, left-padded); verify K tokens with extend",
        },
        "sizes": sizes,
    }
