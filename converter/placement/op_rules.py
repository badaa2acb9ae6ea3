"""The op rules of the placement table: CPU-bound op types first, then the NE op families.

``converter.placement.rules`` tries them after the program and global rules, in this order: inside
the op stage the first matching rule decides. Sources as in ``converter.placement.rules``.
"""

from __future__ import annotations

from converter.placement.conditions import (
    block_weights,
    conv_kernel,
    op_types,
)
from converter.placement.rule_model import Rule

_EW = (
    "add sub mul real_div floor_div maximum minimum pow square sqrt rsqrt inverse exp exp2 log "
    "abs clip neg sign floor ceil round threshold"
)
_ACT = (
    "relu relu6 silu sigmoid sigmoid_hard tanh leaky_relu softplus softsign gelu erf elu prelu "
    "scaled_tanh linear_activation clamped_relu thresholded_relu"
)
_NORM = (
    "layer_norm batch_norm instance_norm l2_norm local_response_norm reduce_mean reduce_sum "
    "reduce_max reduce_min reduce_sum_square reduce_l2_norm reduce_l1_norm reduce_log_sum "
    "reduce_log_sum_exp"
)
_SHAPE = (
    "reshape transpose concat split slice_by_index slice_by_size expand_dims squeeze stack tile "
    "pad identity space_to_depth depth_to_space pixel_shuffle"
)
_NOPATH = (
    "scatter scatter_nd scatter_along_axis one_hot band_part non_zero reverse_sequence mod "
    "logical_and logical_or logical_xor logical_not reduce_prod random_bernoulli "
    "random_categorical random_normal random_uniform range_1d shape sliding_windows tan asin "
    "acos atan atanh asinh acosh sinh cosh non_maximum_suppression make_list list_read "
    "list_write list_gather list_scatter list_length fill fill_like"
)

