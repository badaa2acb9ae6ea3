"""The op table: every op of a MIL program with its shapes, dtypes, FLOPs and weight bytes.

Works on Linux from the saved package (``parity.mil.program.load_package``) or from a program
built with coremltools' MIL builder. Constants are not rows: their bytes are charged to the
ops that read them (a weight used twice is streamed twice). ``constexpr_*`` ops (decompressed
weights) are rows, because Core ML lists them, but they are not dispatchable either.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from converter.placement.decode import DecodedWeight, decoded_of
from converter.placement.stream_rules import rule_for

# The NE pads the last axis of every tensor to 64 bytes (docs/placement-rules.md R-ALIGN).
ALIGN_BYTES = 64

_DTYPE_BYTES = {
    "fp16": 2,
    "fp32": 4,
    "fp64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "bool": 1,
    "int4": 1,  # a byte per element where a layout is asked for (aligned_nbytes)
    "uint4": 1,
}
# Sub-byte dtypes (palette indices, int4 data) are stored packed: `Tensor.nbytes` counts bits,
# so a 4-bit weight streams half the bytes of an int8 one (plan.streamed).
_SUB_BYTE_BITS = {"int4": 4, "uint4": 4, "uint1": 1, "uint2": 2, "uint3": 3, "uint6": 6}
FLOAT_DTYPES = frozenset({"fp16", "fp32", "fp64"})
INT_DTYPES = frozenset(
    {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "int4", "uint4", "bool"}
)


@dataclass(frozen=True)
class Tensor:
    """A tensor's name, shape (None for a symbolic dimension) and dtype ("fp16", "int32", ...)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    @property
    def rank(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def static(self) -> bool:
        """True when every dimension is known."""
        return all(d is not None for d in self.shape)

    @property
    def elements(self) -> int | None:
        """Element count, or None for a symbolic shape."""
        if not self.static:
            return None
        return math.prod(d for d in self.shape if d is not None)

    @property
    def nbytes(self) -> int | None:
        """Bytes as stored densely, or None for a symbolic shape or a non-numeric dtype."""
        n, size = self.elements, _DTYPE_BYTES.get(self.dtype)
        bits = _SUB_BYTE_BITS.get(self.dtype)
        if n is not None and bits is not None:
            return (n * bits + 7) // 8
        return None if n is None or size is None else n * size

    @property
    def aligned_nbytes(self) -> int | None:
        """Bytes with the last axis padded to 64 bytes, as the NE lays tensors out."""
        n, size = self.elements, _DTYPE_BYTES.get(self.dtype)
        if n is None or size is None:
            return None
        if not self.shape:
            return ALIGN_BYTES
        last = self.shape[-1] or 1
        row = math.ceil(last * size / ALIGN_BYTES) * ALIGN_BYTES
        return (n // last) * row

    @property
    def short_last_axis(self) -> bool:
        """True when the last axis is shorter than one 64-byte row (padding on the NE)."""
        size = _DTYPE_BYTES.get(self.dtype)
        last = self.shape[-1] if self.shape else 1
        return size is not None and last is not None and last * size < ALIGN_BYTES

    def to_json(self) -> dict[str, Any]:
        """JSON form: name, shape (null for symbolic dims), dtype."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class Op:
    """One op of a function, in program order (ops of nested blocks follow their parent)."""

    function: str
    index: int
    op_type: str
    name: str
    outputs: list[Tensor]
    inputs: list[Tensor]  # runtime inputs: produced by another op or a function input
    consts: dict[str, Tensor]  # constant inputs by parameter name (weights, axes, ...)
    attrs: dict[str, Any]  # small constant values (axis, groups, transpose_x, equation, ...)
    weight_bytes: int
    flops: int | None
    in_block_of: str | None = None  # op type of the enclosing control-flow op, if any
    producers: list[int] = field(default_factory=list)  # indices of ops feeding `inputs`
    consumers: list[int] = field(default_factory=list)
    reads_function_input: bool = False
    writes_function_output: bool = False
    layer: int | None = None  # the transformer layer the op belongs to (see assign_layers)
    # plan.streamed rule ids of the compressed weights it reads (e.g. "S-BLOCK")
    weight_formats: tuple[str, ...] = ()
    decoded: tuple[DecodedWeight, ...] = ()  # compressed weights the NE decodes (plan.decode)

    @property
    def dispatchable(self) -> bool:
        """False for decompression constexprs, which Core ML folds into their consumers."""
        return not self.op_type.startswith("constexpr_")


@dataclass
class Function:
    """A function of the program: its inputs, ops and output names."""

    name: str
    inputs: list[Tensor]
    ops: list[Op]
    output_names: list[str]
    outputs: list[Tensor]
    weight_bytes_stored: int = 0  # every constant once: the model's size, not its streaming
    # per stream rule (plan.streamed): compressed weights, their stored and streamed bytes
    streamed: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class OpTable:
    """Every function of a program, each with its op rows."""

    functions: list[Function]

    def ops(self) -> Iterator[Op]:
        """All ops of all functions, function by function."""
        for f in self.functions:
            yield from f.ops

    @property
    def weight_bytes_stored(self) -> int:
        """Stored constant bytes of the largest function (functions may share weights)."""
        return max((f.weight_bytes_stored for f in self.functions), default=0)


_LAYER_RE = re.compile(r"(?:^|[_.])layers?[_.](\d+)(?=[_.]|$)")


def layer_of(name: str) -> int | None:
    """The layer index a traced op name carries (``layers_12_attention_...`` -> 12)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def assign_layers(ops: list[Op]) -> None:
    """Set ``op.layer`` from the layer names of the op and the constants it reads.

    Traced names put the layer in weight names (``layers_3_mlp_down_weight``), not in op
    names. Layers follow one another in program order, so a tag lower than one already seen
    (a constant shared with an earlier layer, e.g. a RoPE table) is ignored; untagged ops
    between two ops of the same layer belong to it, and those between layer k and k+1 to
    k+1 (the pre-norm that feeds it). Ops before the first and after the last layer get None.
    """
    tags: list[int | None] = []
    highest = -1
    for op in ops:
        found = [layer_of(op.name), *(layer_of(t.name) for t in op.consts.values())]
        known = [t for t in found if t is not None and t >= highest]
        tag = max(known) if known else None
        if tag is not None:
            highest = tag
        tags.append(tag)
    tagged = [i for i, t in enumerate(tags) if t is not None]
    if not tagged:
        return
    nxt = None
    for i in range(tagged[-1], tagged[0] - 1, -1):
        nxt = tags[i] if tags[i] is not None else nxt
        ops[i].layer = nxt


def dtype_name(builtin: Any) -> str:
    """coremltools' builtin dtype as a short string ("fp16", "int32", "bool", ...)."""
    from coremltools.converters.mil.mil import types

    try:
        return str(types.builtin_to_string(builtin))
    except Exception:  # an exotic type (list, dict, state): named, never a number type
        return str(getattr(builtin, "__name__", builtin))


def tensor_of(var: Any) -> Tensor:
    """A MIL Var as a Tensor (scalars have shape ())."""
    from coremltools.converters.mil.mil.types.symbolic import is_symbolic

    shape = tuple(None if is_symbolic(d) else int(d) for d in (var.shape or ()))
    return Tensor(var.name, shape, dtype_name(var.dtype))


# ------------------------------------------------------------------------------------ FLOPs
# Multiply and add counted separately (SPEC section 6). Norms, softmax and activations get a
# small per-element constant; shape ops and gathers move data and compute nothing.

_PER_ELEMENT = {
    "softmax": 5,
    "layer_norm": 5,
    "instance_norm": 5,
    "batch_norm": 2,
    "l2_norm": 3,
    "local_response_norm": 5,
}
_DATA_MOVEMENT = frozenset(
    {
        "reshape",
        "transpose",
        "concat",
        "split",
        "slice_by_index",
        "slice_by_size",
        "expand_dims",
        "squeeze",
        "stack",
        "tile",
        "pad",
        "identity",
        "gather",
        "gather_nd",
        "gather_along_axis",
        "scatter",
        "scatter_nd",
        "scatter_along_axis",
        "cast",
        "shape",
        "reverse",
        "reverse_sequence",
        "slice_update",
        "one_hot",
        "range_1d",
        "fill",
        "read_state",
        "write_state",
        "coreml_update_state",
        "space_to_depth",
        "depth_to_space",
        "pixel_shuffle",
        "sliding_windows",
        "band_part",
        "non_zero",
        "topk",
        "argsort",
    }
)


def _shape(t: Tensor | None) -> tuple[int, ...] | None:
    if t is None or not t.static:
        return None
    return tuple(int(d) for d in t.shape if d is not None)


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> int | None:
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs.split(","), shapes, strict=False):
        if "." in term or len(term) != len(shape):
            return None
        sizes.update(zip(term, shape, strict=True))
    return 2 * math.prod(sizes.values())


def op_flops(
    op_type: str, inputs: dict[str, Tensor], outputs: list[Tensor], attrs: dict[str, Any]
) -> int | None:
    """Estimated FLOPs of one op (None when a shape is symbolic)."""
    out = _shape(outputs[0]) if outputs else ()
    if out is None:
        return None
    out_n = math.prod(out)
    x = _shape(inputs.get("x"))
    w = _shape(inputs.get("weight"))
    if op_type in _DATA_MOVEMENT or op_type.startswith("constexpr_") or op_type == "const":
        return 0
    if op_type == "conv" and w is not None:
        return 2 * out_n * math.prod(w[1:])
    if op_type == "conv_transpose" and w is not None and x is not None:
        return 2 * math.prod(x) * math.prod(w[1:])
    if op_type == "linear" and w is not None:
        return 2 * out_n * w[1]
    if op_type == "matmul" and x is not None:
        k = x[-2] if attrs.get("transpose_x") and len(x) > 1 else x[-1]
        return 2 * out_n * k
    if op_type == "einsum":
        shapes = [_shape(inputs.get(k)) for k in sorted(inputs) if k.startswith("values")]
        equation = attrs.get("equation")
        if isinstance(equation, str) and all(s is not None for s in shapes):
            return _einsum_flops(equation, [s for s in shapes if s is not None])
        return None
    if op_type == "scaled_dot_product_attention":
        q, key = _shape(inputs.get("query")), _shape(inputs.get("key"))
        if q is None or key is None:
            return None
        batch, lq, e, lk = math.prod(q[:-2]), q[-2], q[-1], key[-2]
        return batch * lq * lk * (4 * e + 5)
    if op_type.startswith("reduce_") and x is not None:
        return math.prod(x)
    return _PER_ELEMENT.get(op_type, 1) * out_n


# ------------------------------------------------------------------------------ extraction


def _small_value(var: Any) -> Any:
    """A constant's value when it is small enough to be a parameter (axis, flags, equation)."""
    val = getattr(var, "val", None)
    if val is None:
        return None
    if isinstance(val, str | bool | int | float):
        return val
    size = getattr(val, "size", None)
    if size is not None and size <= 16:
        item = val.tolist()
        return item
    return None


def _const_bytes(t: Tensor) -> int:
    # Scalars and integer parameter vectors (shapes, axes) are not weights.
    if t.rank == 0 or (t.dtype in INT_DTYPES and t.dtype not in ("int8", "uint8", "int4", "uint4")):
        return 0
    return t.nbytes or 0


def _walk(block: Any, parent: str | None) -> Iterator[tuple[Any, str | None]]:
    for op in block.operations:
        yield op, parent
        for inner in getattr(op, "blocks", None) or ():
            yield from _walk(inner, op.op_type)


def _input_vars(op: Any) -> Iterable[tuple[str, Any]]:
    for key, value in op.inputs.items():
        if isinstance(value, list | tuple):
            for i, v in enumerate(value):
                yield f"{key}{i}" if len(value) > 1 else key, v
        else:
            yield key, value


@dataclass
class _Reads:
    """What one op reads: every input tensor by argument, the constant ones, small constant
    values as attributes, the weight bytes it streams, its producers and their formats."""

    data: dict[str, Tensor] = field(default_factory=dict)
    consts: dict[str, Tensor] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    weight_bytes: int = 0
    producers: list[int] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    decoded: list[DecodedWeight] = field(default_factory=list)
    reads_input: bool = False


@dataclass
class _TableBuilder:
    """The state of a walk over one function: constants seen, what a reader of each var
    streams, which row produced each var, and the weight tallies."""

    input_names: set[str]
    const_vars: dict[str, Tensor] = field(default_factory=dict)
    const_charge: dict[str, int] = field(default_factory=dict)  # bytes a reader streams
    const_format: dict[str, str] = field(default_factory=dict)  # constexpr output: rule id
    const_decoded: dict[str, DecodedWeight] = field(default_factory=dict)
    producer_of: dict[str, int] = field(default_factory=dict)
    streamed: dict[str, dict[str, int]] = field(default_factory=dict)
    stored: int = 0

    def add_const(self, mil_op: Any) -> None:
        t = tensor_of(mil_op.outputs[0])
        self.const_vars[t.name] = t
        self.const_charge[t.name] = _const_bytes(t)
        self.stored += self.const_charge[t.name]

    def reads(self, mil_op: Any) -> _Reads:
        r = _Reads()
        for key, var in _input_vars(mil_op):
            t = tensor_of(var)
            r.data[key] = t
            if var.name in self.const_vars:
                r.consts[key] = t
                r.weight_bytes += self.const_charge.get(var.name, 0)
                small = _small_value(var)
                if small is not None:
                    r.attrs[key] = small
            elif var.name in self.producer_of:
                r.producers.append(self.producer_of[var.name])
                r.weight_bytes += self.const_charge.get(var.name, 0)  # a constexpr's output
                if var.name in self.const_format:
                    r.formats.append(self.const_format[var.name])
                if var.name in self.const_decoded:
                    r.decoded.append(self.const_decoded[var.name])
            elif var.name in self.input_names:
                r.reads_input = True
        return r

    def charge_constexpr(
        self, mil_op: Any, consts: dict[str, Tensor], outputs: list[Tensor]
    ) -> None:
        """A constexpr is stored weight: its readers stream what it stores when the format
        stays compressed in NE memory, else the dense weight it expands to at load
        (plan.streamed: a prediction from published sources)."""
        rule = rule_for(mil_op.op_type, consts)
        held = sum(_const_bytes(t) for t in consts.values())
        dense = sum(_const_bytes(t) for t in outputs)
        charge = held if rule.stays_compressed else dense
        decoded = decoded_of(rule.id, consts, outputs, charge) if rule.stays_compressed else None
        for out in outputs:
            self.const_charge[out.name] = charge
            self.const_format[out.name] = rule.id
            if decoded is not None:
                self.const_decoded[out.name] = decoded
        tally = self.streamed.setdefault(rule.id, {"weights": 0, "stored": 0, "streamed": 0})
        tally["weights"] += 1
        tally["stored"] += held
        tally["streamed"] += charge


def function_table(name: str, function: Any) -> Function:
    """The op rows of one MIL function, with producer/consumer links and weight bytes."""
    inputs = [tensor_of(v) for v in function.inputs.values()]
    table = _TableBuilder({t.name for t in inputs})
    ops: list[Op] = []
    for mil_op, parent in _walk(function, None):
        if mil_op.op_type == "const":
            table.add_const(mil_op)
            continue
        r = table.reads(mil_op)
        outputs = [tensor_of(v) for v in mil_op.outputs]
        row = Op(
            function=name,
            index=len(ops),
            op_type=mil_op.op_type,
            name=mil_op.name,
            outputs=outputs,
            inputs=[t for k, t in r.data.items() if k not in r.consts],
            consts=r.consts,
            attrs=r.attrs,
            weight_bytes=0,
            flops=op_flops(mil_op.op_type, r.data, outputs, r.attrs),
            in_block_of=parent,
            producers=sorted(set(r.producers)),
            reads_function_input=r.reads_input,
            weight_formats=tuple(r.formats),
            decoded=tuple(r.decoded),
        )
        if not row.dispatchable:
            table.charge_constexpr(mil_op, r.consts, outputs)
        else:
            row.weight_bytes = r.weight_bytes
        for p in row.producers:
            ops[p].consumers.append(row.index)
        for out in outputs:
            table.producer_of[out.name] = row.index
        ops.append(row)

    assign_layers(ops)
    output_names = [v.name for v in function.outputs]
    outs = [tensor_of(v) for v in function.outputs]
    for out_name in output_names:
        if out_name in table.producer_of:
            ops[table.producer_of[out_name]].writes_function_output = True
    return Function(name, inputs, ops, output_names, outs, table.stored, table.streamed)


def op_table(program: Any) -> OpTable:
    """The op table of every function of a MIL program (``main`` first when present)."""
    names = sorted(program.functions, key=lambda n: (n != "main", n))
    return OpTable([function_table(n, program.functions[n]) for n in names])
