"""What a compression method is: the interface each ``methods/<name>.py`` implements.

A method owns everything that differs between ``method: lut``, ``int8``, ``w8a8`` and
``mixed``: which variant fields it accepts and their rules (``check``), the target features it
needs (``features``), which weights get which scheme (``select``), any change to the program
besides its weights (``prepare``, e.g. W8A8's activation quantizers), what the built program
then holds beyond its weights (``inspect``) and the lines it adds to the manifest
(``manifest``). Methods that store weights (``lut``, ``int8``) also say how a `Scheme` of
theirs is described, configured for coremltools, recorded and applied.

The module imports nothing heavy (no torch, no coremltools) at import time: the recipe schema
validates through it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from converter.compression.sites import WeightSite, keep_reason
from converter.coreml.targets import Feature

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]
FeatureUse = tuple[Loc, Feature, str]  # the field that asks, the feature, the fix

# Palette sizes coremltools' k-means palettizer and the constexpr ops accept.
LUT_BITS = (1, 2, 3, 4, 6, 8)
# Bit widths the mixed-bit search may give one weight (16: stays fp16).
SEARCH_BITS = (16, 8, 6, 4, 3, 2)


class VariantFields(Protocol):
    """The recipe fields of one variant a method reads (``recipe.compression.Variant``)."""

    @property
    def suffix(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def bits(self) -> int | None: ...
    @property
    def granularity(self) -> str: ...
    @property
    def group_size(self) -> int | None: ...
    @property
    def symmetric(self) -> bool: ...
    @property
    def activations_keep_fp16(self) -> list[str]: ...
    @property
    def search(self) -> Any: ...
    @property
    def outlier_columns(self) -> int | None: ...
    @property
    def smooth(self) -> bool: ...
    @property
    def smooth_alpha(self) -> float: ...


@dataclass(frozen=True)
class Scheme:
    """How one weight is compressed; ``method`` names the registered method that stores it
    (a k-means palette, affine int8, values a calibrated method computed, a block grid)."""

    method: str
    bits: int
    granularity: str  # per-tensor, per-grouped-channel, per-channel, per-block
    group_size: int | None = None
    symmetric: bool = True

    def describe(self) -> str:
        """A short label, e.g. ``lut4 k-means per-tensor`` or ``int8 per-channel symmetric``."""
        return _storage(self).describe(self)

    def ct_config(self) -> Any:
        """The coremltools op config; ``weight_threshold`` 1: the plan already chose."""
        return _storage(self).ct_config(self)


def _storage(scheme: Scheme) -> CompressionMethod:
    from converter.compression.methods import get

    return get(scheme.method)


@dataclass
class Selection:
    """A variant's per-weight plan, the weights it keeps fp16 (with why) and a report section
    for its manifest and parity report (e.g. ``{"search": ...}``)."""

    plan: dict[str, Scheme]
    kept: dict[str, str]
    doc: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # e.g. {"search": 12.3}


@dataclass
class Inspected:
    """What a built program holds beyond its compressed weights (W8A8: activation quantizers).

    ``wrap`` applies the same change to a torch module (a context manager), ``check`` counts
    the program's changes that torch does not reproduce bit for bit on the program's own
    input (gated at 0), ``doc`` and ``text`` go into the reports, ``notes`` into parity.txt.
    """

    wrap: Callable[[Any], contextlib.AbstractContextManager[Any]]
    # (fp32 evaluator, one program feed) -> count; None: torch reproduces the change exactly,
    # so the fp32 logits gate applies as for weights alone
    check: Callable[[Any, dict[str, Any]], int] | None
    doc: dict[str, Any]
    text: str
    notes: list[str] = field(default_factory=list)


class Subject(Protocol):
    """The model being compressed and what its variants are compared on: a decoder's logits
    or an encoder's task output (``compress.decoder``, ``compress.encoder``).

    The emitter asks it for the fp16 baselines once, then for each variant's parity; methods
    ask it for calibration inputs (W8A8), calibration stages (GPTQ) or a searched plan
    (mixed)."""

    @property
    def task(self) -> str: ...
    @property
    def module(self) -> Any:
        """The BC1L torch module whose parameters the program's weights are."""

    @property
    def host_files(self) -> tuple[str, ...]:
        """Files of the fp16 artifact a variant ships too."""

    @property
    def not_compressed(self) -> str:
        """What stays as in the fp16 artifact, for the manifest."""

    @property
    def baseline_steps(self) -> int:
        """Progress steps of ``baselines``."""

    @property
    def parity_steps(self) -> int:
        """Progress steps of ``parity``."""

    def baselines(self, program: Any, advance: Callable[[], None]) -> None:
        """Measure the fp16 artifact once (torch fp16 module and the fp16 program)."""
        ...

    def parity(
        self,
        variant: Any,
        program: Any,
        decoded: dict[str, Any],
        advance: Callable[[], None],
        inspected: Inspected | None,
    ) -> Any:
        """The variant's levels and gates: an object with ``gates`` and ``passed``."""
        ...

    def report(self, parity: Any) -> tuple[dict[str, Any], str]:
        """parity.json content and the parity.txt section for ``parity``."""
        ...

    def calibration_feeds(self, evaluator: Any) -> list[dict[str, Any]]:
        """The program's inputs for each calibration batch."""
        ...

    def calibration_stages(self) -> Any:
        """The module on the calibration text as stages run in order (``calibrate.Stages``),
        for methods that round layer by layer (GPTQ)."""
        ...

    def search(
        self, variant: VariantFields, chosen: list[WeightSite], advance: Callable[[], None]
    ) -> tuple[dict[str, Scheme], dict[str, Any]]:
        """A searched per-weight plan and its report."""
        ...


