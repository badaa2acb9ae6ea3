"""Small MIL programs for the plan tests, built with coremltools' MIL builder.

Several mirror published MLComputePlan dumps (docs/placement-rules.md section 3: D1, D2, D4, D5, the
stablehlo-coreml tiny-graph report), so the predictor is judged on programs anec does not
emit. Import as ``import plan_programs`` (tests is not a package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_RNG = np.random.default_rng(0)


def _mb() -> Any:
    from coremltools.converters.mil import Builder as mb

    return mb


def _types() -> Any:
    from coremltools.converters.mil.mil import types

    return types


def _target() -> Any:
    import coremltools as ct

    return ct.target.macOS14


def w16(*shape: int) -> np.ndarray:
    """A random fp16 constant."""
    return _RNG.standard_normal(shape).astype(np.float16)


def conv_chain(mb: Any, x: Any, layers: int, channels: int, prefix: str = "layers") -> Any:
    """``layers`` 1x1 convs with relu, named ``{prefix}_{i}_...`` so layers are detected."""
    for i in range(layers):
        x = mb.conv(x=x, weight=w16(channels, channels, 1, 1), name=f"{prefix}_{i}_conv")
        x = mb.relu(x=x, name=f"{prefix}_{i}_relu")
    return x


def bc1l_block() -> Any:
    """An anec-style fp16 program: 1x1 convs, per-head einsum attention, softmax on axis 1."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 64, 1, 16), dtype=types.fp16)],
        opset_version=_target(),
    )
    def prog(x: Any) -> Any:
        h = conv_chain(mb, x, 3, 64)
        q, k = mb.split(x=h, num_splits=2, axis=1, name="layers_3_qk")
        kt = mb.transpose(x=k, perm=[0, 3, 2, 1], name="layers_3_kt")
        score = mb.einsum(values=(kt, q), equation="bkhc,bchq->bkhq", name="layers_3_score")
        weight = mb.softmax(x=score, axis=1, name="layers_3_softmax")
        return mb.einsum(values=(q, weight), equation="bchk,bkhq->bchq", name="layers_3_out")

    return prog


def lfm2_like() -> Any:
    """Dump D2 (LFM2-350M, CPU_AND_NE): conv, mul, add, reduce_mean, rsqrt, silu, matmul,
    softmax, reshape, transpose, slice_by_index, pad, split, tile, concat on the NE; the
    integer-token gather and one cast on the CPU."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 16), dtype=types.int32),
            mb.TensorSpec(shape=(1, 64, 1, 16), dtype=types.fp16),
        ],
        opset_version=_target(),
    )
    def prog(ids: Any, x: Any) -> Any:
        table = w16(100, 64)
        emb = mb.gather(x=table, indices=ids, axis=0, name="embed_gather")  # (1, 16, 64)
        emb = mb.cast(x=emb, dtype="fp32", name="embed_cast")
        h = conv_chain(mb, x, 3, 64)
        sq = mb.mul(x=h, y=h, name="norm_square")
        mean = mb.reduce_mean(x=sq, axes=[1], keep_dims=True, name="norm_mean")
        inv = mb.rsqrt(x=mb.add(x=mean, y=np.float16(1e-5), name="norm_eps"), name="norm_rsqrt")
        h = mb.mul(x=h, y=inv, name="norm_scale")
        h = mb.silu(x=h, name="act")
        r = mb.reshape(x=h, shape=[1, 4, 16, 16], name="heads")
        t = mb.transpose(x=r, perm=[0, 1, 3, 2], name="heads_t")
        s = mb.matmul(x=r, y=t, name="scores")
        p = mb.softmax(x=s, axis=-1, name="probs")
        o = mb.matmul(x=p, y=r, name="attn")
        o = mb.slice_by_index(x=o, begin=[0, 0, 0, 0], end=[1, 4, 16, 8], name="half")
        o = mb.pad(x=o, pad=[0, 0, 0, 0, 0, 0, 0, 8], name="padded")
        a, b = mb.split(x=o, num_splits=2, axis=1, name="halves")
        c = mb.concat(values=[b, a], axis=1, name="swapped")
        c = mb.tile(x=c, reps=[1, 1, 1, 1], name="tiled")
        return c, emb

    return prog


def decoder_with_int_ops() -> Any:
    """Dump D1 (fp16 decoder, CPU_AND_NE): linear, matmul, layer_norm, softmax, concat on
    the NE; casts, select and greater_equal on integer masks, a gather and an integer add on
    the CPU."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 8, 32), dtype=types.fp32),
            mb.TensorSpec(shape=(1, 8), dtype=types.int32),
            mb.TensorSpec(shape=(1, 8), dtype=types.int32),
        ],
        opset_version=_target(),
    )
    def prog(x: Any, ids: Any, lengths: Any) -> Any:
        h = mb.cast(x=x, dtype="fp16", name="in_cast")
        for i in range(3):
            h = mb.linear(x=h, weight=w16(32, 32), bias=w16(32), name=f"layers_{i}_linear")
            h = mb.layer_norm(x=h, axes=[-1], name=f"layers_{i}_norm")
        s = mb.matmul(x=h, y=h, transpose_y=True, name="scores")
        p = mb.softmax(x=s, axis=-1, name="probs")
        both = mb.concat(values=[p, p], axis=-1, name="cat")
        pos = mb.add(x=ids, y=np.int32(1), name="int_add")
        keep = mb.greater_equal(x=pos, y=lengths, name="mask_ge")
        zero = np.zeros((1, 8), dtype=np.float16)
        mask = mb.select(cond=keep, a=zero, b=np.full((1, 8), -1e4, np.float16), name="select")
        rows = mb.gather(x=w16(50, 32), indices=ids, axis=0, name="gather")
        out = mb.cast(x=both, dtype="fp32", name="out_cast")
        return out, mask, rows

    return prog