OP_RULES: tuple[Rule, ...] = (
    # --- op rules: CPU-bound op types first, then the NE op families
    Rule(
        "O-CAST",
        "op",
        "cast",
        "CPU",
        "high",
        "dumps D1, D2, D5, vx-lang/Vx#436 (every cast preferred CPU); apple/coremltools#1984",
        "use fp16 model I/O (io.dtype: float16) so no boundary cast is needed; do integer to "
        "float conversions on the host",
        op_types("cast"),
    ),
    Rule(
        "O-GATHER",
        "op",
        "gather, gather_nd, gather_along_axis (embedding lookups, position-table indexing)",
        "CPU",
        "high",
        "apple/ml-ane-transformers README (the 4 CPU ops are the embedding lookup); dumps D1, "
        "D2, D4; ane-guide ch.18 (no engine cost tree for gather)",
        "gather embedding rows on the host (io.inputs: embeddings); compute position tables "
        "before tracing for the fixed shape",
        op_types("gather", "gather_nd", "gather_along_axis"),
    ),
    Rule(
        "O-TOPK",
        "op",
        "topk, argsort, reduce_argmax, reduce_argmin",
        "CPU",
        "high",
        "dump D4 (roboflow/rf-detr PR #1495: topk and the ops consuming its indices on the "
        "CPU); ane-guide ch.18 (argmax has no engine tree)",
        "take top-k or the argmax on the host from the returned logits",
        op_types("topk", "argsort", "reduce_argmax", "reduce_argmin"),
    ),
    Rule(
        "O-SLUPD",
        "op",
        "a standalone slice_update",
        "CPU",
        "medium",
        "Anemll/anemll-profile README (Cannot support standalone slice_update)",
        "write the slice with concat of slices, or keep the update on the host",
        op_types("slice_update"),
    ),
    Rule(
        "O-NOPATH",
        "op",
        "ops with no NE path: scatter, one_hot, band_part, non_zero, mod, logical ops, "
        "random ops, range_1d, shape, fill, inverse trig, NMS, list ops",
        "CPU",
        "medium",
        "ane-guide appendix A (no path, decompose on host); smpanaro NOTES (band_part)",
        "precompute the value before tracing (fixed shapes) or do it on the host",
        op_types(*_NOPATH.split()),
    ),
    Rule(
        "O-RNN",
        "op",
        "lstm, gru, rnn",
        "CPU",
        "high",
        "apple/coremltools#1780 (maintainer: RNN/LSTM not supported on the NE); #337",
        "replace the recurrence by attention or convolution, or run it on the CPU on purpose",
        op_types("lstm", "gru", "rnn"),
    ),
    Rule(
        "O-CUMSUM",
        "op",
        "cumsum",
        "CPU",
        "low",
        "ane-guide appendix A (native only on a curated runtime path)",
        "express the running sum as a matmul with a constant triangular matrix",
        op_types("cumsum"),
    ),
    Rule(
        "O-TRIG-M1M2",
        "op",
        "sin, cos on chips without native trig (M1, M2)",
        "CPU",
        "low",
        "ane-guide appendix A (sin/cos family-gated to A15/M3)",
        "precompute cos/sin tables before tracing (RoPE) for the fixed shape",
        op_types("sin", "cos"),
        chips=frozenset({"M1", "M2"}),
    ),
    Rule(
        "O-TRIG",
        "op",
        "sin, cos from M3 / A17 Pro",
        "NE",
        "low",
        "ane-guide appendix A (native from A15/M3, direct path)",
        "",
        op_types("sin", "cos"),
    ),
    Rule(
        "O-RESIZE-M1",
        "op",
        "upsample / resize / crop_resize on M1 (no texture engine)",
        "CPU",
        "low",
        "ane-guide appendix A (texture engine from A14/M2; software fallback on M1)",
        "resize on the host or with a transposed conv",
        op_types(
            "upsample_nearest_neighbor",
            "upsample_bilinear",
            "resize",
            "resize_bilinear",
            "resize_nearest_neighbor",
            "crop_resize",
        ),
        chips=frozenset({"M1"}),
    ),
    Rule(
        "O-CONV-LIM-M1",
        "op",
        "conv kernel wider than 13 on M1",
        "CPU",
        "medium",
        "ane-guide ch.17 (a kernel of width 14 rejects) and appendix A; dump D1 (HiFiGAN convs "
        "on the CPU)",
        "split the kernel into narrower convs, or fold the width into channels",
        conv_kernel(13),
        chips=frozenset({"M1"}),
    ),
    Rule(
        "O-CONV-LIM",
        "op",
        "conv kernel wider than 16",
        "CPU",
        "medium",
        "ane-guide ch.17 and appendix A (15-16 on later chips); coreai rules (avoid large "
        "kernels along width)",
        "split the kernel into narrower convs, or fold the width into channels",
        conv_kernel(16),
    ),
    Rule(
        "O-BLOCKW",
        "op",
        "conv / linear / matmul whose weight is per-block integers (blocks along the inputs)",
        "CPU",
        "medium",
        "ane_rules.md O-BLOCK4 (coremltools opt-quantization-perf.md: per-block is for the "
        "GPU, per-channel on the NE); anchors_style.md quantization pitfalls (coremltools#2510 "
        "'ANE only support per-cout/per-tensor quantization'; apple/coreai-models#279: "
        "per-block on the ANE, cosine 0.367); dump D3 (constexpr_blockwise_shift_scale among "
        "executorch's non-ANE ops). Conflict: ane-guide appendix A (blockwise streams natively "
        "from M3), one source, not applied",
        "store the weight per output channel (method int8 or gptq) or as palettes (lut, skm); "
        "a per-block variant (method grid) saves storage, not NE time",
        block_weights,
    ),
    Rule(
        "O-CONV",
        "op",
        "conv, conv_transpose",
        "NE",
        "high",
        "dumps D1 (conv 11/11 NE), D2 (102/102); coreai rules (1x1 Conv2d)",
        "",
        op_types("conv", "conv_transpose"),
    ),
    Rule(
        "O-MM",
        "op",
        "linear, matmul, einsum",
        "NE",
        "high",
        "dumps D1 (linear 28, matmul 12 NE), D2 (matmul 12); apple/ml-ane-transformers "
        "multihead_attention.py",
        "",
        op_types("linear", "matmul", "einsum"),
    ),
    Rule(
        "O-EW",
        "op",
        "fp16 elementwise arithmetic",
        "NE",
        "high",
        "dump D2 (mul 224, add 101, rsqrt 45 on the NE); dump D1; ane-guide appendix A",
        "",
        op_types(*_EW.split()),
    ),
    Rule(
        "O-ACT",
        "op",
        "activations (relu, silu, sigmoid, tanh, gelu, erf, ...)",
        "NE",
        "high",
        "dumps D1 (relu, tanh), D2 (silu 16); ane-guide appendix A (gelu/erf by look-up "
        "table: medium for those)",
        "",
        op_types(*_ACT.split()),
    ),
    Rule(
        "O-NORM",
        "op",
        "norms and reductions",
        "NE",
        "high",
        "dumps D1 (layer_norm 9, batch_norm 4), D2 (reduce_mean 45); ane-guide appendix A",
        "",
        op_types(*_NORM.split()),
    ),
    Rule(
        "O-SOFTMAX",
        "op",
        "softmax",
        "NE",
        "high",
        "dumps D1 (softmax 6 NE), D2 (6)",
        "",
        op_types("softmax"),
    ),
    Rule(
        "O-SHAPE",
        "op",
        "reshape, transpose, concat, split, slices, expand_dims, squeeze, stack, tile, pad",
        "NE",
        "high",
        "dumps D1 (reshape 48, transpose 32, concat 6, slice_by_index 5), D2 (pad, split, "
        "tile, concat)",
        "",
        op_types(*_SHAPE.split()),
    ),
    Rule(
        "O-POOL",
        "op",
        "avg_pool, max_pool, l2_pool",
        "NE",
        "medium",
        "hollance unsupported-layers.md; coreai rules; ane-guide appendix A",
        "",
        op_types("avg_pool", "max_pool", "l2_pool"),
    ),
    Rule(
        "O-RESIZE",
        "op",
        "upsample / resize / crop_resize from M2 (texture engine)",
        "NE",
        "low",
        "ane-guide appendix A; hollance unsupported-layers.md",
        "",
        op_types(
            "upsample_nearest_neighbor",
            "upsample_bilinear",
            "resize",
            "resize_bilinear",
            "resize_nearest_neighbor",
            "crop_resize",
        ),
    ),
    Rule(
        "O-W8A8",
        "op",
        "quantize / dequantize of activations (W8A8)",
        "NE",
        "medium",
        "coremltools opt-quantization-overview.md, opt-joint-compression.md (faster int8 path "
        "from A17 Pro / M4)",
        "",
        op_types("quantize", "dequantize"),
    ),
    Rule(
        "O-SDPA",
        "op",
        "fused scaled_dot_product_attention (iOS18)",
        "NE",
        "low",
        "ane-guide (sdpa native, direct path); coreai rules say there is no fused SDPA path "
        "on the NE (Core AI): uncertain",
        "prefer matmul + softmax + matmul, which the dumps place on the NE",
        op_types("scaled_dot_product_attention"),
    ),
    Rule(
        "O-STATE",
        "op",
        "read_state, write_state, coreml_update_state (stateful KV cache)",
        "NE",
        "low",
        "Anemll llama_converter.py (fp16 state on the NE); apple/coremltools#2631, #2553 and "
        "dump D2 (stateful decode fails to compile on the NE, status 0x1d)",
        "keep the KV cache as explicit inputs and outputs, state dims a multiple of 32",
        op_types("read_state", "write_state", "coreml_update_state"),
    ),
)