@dataclass(frozen=True)
class SearchData:
    """What a search candidate's values may be computed from: the weights as the fp16 program
    holds them (by name), the torch module, the calibration batches, embedding table, pad id."""

    fp16: dict[str, Any]
    module: Any
    calibration: list[Any]
    embed_table: Any
    pad_id: int


SiteValues = dict[str, tuple[Scheme, Any]]  # weight -> (its scheme, its fp16 values)


@dataclass
class BuildContext:
    """Everything a method's build steps may use."""

    subject: Subject
    sites: list[WeightSite]
    keep_fp16: list[str]  # the variant's patterns, or the section's
    min_weight_elements: int
    fp16_package: Any  # Path of the fp16 artifact's .mlpackage
    progress: Any  # converter.pipeline.progress.Steps


class CompressionMethod:
    """One compression method; subclasses set ``name`` and override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # Tasks it is implemented for (None: every task).
    tasks: ClassVar[frozenset[str] | None] = None
    needs_calibration: ClassVar[bool] = False
    # Optional variant fields only some methods accept, each with the rest of the message
    # shown when another method sets it ("weights have a zero point" -> "only int8 and w8a8
    # weights have a zero point"; None -> "only for method: w8a8").
    fields: ClassVar[dict[str, str | None]] = {}
    # Where it is listed (messages, ``names()``) and applied in a plan (palettes, then int8):
    # lower first, ties by name.
    order: ClassVar[int] = 1000
    # Its stored values are a function of the weight and its scheme alone, so a cached decoder's
    # functions compressed with the same plan hold byte-identical weights (compress.stateful).
    kv_cache: ClassVar[bool] = False
    # Its schemes choose symmetric or with an offset, and a weight's record says which.
    records_symmetry: ClassVar[bool] = False
    # The mixed search may choose it per weight (compress.candidates); ``search_*`` below.
    searchable: ClassVar[bool] = False
    search_summary: ClassVar[str] = ""  # what a candidate of it is, for the search report
    # SearchSpace fields only this search method reads, each with the rest of the message
    # shown when it is set without the method in ``search.methods``.
    search_fields: ClassVar[dict[str, str]] = {}

    def check(self, variant: VariantFields) -> list[Problem]:
        """Rules on the variant's fields that this method owns."""
        return []

    def features(self, variant: VariantFields) -> list[FeatureUse]:
        """Target features this method needs beyond compressed weights."""
        return []

    def scheme(self, variant: VariantFields) -> Scheme:
        """The one scheme a uniform variant of this method gives every weight."""
        raise ValueError(f"{self.name} variants have a searched plan, not one scheme")

    def select(self, ctx: BuildContext, variant: VariantFields) -> Selection:
        """Which weights get which scheme: by default one scheme for every weight not kept."""
        chosen, kept = split_sites(ctx.sites, ctx.keep_fp16, ctx.min_weight_elements)
        scheme = self.scheme(variant)
        return Selection({s.name: scheme for s in chosen}, kept)

    def prepare(
        self, ctx: BuildContext, variant: VariantFields, mlmodel: Any, plan: dict[str, Scheme]
    ) -> tuple[Any, Any]:
        """The model the weight plan is applied to, and state for ``inspect``."""
        return mlmodel, None

    def finish(
        self,
        ctx: BuildContext,
        variant: VariantFields,
        compressed: Any,
        plan: dict[str, Scheme],
        state: Any,
    ) -> tuple[Any, Any]:
        """The model after its weights are compressed, with any ops that need the stored
        values (e.g. exact outlier columns), and state for ``inspect``."""
        return compressed, state

    def extra_bytes(self, state: Any) -> dict[str, int]:
        """Bytes the program stores for a weight beyond its compressed constant (by name)."""
        return {}

    def effective(self, decoded: dict[str, Any], state: Any) -> dict[str, Any]:
        """The weights the program computes with, from the decoded constants."""
        return decoded

    def inspect(self, function: Any, state: Any, selection: Selection) -> Inspected | None:
        """What the built program holds beyond its weights (None: nothing)."""
        return None

    def check_source(self, variant: VariantFields, tables: list[Any]) -> None:
        """Refuse (``InputError``) a source whose weight tables (``checkpoint.WeightTable``)
        this method cannot compress, before anything is built."""

    def manifest(self, variant: VariantFields) -> dict[str, Any]:
        """Entries this method adds to the manifest's ``compression`` section."""
        return {}

    # ---- the mixed search (searchable methods) ----

    def search_check(self, space: Any) -> list[Problem]:
        """Rules on a search space (``config.SearchSpace``) that lists this method."""
        return []

    def search_features(self, space: Any) -> list[FeatureUse]:
        """Target features a search space listing this method needs."""
        return []

    def search_candidates(self, space: Any, widths: list[int]) -> list[Scheme]:
        """This method's candidates in ``space`` at ``widths`` (largest first, 16 excluded)."""
        raise ValueError(f"{self.name} is not a search method")

    def search_label(self, scheme: Scheme) -> str:
        """A candidate's label: ``lut4``, ``lut4g32``, ``gptq4``."""
        return f"{scheme.method}{scheme.bits}" + (
            f"g{scheme.group_size}" if scheme.group_size else ""
        )

    def fits(self, site: WeightSite, scheme: Scheme) -> bool:
        """Whether ``site`` can take candidate ``scheme``: groups must divide its output rows."""
        return not scheme.group_size or site.shape[0] % scheme.group_size == 0

    def stored_bytes(self, site: WeightSite, scheme: Scheme) -> int:
        """Bytes the program stores for ``site`` as candidate ``scheme``."""
        raise ValueError(f"{self.name} is not a search method")

    def search_values(self, c: Scheme, sites: list[WeightSite], data: SearchData) -> SiteValues:
        """Every site's scheme and fp16 values as candidate ``c`` (``compress.candidates``)."""
        raise ValueError(f"no search values for method {c.method!r}")

    # ---- weight storage (methods that store weights: lut, int8) ----

    def describe(self, scheme: Scheme) -> str:
        """A short label of a scheme of this method."""
        raise ValueError(f"{self.name} does not store weights itself")

    def ct_config(self, scheme: Scheme) -> Any:
        """The coremltools op config of a scheme of this method."""
        raise ValueError(f"{self.name} does not store weights itself")

    def algorithm(self, scheme: Scheme, site: WeightSite) -> str:
        """How the stored values were computed, for the weight's record."""
        raise ValueError(f"{self.name} does not store weights itself")

    def apply(self, mlmodel: Any, op_configs: dict[str, Any]) -> Any:
        """``mlmodel`` with the configured constants compressed (coremltools)."""
        raise ValueError(f"{self.name} does not store weights itself")


def split_sites(
    sites: list[WeightSite], keep_fp16: list[str], min_elements: int
) -> tuple[list[WeightSite], dict[str, str]]:
    """Sites to compress, and the kept ones with the reason they stay fp16."""
    compress, kept = [], {}
    for site in sites:
        reason = keep_reason(site, keep_fp16, min_elements)
        if reason is None:
            compress.append(site)
        else:
            kept[site.name] = reason
    return compress, kept


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """coremltools draws tqdm bars on stderr for every pass; keep the CLI's own progress
    readable. (tqdm reads TQDM_DISABLE when it is imported, so the variable cannot be set
    here; its bars go to ``sys.stderr`` as it is when each bar starts.)"""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield
