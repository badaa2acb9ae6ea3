"""Each MIL kernel against an independent computation in torch (fp64 where it matters), on
random inputs with edge cases: negative axes, broadcasting, odd sizes, masks and defaults."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mil_ops import rand, run, run1

from parity.mil import Evaluator, UnsupportedOpError
from parity.mil.kernels.activations import erf

RTOL = 2e-6


def close(actual: np.ndarray, expected: Any, rtol: float = RTOL, atol: float = 1e-6) -> None:
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected
    assert actual.shape == np.shape(expected)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


# ---- elementwise ------------------------------------------------------------------------------

BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "real_div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "pow": torch.pow,
    "floor_div": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "mod": torch.remainder,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_ops_broadcast(name: str) -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.abs(rand(2, 1, 5, seed=1)) + 0.5
    y = rand(3, 1, seed=2)
    if name == "pow":
        y = np.abs(y)
    out = run1(lambda a, b: getattr(mb, name)(x=a, y=b), x, y)
    close(out, BINARY[name](t(x).double(), t(y).double()).float(), rtol=1e-5)


@pytest.mark.parametrize(
    "name,fn",
    [
        ("equal", torch.eq),
        ("not_equal", torch.ne),
        ("less", torch.lt),
        ("less_equal", torch.le),
        ("greater", torch.gt),
        ("greater_equal", torch.ge),
    ],
)
def test_comparisons(name: str, fn: Any) -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.round(rand(4, 3, seed=3))
    y = np.round(rand(1, 3, seed=4))
    out = run1(lambda a, b: getattr(mb, name)(x=a, y=b), x, y)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, fn(t(x), t(y)).numpy())


def test_logical_ops_and_select() -> None:
    from coremltools.converters.mil import Builder as mb

    a = rand(3, 4, seed=5) > 0
    b = rand(3, 4, seed=6) > 0
    for name, fn in [("logical_and", np.logical_and), ("logical_or", np.logical_or)]:
        out = run1(lambda x, y, n=name: getattr(mb, n)(x=x, y=y), a, b)
        np.testing.assert_array_equal(out, fn(a, b))
    np.testing.assert_array_equal(run1(lambda x: mb.logical_not(x=x), a), ~a)
    x, y = rand(3, 4, seed=7), rand(1, 4, seed=8)
    out = run1(lambda c, p, q: mb.select(cond=c, a=p, b=q), a, x, y)
    close(out, torch.where(t(a), t(x), t(y)))


UNARY = {
    "abs": torch.abs,
    "ceil": torch.ceil,
    "cos": torch.cos,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "floor": torch.floor,
    "round": torch.round,
    "sign": torch.sign,
    "sin": torch.sin,
    "square": torch.square,
    "tanh": torch.tanh,
    "atan": torch.atan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_ops(name: str) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 7, seed=9) * 3
    x[0, :3] = [0.5, -2.5, 1.5]  # ties: MIL rounds half to even, like torch
    out = run1(lambda a: getattr(mb, name)(x=a), x)
    close(out, UNARY[name](t(x).double()).float(), rtol=1e-6)


def test_sqrt_and_epsilon_ops_add_the_epsilon_inside() -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.abs(rand(5, 3, seed=10)) + 1e-3
    close(run1(lambda a: mb.sqrt(x=a), x), torch.sqrt(t(x)))
    close(run1(lambda a: mb.rsqrt(x=a, epsilon=0.5), x), torch.rsqrt(t(x) + 0.5))
    close(run1(lambda a: mb.inverse(x=a, epsilon=0.25), x), 1 / (t(x) + 0.25))
    close(run1(lambda a: mb.log(x=a, epsilon=2.0), x), torch.log(t(x) + 2.0))
    # The defaults: rsqrt 1e-12, inverse 1e-4, log 1e-45.
    close(run1(lambda a: mb.inverse(x=a), x), 1 / (t(x) + 1e-4))


def test_clip_and_threshold() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(4, 4, seed=11)
    close(run1(lambda a: mb.clip(x=a, alpha=-0.5, beta=0.3), x), torch.clamp(t(x), -0.5, 0.3))
    close(run1(lambda a: mb.threshold(x=a, alpha=0.1), x), torch.clamp(t(x), min=0.1))


def test_erf_matches_math_erf() -> None:
    xs = np.linspace(-6, 6, 2001)
    expected = np.array([math.erf(v) for v in xs])
    np.testing.assert_allclose(erf(xs), expected, rtol=0, atol=1.5e-7)


# ---- activations ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION"])
def test_gelu_modes(mode: str) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(4, 33, seed=12) * 4
    x[0, :4] = [-12.0, 12.0, 0.0, -3.0]
    out = run1(lambda a: mb.gelu(x=a, mode=mode), x)
    xd = t(x).double()
    expected = {
        "EXACT": F.gelu(xd),
        "TANH_APPROXIMATION": F.gelu(xd, approximate="tanh"),
        "SIGMOID_APPROXIMATION": xd * torch.sigmoid(1.702 * xd),
    }[mode]
    close(out, expected.float(), rtol=2e-6, atol=1e-7)


def test_gelu_default_mode_is_exact() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 5, seed=13)
    close(run1(lambda a: mb.gelu(x=a), x), F.gelu(t(x).double()).float(), atol=1e-7)


ACTIVATIONS = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "relu6": F.relu6,
    "softplus": F.softplus,
    "softsign": F.softsign,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations(name: str) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 17, seed=14) * 5
    x[0, :2] = [-90.0, 90.0]  # no overflow in sigmoid / softplus
    out = run1(lambda a: getattr(mb, name)(x=a), x)
    close(out, ACTIVATIONS[name](t(x).double()).float(), rtol=2e-6)


def test_parametric_activations() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 3, 4, 2, seed=15)
    close(run1(lambda a: mb.leaky_relu(x=a, alpha=0.2), x), F.leaky_relu(t(x), 0.2))
    close(run1(lambda a: mb.elu(x=a, alpha=0.7), x), F.elu(t(x), 0.7))
    alpha = np.array([0.1, 0.2, 0.3], np.float32)
    close(run1(lambda a: mb.prelu(x=a, alpha=alpha), x), F.prelu(t(x), t(alpha)))
    close(
        run1(lambda a: mb.linear_activation(x=a, alpha=2.0, beta=-1.0), x),
        2 * t(x) - 1,
    )
    close(run1(lambda a: mb.scaled_tanh(x=a, alpha=1.5, beta=0.5), x), 1.5 * torch.tanh(0.5 * t(x)))


# ---- contractions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pad_type,strides,dilations,groups,kernel",
    [
        ("valid", [1, 1], [1, 1], 1, (1, 1)),  # the BC1L projection
        ("valid", [2, 1], [1, 1], 1, (3, 2)),
        ("same", [1, 1], [1, 2], 1, (3, 3)),
        ("same", [2, 2], [1, 1], 1, (2, 4)),  # even kernel: odd padding pixel at the end
        ("same_lower", [1, 1], [1, 1], 1, (2, 2)),  # ... or at the beginning
        ("custom", [1, 1], [1, 1], 2, (3, 1)),
        ("valid", [1, 1], [1, 1], 6, (1, 3)),  # depthwise
    ],
)
def test_conv2d(
    pad_type: str, strides: list[int], dilations: list[int], groups: int, kernel: tuple[int, int]
) -> None:
    from coremltools.converters.mil import Builder as mb

    c_in, c_out = 6, 12
    x = rand(2, c_in, 7, 9, seed=16)
    w = rand(c_out, c_in // groups, *kernel, seed=17)
    b = rand(c_out, seed=18)
    pad = [1, 2, 0, 1]
    out = run1(
        lambda a: mb.conv(
            x=a,
            weight=w,
            bias=b,
            strides=strides,
            pad_type=pad_type,
            pad=pad,
            dilations=dilations,
            groups=groups,
        ),
        x,
    )
    xt = t(x).double()
    if pad_type == "custom":
        xt = F.pad(xt, (pad[2], pad[3], pad[0], pad[1]))
    elif pad_type in ("same", "same_lower"):
        widths = []
        for size, k, s, d in zip(x.shape[2:], kernel, strides, dilations, strict=True):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            lo, hi = total // 2, total - total // 2
            widths.append((lo, hi) if pad_type == "same" else (hi, lo))
        xt = F.pad(xt, (*widths[1], *widths[0]))
    expected = F.conv2d(
        xt, t(w).double(), t(b).double(), stride=strides, dilation=dilations, groups=groups
    )
    close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_conv1d_without_bias() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(1, 4, 11, seed=19)
    w = rand(5, 4, 3, seed=20)
    out = run1(lambda a: mb.conv(x=a, weight=w, pad_type="valid", strides=[2]), x)
    close(out, F.conv1d(t(x).double(), t(w).double(), stride=2).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "xs,ys,tx,ty",
    [
        ((2, 3, 5, 4), (4, 7), False, False),
        ((2, 1, 4, 5), (3, 4, 7), True, False),
        ((5, 4), (2, 6, 4), False, True),
        ((4,), (4, 2), False, False),  # a rank-1 operand follows numpy
    ],
)
def test_matmul(xs: tuple[int, ...], ys: tuple[int, ...], tx: bool, ty: bool) -> None:
    from coremltools.converters.mil import Builder as mb

    x, y = rand(*xs, seed=21), rand(*ys, seed=22)
    out = run1(lambda a, b: mb.matmul(x=a, y=b, transpose_x=tx, transpose_y=ty), x, y)
    xt, yt = t(x).double(), t(y).double()
    if tx:
        xt = xt.transpose(-1, -2)
    if ty:
        yt = yt.transpose(-1, -2)
    close(out, torch.matmul(xt, yt).float(), rtol=1e-5, atol=1e-5)


def test_linear_with_and_without_bias() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 5, 6, seed=23)
    w, b = rand(3, 6, seed=24), rand(3, seed=25)
    close(run1(lambda a: mb.linear(x=a, weight=w, bias=b), x), F.linear(t(x), t(w), t(b)))
    close(run1(lambda a: mb.linear(x=a, weight=w), x), F.linear(t(x), t(w)), atol=1e-5)


@pytest.mark.parametrize(
    "equation,sa,sb",
    [
        ("bkhc,bchq->bkhq", (2, 5, 1, 3), (2, 3, 1, 7)),  # BC1L scores: key on axis 1
        ("bchk,bkhq->bchq", (2, 3, 1, 5), (2, 5, 1, 7)),  # BC1L weighted values
        ("nchw,nwhu->nchu", (1, 4, 2, 3), (3, 3, 1, 5)),  # B and H broadcast
        ("chw,whr->chr", (4, 2, 3), (3, 2, 5)),
        ("abcd,adce->abce", (2, 4, 1, 3), (2, 3, 6, 5)),  # other letters, same layout
    ],
)
def test_einsum(equation: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    from coremltools.converters.mil import Builder as mb

    a, b = rand(*sa, seed=26), rand(*sb, seed=27)
    out = run1(lambda x, y: mb.einsum(values=(x, y), equation=equation), a, b)
    close(out, torch.einsum(equation, t(a).double(), t(b).double()).float(), rtol=1e-5, atol=1e-6)


# ---- normalization and reductions -------------------------------------------------------------


@pytest.mark.parametrize("axis", [1, -1, -3, 0])
def test_softmax_axes(axis: int) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 5, 1, 7, seed=28) * 10
    x[0, 0, 0, :] = 80.0  # large equal values: the max shift keeps exp finite
    out = run1(lambda a: mb.softmax(x=a, axis=axis), x)
    close(out, torch.softmax(t(x).double(), dim=axis).float(), rtol=1e-5, atol=1e-7)


def test_softmax_with_a_finite_mask_gives_exact_zeros() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(1, 4, 1, 4, seed=29)
    x[0, 2:, 0, :] -= 1e4
    out = run1(lambda a: mb.softmax(x=a, axis=1), x)
    assert (out[0, 2:] == 0).all()
    close(out, torch.softmax(t(x).double(), dim=1).float(), atol=1e-7)


@pytest.mark.parametrize("axes", [[-1], [1], [-2, -1]])
def test_layer_norm(axes: list[int]) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 6, 1, 5, seed=30) * 3 + 1
    shape = [x.shape[a] for a in axes]
    gamma, beta = rand(*shape, seed=31), rand(*shape, seed=32)
    out = run1(lambda a: mb.layer_norm(x=a, axes=axes, gamma=gamma, beta=beta, epsilon=1e-3), x)
    xd = t(x).double()
    mean = xd.mean(dim=axes, keepdim=True)
    var = ((xd - mean) ** 2).mean(dim=axes, keepdim=True)
    full = [x.shape[i] if i in [a % x.ndim for a in axes] else 1 for i in range(x.ndim)]
    expected = (xd - mean) / torch.sqrt(var + 1e-3) * t(gamma).double().reshape(full)
    expected = expected + t(beta).double().reshape(full)
    close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_layer_norm_without_affine_matches_torch() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 8, seed=33)
    out = run1(lambda a: mb.layer_norm(x=a, axes=[-1], epsilon=1e-5), x)
    close(out, F.layer_norm(t(x).double(), (8,), eps=1e-5).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_matches_torch(affine: bool) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 4, 3, 5, seed=34)
    mean, var = rand(4, seed=35), np.abs(rand(4, seed=36)) + 0.5
    gamma, beta = (rand(4, seed=37), rand(4, seed=38)) if affine else (None, None)
    kwargs = {"gamma": gamma, "beta": beta} if affine else {}
    out = run1(lambda a: mb.batch_norm(x=a, mean=mean, variance=var, epsilon=1e-3, **kwargs), x)
    w, b = (t(gamma).double(), t(beta).double()) if affine else (None, None)
    expected = F.batch_norm(t(x).double(), t(mean).double(), t(var).double(), w, b, eps=1e-3)
    close(out, expected.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_matches_torch(affine: bool) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 4, 3, 5, seed=39) * 2 + 1
    gamma, beta = (rand(4, seed=40), rand(4, seed=41)) if affine else (None, None)
    kwargs = {"gamma": gamma, "beta": beta} if affine else {}
    out = run1(lambda a: mb.instance_norm(x=a, epsilon=1e-3, **kwargs), x)
    w, b = (t(gamma).double(), t(beta).double()) if affine else (None, None)
    expected = F.instance_norm(t(x).double(), weight=w, bias=b, eps=1e-3)
    close(out, expected.float(), rtol=1e-5, atol=1e-6)


REDUCTIONS = {
    "reduce_sum": lambda x, d, k: x.sum(dim=d, keepdim=k),
    "reduce_mean": lambda x, d, k: x.mean(dim=d, keepdim=k),
    "reduce_max": lambda x, d, k: x.amax(dim=d, keepdim=k),
    "reduce_min": lambda x, d, k: x.amin(dim=d, keepdim=k),
    "reduce_prod": lambda x, d, k: x.abs().add(0.5).log().sum(dim=d, keepdim=k).exp(),
    "reduce_sum_square": lambda x, d, k: (x * x).sum(dim=d, keepdim=k),
    "reduce_l1_norm": lambda x, d, k: x.abs().sum(dim=d, keepdim=k),
    "reduce_l2_norm": lambda x, d, k: (x * x).sum(dim=d, keepdim=k).sqrt(),
    "reduce_log_sum": lambda x, d, k: x.abs().sum(dim=d, keepdim=k).log(),
    "reduce_log_sum_exp": lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("axes,keep", [([1], True), ([-1, 0], False), (None, False)])
def test_reductions(name: str, axes: list[int] | None, keep: bool) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 5, 7, seed=34)
    if name == "reduce_prod":
        x = np.abs(x) + 0.5
    if name == "reduce_log_sum":
        x = np.abs(x)
    out = run1(lambda a: getattr(mb, name)(x=a, axes=axes, keep_dims=keep), x)
    dims = tuple(range(3)) if axes is None else tuple(axes)
    expected = REDUCTIONS[name](t(x).double(), dims, keep)
    if name == "reduce_prod":
        expected = t(x).double().prod(dim=dims[0], keepdim=keep) if len(dims) == 1 else expected
        if len(dims) > 1:
            expected = t(x).double()
            for d in sorted((d % 3 for d in dims), reverse=True):
                expected = expected.prod(dim=d, keepdim=keep)
    close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_argmax_argmin_first_index_on_ties() -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.array([[1, 3, 3, 0], [2, 2, -1, -1]], np.float32)
    out = run1(lambda a: mb.reduce_argmax(x=a, axis=-1, keep_dims=False), x)
    np.testing.assert_array_equal(out, [1, 0])
    out = run1(lambda a: mb.reduce_argmin(x=a, axis=1, keep_dims=True), x)
    np.testing.assert_array_equal(out, [[3], [2]])
    assert out.dtype == np.int32


def test_topk_largest_first_ties_in_index_order_as_torch() -> None:
    """io.output: topk: values largest first, ties to the lower index, indices as declared."""
    from coremltools.converters.mil import Builder as mb

    x = np.array([[1, 3, 3, 0, 5], [2, 2, -1, 7, -1]], np.float32)
    values, index = run(lambda a: mb.topk(x=a, k=3, axis=-1, output_indices_dtype="uint16"), x)
    np.testing.assert_array_equal(values, [[5, 3, 3], [7, 2, 2]])
    np.testing.assert_array_equal(index, [[4, 1, 2], [3, 0, 1]])
    assert index.dtype == np.uint16
    y = rand(2, 3, 1, 40, seed=36)
    want_v, want_i = torch.topk(t(y), 5, dim=-1)
    got_v, got_i = run(lambda a: mb.topk(x=a, k=5, axis=-1), y)
    np.testing.assert_array_equal(got_v, want_v.numpy())
    np.testing.assert_array_equal(got_i, want_i.numpy())
    smallest, _ = run(lambda a: mb.topk(x=a, k=2, axis=1, ascending=True), x)
    np.testing.assert_array_equal(smallest, [[0, 1], [-1, -1]])


# ---- layout -----------------------------------------------------------------------------------


def test_reshape_infers_minus_one_and_copies_zero() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 6, 1, 5, seed=35)
    close(run1(lambda a: mb.reshape(x=a, shape=[-1, 3, 2, 5]), x), t(x).reshape(-1, 3, 2, 5))
    # iOS 17: each 0 copies the input dim aligned from the right (here 6 and 5).
    close(run1(lambda a: mb.reshape(x=a, shape=[0, -1, 0]), x), t(x).reshape(6, 2, 5))


def test_transpose_squeeze_expand_dims() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 1, 3, 1, seed=36)
    close(run1(lambda a: mb.transpose(x=a, perm=[0, -1, 2, 1]), x), t(x).permute(0, 3, 2, 1))
    close(run1(lambda a: mb.squeeze(x=a, axes=[-1]), x), t(x).squeeze(-1))
    close(run1(lambda a: mb.squeeze(x=a), x), t(x).squeeze())
    close(run1(lambda a: mb.expand_dims(x=a, axes=[-1, 0]), x), t(x)[None, ..., None])


@pytest.mark.parametrize("interleave", [False, True])
def test_concat(interleave: bool) -> None:
    from coremltools.converters.mil import Builder as mb

    a, b = rand(2, 3, 4, seed=37), rand(2, 3, 4, seed=38)
    out = run1(lambda x, y: mb.concat(values=(x, y), axis=-2, interleave=interleave), a, b)
    if interleave:
        expected = torch.stack([t(a), t(b)], dim=2).reshape(2, 6, 4)
    else:
        expected = torch.cat([t(a), t(b)], dim=-2)
    close(out, expected)


def test_split_by_sizes_and_by_count() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 9, 1, 4, seed=39)
    outs = run(lambda a: mb.split(x=a, split_sizes=[2, 3, 4], axis=1), x)
    for o, e in zip(outs, t(x).split([2, 3, 4], dim=1), strict=True):
        close(o, e)
    outs = run(lambda a: mb.split(x=a, num_splits=2, axis=-1), x)
    for o, e in zip(outs, t(x).chunk(2, dim=-1), strict=True):
        close(o, e)


def test_slice_by_index_with_masks_strides_and_negative_indices() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(4, 7, 5, seed=40)
    out = run1(
        lambda a: mb.slice_by_index(
            x=a,
            begin=[1, -6, 0],
            end=[3, -1, 4],
            stride=[1, 2, -1],
            begin_mask=[False, False, True],
            end_mask=[False, False, False],
            squeeze_mask=[False, False, False],
        ),
        x,
    )
    close(out, x[1:3, -6:-1:2, :4:-1])
    out = run1(
        lambda a: mb.slice_by_index(
            x=a, begin=[0, 2, 0], end=[4, 3, 5], squeeze_mask=[False, True, False]
        ),
        x,
    )
    close(out, x[:, 2, :])


def test_slice_by_size() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 8, 2, seed=41)
    close(
        run1(lambda a: mb.slice_by_size(x=a, begin=[1, 2, 0], size=[2, -1, 1]), x), x[1:3, 2:, 0:1]
    )


def test_tile_and_stack() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(2, 3, seed=42)
    close(run1(lambda a: mb.tile(x=a, reps=[2, 3]), x), t(x).repeat(2, 3))
    close(run1(lambda a: mb.stack(values=(a, a), axis=-1), x), torch.stack([t(x)] * 2, dim=-1))


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad_modes(mode: str) -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(1, 2, 5, 6, seed=43)
    pad = [1, 2, 3, 0]  # (begin, end) for the last two axes
    out = run1(lambda a: mb.pad(x=a, pad=np.array(pad, np.int32), mode=mode, constant_val=0.5), x)
    widths = (pad[2], pad[3], pad[0], pad[1])
    if mode == "constant":
        expected = F.pad(t(x), widths, mode=mode, value=0.5)
    else:
        expected = F.pad(t(x), widths, mode=mode)
    close(out, expected)


# ---- gathers and casts ------------------------------------------------------------------------


def test_gather_negative_axis_negative_indices_and_batch_dims() -> None:
    from coremltools.converters.mil import Builder as mb

    table = rand(10, 4, seed=44)
    ids = np.array([[0, 9, -1], [3, -10, 5]], np.int32)
    out = run1(lambda a, i: mb.gather(x=a, indices=i, axis=0), table, ids)
    close(out, F.embedding(t(ids) % 10, t(table)))
    out = run1(lambda a, i: mb.gather(x=a, indices=i, axis=-1), table, ids[:, :2] % 4)
    close(out, t(table)[:, t(ids[:, :2] % 4)])
    x = rand(2, 5, 3, seed=45)
    idx = np.array([[4, 0], [1, 1]], np.int32)
    out = run1(lambda a, i: mb.gather(x=a, indices=i, axis=1, batch_dims=1), x, idx)
    close(out, torch.stack([t(x)[b, t(idx[b])] for b in range(2)]))


def test_gather_out_of_range_is_an_error_naming_the_op() -> None:
    from coremltools.converters.mil import Builder as mb

    with pytest.raises(Exception, match="gather"):
        run1(lambda a, i: mb.gather(x=a, indices=i, axis=0), rand(4, 2), np.array([4], np.int32))


def test_gather_along_axis_and_gather_nd() -> None:
    from coremltools.converters.mil import Builder as mb

    x = rand(3, 5, seed=46)
    idx = np.array([[0, 4], [2, 2], [-1, 1]], np.int32)
    out = run1(lambda a, i: mb.gather_along_axis(x=a, indices=i, axis=1), x, idx)
    close(out, torch.gather(t(x), 1, t(idx % 5).long()))
    idx_nd = np.array([[0, 1], [2, 4]], np.int32)
    out = run1(lambda a, i: mb.gather_nd(x=a, indices=i), x, idx_nd)
    close(out, t(x)[t(idx_nd[:, 0]).long(), t(idx_nd[:, 1]).long()])


def test_cast_truncates_toward_zero_and_rounds_to_fp16() -> None:
    from coremltools.converters.mil import Builder as mb

    x = np.array([[-2.7, -0.5, 0.5, 2.7, 1e-8, 70000.0]], np.float32)
    out = run1(lambda a: mb.cast(x=a, dtype="int32"), x[:, :4])
    np.testing.assert_array_equal(out, t(x[:, :4]).to(torch.int32).numpy())
    out = run1(lambda a: mb.cast(x=a, dtype="fp16"), x, profile="fp16")
    np.testing.assert_array_equal(out, t(x).half().float().numpy())  # 1e-8 -> 0, 7e4 -> inf
    assert np.isinf(out[0, -1])
    # In the fp32 profile every value stays fp32, casts to fp16 included.
    np.testing.assert_array_equal(run1(lambda a: mb.cast(x=a, dtype="fp16"), x), x)


def test_int_arithmetic_stays_integer() -> None:
    from coremltools.converters.mil import Builder as mb

    ids = np.array([[0, -3, 7]], np.int32)
    out = run1(lambda i: mb.select(cond=mb.greater_equal(x=i, y=0), a=i, b=mb.add(x=i, y=10)), ids)
    np.testing.assert_array_equal(out, [[0, 7, 7]])
    assert out.dtype == np.int32


# ---- errors -----------------------------------------------------------------------------------


def test_an_unknown_op_is_an_error_naming_the_type_and_the_op() -> None:
    from coremltools.converters.mil import Builder as mb
    from mil_ops import program

    prog = program(lambda a: mb.cumsum(x=a, axis=0, name="my_cumsum"), rand(3))
    with pytest.raises(UnsupportedOpError, match=r"'cumsum'.*'my_cumsum'"):
        Evaluator(prog, "fp32")