def topk_head() -> Any:
    """Dump D4 (RF-DETR, CPU_AND_NE): convs on the NE; topk and the expand_dims / tile /
    gather_along_axis that consume its indices on the CPU."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 32, 1, 16), dtype=types.fp16)],
        opset_version=_target(),
    )
    def prog(x: Any) -> Any:
        h = conv_chain(mb, x, 4, 32)
        flat = mb.reshape(x=h, shape=[1, 512], name="flat")
        values, indices = mb.topk(x=flat, k=8, axis=-1, name="topk")
        idx = mb.expand_dims(x=indices, axes=[-1], name="idx_expand")
        idx = mb.tile(x=idx, reps=[1, 1, 2], name="idx_tile")
        boxes = mb.reshape(x=h, shape=[1, 256, 2], name="boxes")
        picked = mb.gather_along_axis(x=boxes, indices=idx, axis=1, name="picked")
        return values, picked

    return prog


def tiny_fp32_matmul() -> Any:
    """Dump D5 (vx-lang/Vx#436): a 4x4 fp32 matmul between casts; all preferred CPU."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(4, 4), dtype=types.fp32)],
        opset_version=_target(),
    )
    def prog(x: Any) -> Any:
        h = mb.cast(x=x, dtype="fp16", name="cast_in")
        h = mb.matmul(x=h, y=w16(4, 4), name="matmul")
        return mb.cast(x=h, dtype="fp32", name="cast_out")

    return prog


def mlp(layers: int, dtype: str = "fp16") -> Any:
    """An MLP of ``layers`` linear+relu layers in fp16 or fp32 (dump D1 fp32 decoder; the
    stablehlo-coreml report: 1-2 layer graphs stay on the CPU, 4 layers reach the NE)."""
    mb, types = _mb(), _types()
    np_dtype = np.float16 if dtype == "fp16" else np.float32
    spec_dtype = types.fp16 if dtype == "fp16" else types.fp32

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 64), dtype=spec_dtype)],
        opset_version=_target(),
    )
    def prog(x: Any) -> Any:
        h = x
        for i in range(layers):
            weight = _RNG.standard_normal((64, 64)).astype(np_dtype)
            h = mb.linear(x=h, weight=weight, name=f"layers_{i}_linear")
            h = mb.relu(x=h, name=f"layers_{i}_relu")
        return h

    return prog


def wide_head(vocab: int = 49152) -> Any:
    """A vocabulary-wide LM head as one linear (the naive baseline's head)."""
    mb, types = _mb(), _types()

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 1, 64), dtype=types.fp16)],
        opset_version=_target(),
    )
    def prog(x: Any) -> Any:
        h = x
        for i in range(3):
            h = mb.linear(x=h, weight=w16(64, 64), name=f"layers_{i}_linear")
        return mb.linear(x=h, weight=w16(vocab, 64), name="lm_head")

    return prog


def save(prog: Any, path: Path) -> Path:
    """Convert a MIL program to an fp16 ML Program package at ``path`` (no model load)."""
    import coremltools as ct

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=_target(),
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    model.save(str(path))
    return path
