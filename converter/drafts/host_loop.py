"""A reference host loop for a cached draft decoder, driven by its manifest alone.

`Runtime.from_artifact` reads ``manifest.json`` (its ``kv_cache`` section: functions and
their tensors, cache shape and style, windows), ``rope.npy``, ``embeddings.npy`` and
``tokenizer.json``; nothing of anec's conversion code or the checkpoint is needed. Greedy
generation prefills the prompt (in calls of the prefill function's T tokens) and then decodes
one token per call. Backends:

* ``mil``: anec's MIL evaluator (numpy; Linux and macOS), fp16 profile by default;
* ``coreml``: Core ML on macOS (``MLModel(function_name=...)`` per function, one
  ``make_state()`` shared by them: `converter.coreml.runtime`). Core ML itself has NEVER RUN
  HERE; the host side runs in the tests against a stand-in with ``MLModel``'s shape;
* ``torch``: not the program but the module it was converted from - the BC1L module rebuilt
  from the manifest's recipe and checkpoint, cast to fp16 as the torch-fp16 level runs it
  (`torch_backend`). The gates hold it and the program to the same reference; it runs an
  acceptance sweep many times faster than the MIL evaluator (`anec speculate`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from converter.coreml.runtime import ModelLoader, StateRelay, StateView, coreml_loader
from converter.errors import InputError
from converter.pipeline.manifest import check_schema_version
from graph_passes.cache_host import CallShape
from parity.kv_session import (
    CacheSession,
    ChainStates,
    ChunkMeta,
    FunctionRunner,
    FunctionShape,
    MilChain,
    MilFunctions,
    chain_runner,
)
from parity.lockstep import Lockstep


@dataclass
class Runtime:
    """Everything the host loop needs, read from an artifact directory."""

    directory: Path
    manifest: dict[str, Any]
    functions: dict[str, FunctionShape]
    rope: list[tuple[np.ndarray, np.ndarray]]
    embeddings: np.ndarray | None
    tokenizer: Any
    package: Path  # the package, or chunk 0's of a chunked decoder
    # A chunked decoder (manifest kv_cache.chunks): every chunk's package and what the
    # chained host loop needs to call it, in call order; empty for one package.
    packages: list[Path] = field(default_factory=list)
    chunks: list[ChunkMeta] = field(default_factory=list)
    # cache.layout per-function (manifest kv_cache.layout): each function's own package,
    # whose function is ``main``; empty for a multifunction package.
    function_packages: dict[str, Path] = field(default_factory=dict)

    @property
    def kv(self) -> dict[str, Any]:
        """The manifest's kv_cache section."""
        return dict(self.manifest["kv_cache"])

    @classmethod
    def from_artifact(cls, directory: Path) -> Runtime:
        """Read the artifact's manifest and host files; InputError naming what is missing."""
        path = directory / "manifest.json"
        if not path.is_file():
            raise InputError(f"{directory}: no manifest.json (not an anec artifact)")
        manifest = json.loads(path.read_text(encoding="utf-8"))
        check_schema_version(manifest, path)
        kv = manifest.get("kv_cache")
        if not kv:
            raise InputError(
                f"{path}: no kv_cache section; anec generate runs a cached decoder "
                "(a recipe with cache.style state or io)"
            )
        s, windows = kv["cache_length"], tuple(kv["windows"])
        functions = {
            name: FunctionShape(
                name,
                CallShape(s, f["tokens"], windows, kv["style"], _masks_slots_only(f, s)),
                f["logits"],
            )
            for name, f in kv["functions"].items()
        }
        tables = np.load(directory / kv["rope"]["file"])
        rope = [(tables[g, 0], tables[g, 1]) for g in range(tables.shape[0])]
        embeddings = None
        if manifest.get("embeddings"):
            embeddings = np.load(directory / manifest["embeddings"]["file"])
        tokenizer = None  # an artifact without a tokenizer runs on token ids only
        if manifest.get("tokenizer"):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(directory / manifest["tokenizer"]["file"]))
        package = directory / manifest["package"]["file"]
        runtime = cls(directory, manifest, functions, rope, embeddings, tokenizer, package)
        for entry in kv.get("chunks") or []:
            runtime.packages.append(directory / entry["package"])
            runtime.chunks.append(chunk_of(entry, kv["cache"]["shape"][0] // 2))
        if kv.get("layout") == "per-function":
            runtime.function_packages = {
                name: directory / f["package"] for name, f in kv["functions"].items()
            }
        return runtime

    def head_ids(self) -> np.ndarray | None:
        """A trimmed head's token id per row (manifest draft_vocabulary), else None."""
        section = self.manifest.get("draft_vocabulary")
        if not section:
            return None
        return np.load(self.directory / section["head_ids"]["file"]).astype(np.int64)

    def require_logits(self, why: str) -> None:
        """InputError unless the program returns logits (not an in-model argmax / top-k):
        ``why`` says what needs them."""
        choice = (self.manifest.get("head_output") or {}).get("choice", "logits")
        if choice != "logits":
            raise InputError(
                f"{self.directory}: head_output.choice is {choice}; {why}: convert the same "
                "recipe with io.output: logits"
            )

    def token_input(self) -> str:
        """``input_ids`` or ``inputs_embeds``: the first input of the decode function."""
        return str(self.kv["functions"]["decode"]["inputs"][0]["name"])

    def session(
        self, runner: FunctionRunner, states: MutableMapping[str, np.ndarray] | None
    ) -> CacheSession:
        """A host loop over this artifact's functions run by ``runner``."""
        table = self.embeddings

        def embed(ids: list[int]) -> np.ndarray:
            assert table is not None
            return np.asarray(table[ids], dtype=np.float32)

        return CacheSession(
            self.functions,
            self.rope,
            tuple(self.kv["cache"]["shape"]),
            runner,
            self.token_input(),
            embed if table is not None else None,
            states=states,
            chunk_sizes=list(self.manifest["lm_head_chunks"]),
            head_ids=self.head_ids(),
        )


def _masks_slots_only(function: dict[str, Any], cache_length: int) -> bool:
    """Whether a function's masks have the S cache slots alone on their key axis (it writes its
    tokens into their slots before attending), read from its inputs' shapes: an artifact
    from before that layout has S + T keys in every function."""
    shapes = [t["shape"] for t in function["inputs"] if t["name"].startswith("mask")]
    return bool(shapes) and shapes[0][1] == cache_length


def chunk_of(entry: dict[str, Any], layers: int) -> ChunkMeta:
    """One ``kv_cache.chunks`` entry as the chained host loop reads it."""
    names = {t["name"] for f in entry["functions"].values() for t in f["inputs"]}
    start, stop = entry["layers"]
    return ChunkMeta(start, stop, layers, frozenset(names), tuple(entry["cache"]["shape"]))


def artifact_source(directory: Path) -> tuple[Any, str]:
    """Where the checkpoint an artifact was converted from is (from its manifest), and its task."""
    from converter.recipe import recipe_from_dict
    from converter.recipe.sources import ResolvedSource

    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    recipe = recipe_from_dict(manifest["recipe"])
    resolved = manifest["recipe"].get("resolved_source")
    source = (
        ResolvedSource(resolved["kind"], Path(resolved["directory"]), resolved["gguf_file"])
        if resolved
        else recipe.resolve_source()
    )
    return source, recipe.task


def artifact_checkpoint(directory: Path) -> Any:
    """The checkpoint the artifact's manifest names, loaded; InputError when the file found
    there is not the one it was converted from (its sha256 differs)."""
    from converter.checkpoints.loading import load_checkpoint

    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    source, task = artifact_source(directory)
    ckpt = load_checkpoint(source, task)
    if ckpt.sha256 != manifest["checkpoint"]["sha256"]:
        raise InputError(f"{source.directory}: not the checkpoint the artifact was made from")
    return ckpt


def torch_backend(runtime: Runtime) -> Callable[[], CacheSession]:
    """Sessions run by the fp16 torch module the artifact's program was converted from: the
    manifest's recipe rewritten again from its checkpoint (hash checked), every layer in one
    host loop whatever the chunking. A compressed variant's module holds the program's own
    weights, decoded by the MIL evaluator (`variant_weights`), as its cache gates' reference
    does."""
    import torch

    from converter.recipe import recipe_from_dict
    from converter.tasks.text_generation import rewrite_decoder
    from graph_passes.cached_decoder import cached_functions
    from parity.kv_session import session_for, torch_runner
    from parity.model_copies import cast_copy, set_weights

    ckpt = artifact_checkpoint(runtime.directory)
    window = rewrite_decoder(recipe_from_dict(runtime.manifest["recipe"]), ckpt).module  # type: ignore[arg-type]
    del ckpt
    head_ids = runtime.head_ids()
    if head_ids is not None:  # the trimmed head the program was converted with
        window.keep_head_rows(torch.from_numpy(head_ids))
    calls = {name: (f.shape.tokens, f.logits) for name, f in runtime.functions.items()}
    kv = runtime.kv
    half = cast_copy(window, torch.float16)
    if runtime.manifest.get("compression"):
        set_weights(half, variant_weights(runtime, [name for name, _ in half.named_parameters()]))
    modules = cached_functions(half, kv["style"], kv["cache_length"], calls)
    if kv["style"] == "state":  # one fp16 state, shared by the functions
        state = modules["decode"].kv_cache.half()
        for module in modules.values():
            module.kv_cache = state
    table = runtime.embeddings

    def make() -> CacheSession:
        for module in modules.values():
            module.reset_cache()
        embed = None if table is None else (lambda ids: np.asarray(table[ids], np.float32))
        return session_for(modules, torch_runner(modules, torch.float16), None, embed, head_ids)

    return make


def variant_weights(runtime: Runtime, names: list[str]) -> dict[str, np.ndarray]:
    """A compressed variant's decoded weights by window-module parameter name (fp16): each
    package's compressed constants as the MIL evaluator decodes them when it prepares the
    default function (a constexpr output is ``window_<name, dots as _>_to_fp16_<kind>``).
    InputError naming one that matches no parameter: the module could not stand for the
    program."""
    from parity.mil import Evaluator
    from parity.mil.program import load_package

    default = runtime.kv["default_function"]
    # Every function of a package holds the same weights: one function is decoded per package.
    packages = runtime.packages or [runtime.function_packages.get(default, runtime.package)]
    by_mangled = {"window_" + n.replace(".", "_"): n for n in names}
    weights: dict[str, np.ndarray] = {}
    for package in packages:
        program = load_package(package)
        function = default if default in program.functions else "main"
        evaluator = Evaluator(program, "fp16", function)
        for out_name in evaluator.constant_names():
            head, sep, kind = out_name.rpartition("_to_fp16_")
            if not sep or kind not in ("quantized", "palettized"):
                continue
            if head not in by_mangled:
                raise InputError(
                    f"{package}: compressed weight {out_name} matches no parameter of the "
                    "module: run this variant with the mil (or coreml) backend"
                )
            weights[by_mangled[head]] = np.asarray(evaluator.constant(out_name), np.float16)
        del evaluator, program
    if not weights:
        raise InputError(f"{runtime.directory}: a compressed variant without compressed weights")
    return weights


def mil_backend(
    runtime: Runtime, profile: str = "fp16", lockstep: Lockstep | None = None
) -> Callable[[], CacheSession]:
    """Sessions run by the MIL evaluator (functions prepared once, a fresh state each); a
    chunked decoder's chunks run as one chain (`parity.kv_session`); calls go through
    ``lockstep`` when given (`parity.lockstep`)."""
    from parity.mil.program import load_function_set, load_package

    mil: MilFunctions | MilChain
    if runtime.chunks:
        programs = [load_package(p) for p in runtime.packages]
        mil = MilChain(
            programs, profile, list(runtime.functions), runtime.chunks, lockstep=lockstep
        )
    elif runtime.function_packages:  # one state stands for the host's exact copies
        mil = MilFunctions(
            load_function_set(runtime.function_packages), profile, list(runtime.functions),
            tuple(runtime.kv["cache"]["shape"]), lockstep=lockstep,
        )  # fmt: skip
    else:
        mil = MilFunctions(
            load_package(runtime.package), profile, list(runtime.functions),
            tuple(runtime.kv["cache"]["shape"]), lockstep=lockstep,
        )  # fmt: skip

    def make() -> CacheSession:
        runner, states = mil.session()
        return runtime.session(runner, states)

    return make


def coreml_backend(
    runtime: Runtime, units: str = "CPU_AND_NE", load: ModelLoader = coreml_loader
) -> Callable[[], CacheSession]:
    """Sessions run by Core ML with compute units ``units``: every function of every package
    loaded once by ``load`` (`converter.coreml.runtime`: Core ML on macOS, NEVER RUN HERE; a
    stand-in in the tests), one state per package shared by its functions (``STATE_SHARING``
    there says why that choice is unverified)."""
    name = runtime.kv["cache"]["name"]
    if runtime.function_packages:
        return _per_function_backend(runtime, units, load, name)
    packages = runtime.packages or [runtime.package]
    per_package = [{name: load(package, name, units) for name in runtime.functions}
                   for package in packages]  # fmt: skip

    def runner(models: dict[str, Any]) -> tuple[FunctionRunner, StateView | None]:
        # One state per package (per chunk), shared by its functions.
        state = models["decode"].make_state() if runtime.kv["style"] == "state" else None

        def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return _predict(models[function], inputs, state)

        return run, None if state is None else StateView(lambda: state, [name])

    def make() -> CacheSession:
        runners, views = zip(*(runner(models) for models in per_package), strict=True)
        if runtime.chunks:
            held = None if views[0] is None else ChainStates([v for v in views if v])
            return runtime.session(chain_runner(runtime.chunks, list(runners)), held)
        return runtime.session(runners[0], views[0])

    return make


def _per_function_backend(
    runtime: Runtime, units: str, load: ModelLoader, name: str
) -> Callable[[], CacheSession]:
    """`coreml_backend` of the per-function layout: each function's package (its ``main``)
    loaded once; a ``state`` cache relayed between the packages' states (`StateRelay`)."""
    models = {f: load(p, "main", units) for f, p in runtime.function_packages.items()}

    def make() -> CacheSession:
        relay = None
        if runtime.kv["style"] == "state":
            states = {f: m.make_state() for f, m in models.items()}
            relay = StateRelay(states, name, "prefill")

        def run(function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            state = None if relay is None else relay.state_for(function)
            return _predict(models[function], inputs, state)

        return runtime.session(run, None if relay is None else relay.view())

    return make


def _predict(model: Any, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]:
    """One Core ML call: int32 token ids, fp16 everything else; fp32 outputs."""
    feed = {k: v.astype(np.int32 if k == "input_ids" else np.float16) for k, v in inputs.items()}
    out = model.predict(feed) if state is None else model.predict(feed, state=state)
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


@dataclass
class Generation:
    """What a greedy run produced."""

    prompt_ids: list[int]
    new_ids: list[int]
    evictions: int

    def text(self, tokenizer: Any) -> str:
        """The generated continuation as text."""
        return str(tokenizer.decode(self.new_ids))


def greedy(
    make_session: Callable[[], CacheSession],
    prompt_ids: list[int],
    max_new_tokens: int,
    eos: int | None = None,
) -> Generation:
    """Prefill the prompt, then decode greedily; evicts as the manifest's convention says
    (keep the last tokens that fit, start again at position 0, prefill them)."""
    session = make_session()
    prefill = session.functions["prefill"].shape
    capacity = prefill.cache_length
    if not prompt_ids:
        raise InputError("the prompt tokenizes to no tokens")
    context = list(prompt_ids)
    if len(context) > capacity - prefill.tokens:
        context = context[-(capacity - prefill.tokens) :]
    chosen = session.choose
    token = chosen(session.prefill_outputs("prefill", context))
    new: list[int] = []
    evictions = 0
    while len(new) < max_new_tokens:
        new.append(token)
        if token == eos or len(new) == max_new_tokens:
            break
        context.append(token)
        if session.position + 1 > capacity:
            evictions += 1
            context = context[-(capacity - prefill.tokens) :]
            session = make_session()
            session.prefill_outputs("prefill", context[:-1])
        token = chosen(session.call_outputs("decode", [token]))
    return Generation(list(prompt_ids), new, evictions)
