"""conv2d / conv_transpose2d and their backward passes against PyTorch (a
seeded randomized sweep), central differences, a naive loop reference, edge
shapes and every error path."""
import math
import random
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastconv
import fastconv.conv
from fastconv import conv2d, conv2d_backward, conv_transpose2d, conv_transpose2d_backward
from reference import VECTOR_BYTES, at_line_offset, explicit_pads, has_short_m

LAYOUTS = ("NHWC", "NCHW")
DTYPES = (np.float64, np.float32)
MODES = ("zeros", "reflect", "replicate", "circular")
PADDING_FORMS = ("int", "pair", "sides", "valid", "same")
# How the arrays handed to fastconv are laid out in memory.
MEMORY = ("contiguous", "strided", "permuted")


# ----------------------------------------------------------------- helpers

def random_padding(form, rng):
    return {"int": rng.randint(0, 3),
            "pair": (rng.randint(0, 3), rng.randint(0, 3)),
            "sides": ((rng.randint(0, 3), rng.randint(0, 3)),
                      (rng.randint(0, 3), rng.randint(0, 3))),
            "valid": "valid", "same": "same"}[form]


def in_memory(a, memory):
    """a's values in the given memory layout (never a contiguous ndarray
    unless memory == "contiguous")."""
    if memory == "contiguous":
        return np.ascontiguousarray(a)
    if memory == "strided":
        # Every other row of a NaN-filled buffer, the last axis but one
        # reversed: any read outside the view would poison the result.
        big = np.full((a.shape[0], 2 * a.shape[1], *a.shape[2:]), np.nan, a.dtype)
        big[:, ::2] = a[:, :, ::-1]
        return big[:, ::2, ::-1]
    # Axes 1 and 3 swap places in memory: channel-major for NHWC arrays,
    # channels-last for NCHW ones.
    return np.ascontiguousarray(a.transpose(0, 3, 2, 1)).transpose(0, 3, 2, 1)


def to_torch(a, layout):
    """float64 NCHW tensor of an array in the given layout."""
    a = np.array(a, dtype=np.float64)
    return torch.from_numpy(np.ascontiguousarray(a if layout == "NCHW"
                                                 else a.transpose(0, 3, 1, 2)))


def from_torch(t, layout):
    a = t.detach().numpy()
    return a if layout == "NCHW" else a.transpose(0, 2, 3, 1)


def assert_close(actual, expected, dtype, reduction, what, scale=None):
    """float64 to 1e-10 of max |expected| (or of scale); float32 to
    1e-6*sqrt(reduction length), the growth of a float32 sum's rounding
    error."""
    assert actual.dtype == dtype, what
    assert actual.shape == expected.shape, what
    if expected.size == 0:
        return
    rtol = 1e-10 if dtype == np.float64 else 1e-6 * math.sqrt(max(reduction, 1))
    scale = max(np.abs(expected).max() if scale is None else scale, 1e-300)
    err = np.abs(actual.astype(np.float64) - expected).max()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:.3g} * {scale:.3g}"


def shaped(nhwc, layout):
    n, h, w, c = nhwc
    return nhwc if layout == "NHWC" else (n, c, h, w)


# -------------------------------------------------------------- the sweep

class ConvCase(NamedTuple):
    layout: str
    dtype: type
    padding: object
    padding_mode: str
    memory: str
    N: int
    H: int
    W: int
    C: int
    OC: int
    groups: int
    kernel: tuple
    stride: tuple
    dilation: tuple
    bias: bool
    small_chunks: bool
    seed: int

    def __str__(self):
        return (f"{self.layout}-{np.dtype(self.dtype).name}-p{self.padding}-{self.padding_mode}-"
                f"{self.memory}-{self.N}x{self.H}x{self.W}x{self.C}-oc{self.OC}-g{self.groups}-"
                f"k{self.kernel}-s{self.stride}-d{self.dilation}"
                f"{'-bias' if self.bias else ''}{'-chunked' if self.small_chunks else ''}"
                ).replace(" ", "").replace("'", "")


def random_channels(rng):
    """(C, OC, groups): dense, grouped or depthwise (with multiplier)."""
    kind = rng.choice(("dense", "dense", "grouped", "depthwise"))
    if kind == "dense":
        return rng.randint(1, 8), rng.randint(1, 8), 1
    groups = rng.randint(2, 4) if kind == "grouped" else rng.randint(2, 8)
    cg = rng.randint(1, 3) if kind == "grouped" else 1
    return groups * cg, groups * rng.randint(1, 3), groups


def conv2d_cases(count, seed):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        i = len(cases)
        # Categorical options cycle with coprime periods so that every
        # combination of padding form, mode and layout occurs.
        form, mode = PADDING_FORMS[i % 5], MODES[(i // 10) % 4]
        layout, dtype, memory = LAYOUTS[i % 2], DTYPES[(i // 2) % 2], MEMORY[i % 3]
        C, OC, groups = random_channels(rng)
        kernel = (rng.choice((1, 1, 2, 3, 3, 5, 7)), rng.choice((1, 2, 3, 3, 5, 7)))
        if rng.random() < 0.15:
            kernel = (kernel[0],) * 2
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        dilation = (rng.choice((1, 1, 2, 3)), rng.choice((1, 1, 2, 3)))
        padding = random_padding(form, rng)
        H, W = rng.randint(1, 15), rng.randint(1, 15)
        pads = explicit_pads(padding, (H, W), kernel, stride, dilation)
        if any(n + lo + hi < (k - 1) * d + 1
               for n, (lo, hi), k, d in zip((H, W), pads, kernel, dilation)):
            continue
        if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, (H, W))):
            continue
        if mode == "circular" and any(max(p) > n for p, n in zip(pads, (H, W))):
            continue
        cases.append(ConvCase(layout, dtype, padding, mode, memory, rng.choice((1, 1, 2, 3)),
                              H, W, C, OC, groups, kernel, stride, dilation,
                              rng.random() < 0.7, i % 9 == 4, rng.randrange(2**32)))
    return cases


class TransposeCase(NamedTuple):
    layout: str
    dtype: type
    padding: object
    output_padding: tuple
    memory: str
    N: int
    H: int
    W: int
    C: int
    OC: int
    groups: int
    kernel: tuple
    stride: tuple
    dilation: tuple
    bias: bool
    small_chunks: bool
    seed: int

    def __str__(self):
        return (f"{self.layout}-{np.dtype(self.dtype).name}-p{self.padding}-"
                f"op{self.output_padding}-{self.memory}-{self.N}x{self.H}x{self.W}x{self.C}-"
                f"oc{self.OC}-g{self.groups}-k{self.kernel}-s{self.stride}-d{self.dilation}"
                f"{'-bias' if self.bias else ''}{'-chunked' if self.small_chunks else ''}"
                ).replace(" ", "").replace("'", "")


def conv_transpose2d_cases(count, seed):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        i = len(cases)
        form = ("int", "pair", "sides")[i % 3]
        layout, dtype, memory = LAYOUTS[i % 2], DTYPES[(i // 2) % 2], MEMORY[(i // 4) % 3]
        C, OC, groups = random_channels(rng)
        kernel = (rng.choice((1, 2, 3, 3, 5, 7)), rng.choice((1, 2, 3, 4, 5)))
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        dilation = (rng.choice((1, 1, 2, 3)), rng.choice((1, 1, 2, 3)))
        output_padding = tuple(rng.randrange(max(s, d)) for s, d in zip(stride, dilation))
        padding = random_padding(form, rng)
        H, W = rng.randint(1, 9), rng.randint(1, 9)
        pads = explicit_pads(padding, (H, W), kernel, stride, dilation)
        if any((n - 1) * s - lo - hi + (k - 1) * d + op + 1 < 1 for n, s, (lo, hi), k, d, op
               in zip((H, W), stride, pads, kernel, dilation, output_padding)):
            continue
        cases.append(TransposeCase(layout, dtype, padding, output_padding, memory,
                                   rng.choice((1, 1, 2, 3)), H, W, C, OC, groups, kernel, stride,
                                   dilation, rng.random() < 0.7, i % 7 == 3, rng.randrange(2**32)))
    return cases


CONV2D_CASES = conv2d_cases(200, seed=3)
TRANSPOSE_CASES = conv_transpose2d_cases(90, seed=4)


def torch_conv2d(x, w, b, stride, pads, dilation, groups, mode):
    """PyTorch reference with explicit (possibly asymmetric) padding."""
    (top, bottom), (left, right) = pads
    if mode == "zeros" and top == bottom and left == right:
        return F.conv2d(x, w, b, stride, (top, left), dilation, groups)
    x = F.pad(x, (left, right, top, bottom), mode="constant" if mode == "zeros" else mode)
    return F.conv2d(x, w, b, stride, 0, dilation, groups)


def torch_conv_transpose2d(x, w, b, stride, pads, output_padding, groups, dilation):
    """PyTorch reference; asymmetric padding crops the unpadded result."""
    (top, bottom), (left, right) = pads
    if top == bottom and left == right:
        return F.conv_transpose2d(x, w, b, stride, (top, left), output_padding, groups, dilation)
    full = F.conv_transpose2d(x, w, None, stride, 0, 0, groups, dilation)
    full = F.pad(full, (0, output_padding[1], 0, output_padding[0]))
    y = full[:, :, top:full.shape[2] - bottom, left:full.shape[3] - right]
    return y if b is None else y + b[:, None, None]


def one_panel_chunks(request):
    """Make the kernels build patch rows one micro-panel per chunk for this
    test, so that small images cross every chunk and band boundary."""
    kernels = fastconv._dispatch.kernels
    previous = kernels.set_chunk_bytes(1)
    request.addfinalizer(lambda: kernels.set_chunk_bytes(previous))


def streamed_outputs(request):
    """Make every output count as large for this test, so that the kernels
    write full tiles with non-temporal stores."""
    kernels = fastconv._dispatch.kernels
    previous = kernels.set_stream_bytes(0)
    request.addfinalizer(lambda: kernels.set_stream_bytes(previous))


def check_inputs_untouched(pairs):
    for given, original in pairs:
        np.testing.assert_array_equal(given, original)


def on_1_and_2_threads(isa, request):
    """Yields 1, then 2, with fastconv on that many threads and the isa's
    kernels in use; the thread count is restored when the test ends."""
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    with fastconv._dispatch.use_isa(isa):
        for nt in (1, 2):
            fastconv.set_num_threads(nt)
            yield nt


@pytest.mark.parametrize("case", CONV2D_CASES, ids=str)
def test_conv2d_and_backward_match_torch(case, request):
    if case.small_chunks:
        one_panel_chunks(request)
    c = case
    rng = np.random.default_rng(c.seed)
    x = rng.standard_normal(shaped((c.N, c.H, c.W, c.C), c.layout)).astype(c.dtype)
    w_ohwi = rng.standard_normal((c.OC, *c.kernel, c.C // c.groups)).astype(c.dtype)
    w = w_ohwi if c.layout == "NHWC" else w_ohwi.transpose(0, 3, 1, 2)
    b = rng.standard_normal(c.OC).astype(c.dtype) if c.bias else None
    pads = explicit_pads(c.padding, (c.H, c.W), c.kernel, c.stride, c.dilation)

    xt, wt = to_torch(x, c.layout).requires_grad_(), torch.from_numpy(
        np.array(w_ohwi.transpose(0, 3, 1, 2), np.float64)).requires_grad_()
    bt = torch.from_numpy(b.astype(np.float64)).requires_grad_() if c.bias else None
    ref = torch_conv2d(xt, wt, bt, c.stride, pads, c.dilation, c.groups, c.padding_mode)
    dy = rng.standard_normal(from_torch(ref, c.layout).shape).astype(c.dtype)
    ref.backward(to_torch(dy, c.layout))

    x_in, w_in, dy_in = in_memory(x, c.memory), in_memory(w, c.memory), in_memory(dy, c.memory)
    kwargs = dict(stride=c.stride, padding=c.padding, dilation=c.dilation, groups=c.groups,
                  padding_mode=c.padding_mode, layout=c.layout)
    y = conv2d(x_in, w_in, b, **kwargs)
    gx, gw, gb = conv2d_backward(dy_in, x_in, w_in, **kwargs)
    check_inputs_untouched([(x_in, x), (w_in, w), (dy_in, dy)])

    K = c.kernel[0] * c.kernel[1] * c.C // c.groups
    pixels = dy.size // c.OC
    assert_close(y, from_torch(ref, c.layout), c.dtype, K, "output")
    assert_close(gx, from_torch(xt.grad, c.layout), c.dtype, K * c.OC, "grad_input")
    w_grad = wt.grad.numpy().transpose(0, 2, 3, 1)
    assert_close(gw, w_grad if c.layout == "NHWC" else w_grad.transpose(0, 3, 1, 2),
                 c.dtype, pixels, "grad_weight")
    expected_gb = bt.grad.numpy() if c.bias else dy.astype(np.float64).sum(
        axis=(0, 1, 2) if c.layout == "NHWC" else (0, 2, 3))
    assert_close(gb, expected_gb, c.dtype, pixels, "grad_bias")


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose2d_and_backward_match_torch(case, request):
    if case.small_chunks:
        one_panel_chunks(request)
    c = case
    rng = np.random.default_rng(c.seed)
    x = rng.standard_normal(shaped((c.N, c.H, c.W, c.C), c.layout)).astype(c.dtype)
    # (C_in, C_out/groups, KH, KW) in PyTorch; (C_in, KH, KW, C_out/groups) for NHWC.
    w_torch = rng.standard_normal((c.C, c.OC // c.groups, *c.kernel)).astype(c.dtype)
    w = w_torch if c.layout == "NCHW" else w_torch.transpose(0, 2, 3, 1)
    b = rng.standard_normal(c.OC).astype(c.dtype) if c.bias else None
    pads = explicit_pads(c.padding, (c.H, c.W), c.kernel, c.stride, c.dilation)

    xt = to_torch(x, c.layout).requires_grad_()
    wt = torch.from_numpy(w_torch.astype(np.float64)).requires_grad_()
    bt = torch.from_numpy(b.astype(np.float64)).requires_grad_() if c.bias else None
    ref = torch_conv_transpose2d(xt, wt, bt, c.stride, pads, c.output_padding, c.groups,
                                 c.dilation)
    dy = rng.standard_normal(from_torch(ref, c.layout).shape).astype(c.dtype)
    ref.backward(to_torch(dy, c.layout))

    x_in, w_in, dy_in = in_memory(x, c.memory), in_memory(w, c.memory), in_memory(dy, c.memory)
    kwargs = dict(stride=c.stride, padding=c.padding, output_padding=c.output_padding,
                  groups=c.groups, dilation=c.dilation, layout=c.layout)
    y = conv_transpose2d(x_in, w_in, b, **kwargs)
    gx, gw, gb = conv_transpose2d_backward(dy_in, x_in, w_in, **kwargs)
    check_inputs_untouched([(x_in, x), (w_in, w), (dy_in, dy)])

    taps = c.kernel[0] * c.kernel[1]
    assert_close(y, from_torch(ref, c.layout), c.dtype, taps * c.C // c.groups, "output")
    assert_close(gx, from_torch(xt.grad, c.layout), c.dtype, taps * c.OC // c.groups,
                 "grad_input")
    w_grad = wt.grad.numpy()
    assert_close(gw, w_grad if c.layout == "NCHW" else w_grad.transpose(0, 2, 3, 1),
                 c.dtype, x.size // c.C, "grad_weight")
    assert_close(gb, dy.astype(np.float64).sum(axis=(0, 1, 2) if c.layout == "NHWC" else (0, 2, 3)),
                 c.dtype, dy.size // c.OC, "grad_bias")


def test_sweep_covers_the_feature_matrix():
    cases = CONV2D_CASES
    assert {(c.padding if isinstance(c.padding, str) else type(c.padding).__name__,
             c.padding_mode, c.layout) for c in cases} >= {
        (p, m, lay) for p in ("valid", "same", "int") for m in MODES for lay in LAYOUTS}
    assert {k for c in cases for k in c.kernel} >= {1, 7}
    assert {(1, 1), (7, 7)} <= {c.kernel for c in cases}
    assert {s for c in cases for s in c.stride} == {1, 2, 3}
    assert {d for c in cases for d in c.dilation} == {1, 2, 3}
    assert any(c.groups == c.C > 1 for c in cases) and any(1 < c.groups < c.C for c in cases)
    assert {c.N for c in cases} >= {1, 2} and {False, True} == {c.bias for c in cases}
    assert set(MEMORY) == {c.memory for c in cases} == {c.memory for c in TRANSPOSE_CASES}
    assert any(c.small_chunks and c.N > 1 for c in cases)
    assert any(c.small_chunks and c.N > 1 for c in TRANSPOSE_CASES)
    assert any(op > s for c in TRANSPOSE_CASES for op, s in zip(c.output_padding, c.stride))
    assert any(isinstance(c.padding[0], tuple) and c.padding[0][0] != c.padding[0][1]
               for c in TRANSPOSE_CASES if isinstance(c.padding, tuple))


# ------------------------------------------------------------ "same" padding

@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, harmless
@pytest.mark.parametrize("H, k, s, d", [(1, 1, 1, 1), (7, 3, 1, 1), (8, 4, 1, 1), (9, 3, 2, 1),
                                         (10, 5, 3, 1), (11, 3, 2, 2), (5, 7, 4, 1), (6, 2, 2, 3)])
def test_same_padding_is_same_upper(H, k, s, d):
    rng = np.random.default_rng(H * 1000 + k * 100 + s * 10 + d)
    x = rng.standard_normal((2, H, H + 1, 3))
    w = rng.standard_normal((4, k, k, 3))
    y = conv2d(x, w, stride=s, dilation=d, padding="same")
    assert y.shape == (2, -(-H // s), -(-(H + 1) // s), 4)
    # SAME_UPPER: the odd pixel of padding goes to the bottom/right.
    (top, bottom), (left, right) = explicit_pads("same", (H, H + 1), (k, k), (s, s), (d, d))
    assert 0 <= bottom - top <= 1 and 0 <= right - left <= 1
    ref = F.conv2d(F.pad(to_torch(x, "NHWC"), (left, right, top, bottom)),
                   torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), stride=s, dilation=d)
    assert_close(y, from_torch(ref, "NHWC"), np.float64, 1, "same")
    if s == 1:
        torch_same = F.conv2d(to_torch(x, "NHWC"), torch.from_numpy(w.transpose(0, 3, 1, 2).copy()),
                              padding="same", dilation=d)
        assert_close(y, from_torch(torch_same, "NHWC"), np.float64, 1, "torch same")


# --------------------------------------------- independent of PyTorch

def naive_conv2d(x, w, b, stride, pads, dilation, groups):
    """Seven nested loops over NHWC x and (OC, KH, KW, Cg) w, in float64."""
    N, H, W, C = x.shape
    OC, KH, KW, Cg = w.shape
    (sh, sw), (dh, dw), ((top, bottom), (left, right)) = stride, dilation, pads
    OH = (H + top + bottom - (KH - 1) * dh - 1) // sh + 1
    OW = (W + left + right - (KW - 1) * dw - 1) // sw + 1
    OCg = OC // groups
    y = np.zeros((N, OH, OW, OC))
    for n in range(N):
        for oh in range(OH):
            for ow in range(OW):
                for oc in range(OC):
                    acc = 0.0 if b is None else b[oc]
                    g = oc // OCg
                    for kh in range(KH):
                        for kw in range(KW):
                            for ci in range(Cg):
                                ih = oh * sh - top + kh * dh
                                iw = ow * sw - left + kw * dw
                                if 0 <= ih < H and 0 <= iw < W:
                                    acc += x[n, ih, iw, g * Cg + ci] * w[oc, kh, kw, ci]
                    y[n, oh, ow, oc] = acc
    return y


@pytest.mark.parametrize("shape, oc, kernel, stride, padding, dilation, groups", [
    ((2, 6, 5, 4), 4, (3, 3), (1, 1), 1, (1, 1), 1),
    ((1, 7, 8, 4), 6, (2, 3), (2, 3), ((2, 0), (1, 2)), (1, 1), 2),
    ((2, 9, 7, 3), 3, (3, 2), (1, 2), (0, 1), (2, 3), 3),
    ((1, 5, 6, 2), 5, (1, 1), (3, 2), 0, (1, 1), 1),
    ((1, 4, 4, 2), 2, (4, 4), (1, 1), "same", (1, 1), 1),
])
def test_conv2d_matches_naive_loops(shape, oc, kernel, stride, padding, dilation, groups):
    rng = np.random.default_rng(sum(shape) + oc)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((oc, *kernel, shape[3] // groups))
    b = rng.standard_normal(oc)
    pads = explicit_pads(padding, shape[1:3], kernel, stride, dilation)
    ref = naive_conv2d(x, w, b, stride, pads, dilation, groups)
    y = conv2d(x, w, b, stride, padding, dilation, groups)
    assert_close(y, ref, np.float64, 1, "naive")
    y32 = conv2d(x.astype(np.float32), w.astype(np.float32), b.astype(np.float32),
                 stride, padding, dilation, groups)
    assert_close(y32, ref, np.float32, w[0].size, "naive float32")


def central_difference(f, a, h=1e-3):
    """Gradient of the scalar f at a, one central difference per entry (f
    is linear in each argument, so only rounding limits the accuracy)."""
    grad = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        orig = a[i]
        a[i] = orig + h
        plus = f()
        a[i] = orig - h
        minus = f()
        a[i] = orig
        grad[i] = (plus - minus) / (2 * h)
    return grad


@pytest.mark.parametrize("mode, groups, stride, padding, dilation, layout", [
    ("zeros", 1, 2, 1, 1, "NHWC"),
    ("zeros", 2, (1, 2), ((2, 0), (0, 1)), (2, 1), "NCHW"),
    ("reflect", 1, 1, (2, 1), 1, "NHWC"),
    ("reflect", 2, 2, "same", 1, "NCHW"),
    ("replicate", 4, 1, ((3, 0), (1, 4)), 1, "NHWC"),
    ("replicate", 1, (2, 1), 2, (1, 2), "NCHW"),
    ("circular", 2, 1, (1, 2), 1, "NHWC"),
    ("circular", 1, 3, ((0, 4), (4, 1)), 1, "NCHW"),
])
def test_conv2d_backward_matches_central_differences(mode, groups, stride, padding, dilation,
                                                     layout):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shaped((2, 5, 4, 4), layout))
    w_shape = (4, 3, 2, 4 // groups)
    w = rng.standard_normal(w_shape if layout == "NHWC" else (4, 4 // groups, 3, 2))
    b = rng.standard_normal(4)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  padding_mode=mode, layout=layout)
    dy = rng.standard_normal(conv2d(x, w, b, **kwargs).shape)

    def loss():
        return np.vdot(conv2d(x, w, b, **kwargs), dy)

    gx, gw, gb = conv2d_backward(dy, x, w, **kwargs)
    for name, analytic, array in (("x", gx, x), ("weight", gw, w), ("bias", gb, b)):
        numeric = central_difference(loss, array)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-7, atol=1e-8, err_msg=name)


def test_conv_transpose2d_backward_matches_central_differences():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 4, 4))
    w = rng.standard_normal((4, 3, 2, 3))  # (C_in, KH, KW, C_out/groups)
    b = rng.standard_normal(6)
    kwargs = dict(stride=(2, 1), padding=((1, 0), (0, 2)), output_padding=(1, 1), groups=2,
                  dilation=(1, 2))
    dy = rng.standard_normal(conv_transpose2d(x, w, b, **kwargs).shape)

    def loss():
        return np.vdot(conv_transpose2d(x, w, b, **kwargs), dy)

    gx, gw, gb = conv_transpose2d_backward(dy, x, w, **kwargs)
    for name, analytic, array in (("x", gx, x), ("weight", gw, w), ("bias", gb, b)):
        np.testing.assert_allclose(analytic, central_difference(loss, array),
                                   rtol=1e-7, atol=1e-8, err_msg=name)


def test_conv_transpose2d_is_the_adjoint_of_conv2d():
    # <conv2d(u), v> == <u, conv_transpose2d(v)> with the same weight.
    rng = np.random.default_rng(9)
    w = rng.standard_normal((6, 3, 2, 2))  # conv2d OHWI == conv_transpose2d (C_in, KH, KW, C_out/g)
    u = rng.standard_normal((2, 9, 8, 4))
    kwargs = dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=2)
    cu = conv2d(u, w, **kwargs)
    v = rng.standard_normal(cu.shape)
    # output_padding restores the input rows the stride dropped.
    op = tuple(n + 2 * p - (k - 1) * d - 1 - (o - 1) * s for n, p, k, d, o, s in
               zip((9, 8), (1, 2), (3, 2), (2, 1), cu.shape[1:3], (2, 3)))
    tv = conv_transpose2d(v, w, output_padding=op, **kwargs)
    assert tv.shape == u.shape
    assert abs(np.vdot(cu, v) - np.vdot(u, tv)) < 1e-10 * np.abs(cu).sum()


# -------------------------------------------------------------- edge shapes

def torch_grads(x, w, b, dy, **kwargs):
    """NHWC float64 PyTorch output and gradients of a zero-padded conv2d."""
    xt = to_torch(x, "NHWC").requires_grad_()
    wt = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2), np.float64))
    wt.requires_grad_()
    bt = torch.from_numpy(b.astype(np.float64)).requires_grad_()
    y = F.conv2d(xt, wt, bt, **kwargs)
    y.backward(to_torch(dy, "NHWC"))
    return (from_torch(y, "NHWC"), from_torch(xt.grad, "NHWC"),
            wt.grad.numpy().transpose(0, 2, 3, 1), bt.grad.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    ((2, 1, 1, 3), (4, 1, 1, 3), {}),                                        # 1x1 on 1x1
    ((3, 13, 7, 5), (11, 3, 5, 5), dict(stride=(2, 3), padding=(1, 2))),     # primes
    ((2, 3, 3, 1024), (8, 2, 2, 1024), dict(padding=1)),                     # huge C
    ((1, 2, 2, 1024), (1024, 3, 3, 1), dict(padding=1, groups=1024)),        # huge depthwise
    ((2, 11, 10, 3), (4, 2, 2, 3), dict(stride=3)),                          # stride > kernel
    ((2, 40, 36, 16), (16, 3, 3, 16), dict(padding=1)),                      # threaded kernels
    ((2, 17, 15, 8), (12, 1, 1, 8), {}),                                     # pointwise
    ((2, 17, 15, 8), (12, 1, 1, 4), dict(groups=2)),                         # grouped pointwise
    # The pointwise input gradient is written by GEMMs into an uninitialised
    # dx: full, aligned rows of 64 channels, streamed when forced below.
    ((2, 9, 7, 64), (24, 1, 1, 64), {}),
    ((2, 9, 7, 128), (24, 1, 1, 64), dict(groups=2)),
])
@pytest.mark.parametrize("streamed", [False, True], ids=["stored", "streamed"])
def test_edge_shapes_match_torch(x_shape, w_shape, kwargs, dtype, streamed, request):
    if streamed:
        streamed_outputs(request)
    rng = np.random.default_rng(x_shape[3] + w_shape[0])
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    y = conv2d(x, w, b, **kwargs)
    dy = rng.standard_normal(y.shape).astype(dtype)
    gx, gw, gb = conv2d_backward(dy, x, w, **kwargs)
    ref_y, ref_gx, ref_gw, ref_gb = torch_grads(x, w, b, dy, **kwargs)
    K = w[0].size
    assert_close(y, ref_y, dtype, K, "output")
    assert_close(gx, ref_gx, dtype, K * w.shape[0], "grad_input")
    assert_close(gw, ref_gw, dtype, dy.size // dy.shape[3], "grad_weight")
    assert_close(gb, ref_gb, dtype, dy.size // dy.shape[3], "grad_bias")


def test_stride_larger_than_kernel_leaves_skipped_inputs_with_zero_gradient():
    x = np.ones((1, 7, 7, 2))
    w = np.ones((3, 2, 2, 2))
    dy = np.ones((1, 2, 2, 3))
    gx, _, _ = conv2d_backward(dy, x, w, stride=3)
    read = np.zeros((7, 7), bool)
    for r in (0, 1, 3, 4):
        for c in (0, 1, 3, 4):
            read[r, c] = True
    assert np.all(gx[0][read] == 3) and np.all(gx[0][~read] == 0)


def test_stride_phases_of_a_3x3_stride_2_layer():
    """dx's even rows of a 3x3/2 layer padded by 1 take the middle tap from
    the same output row; odd rows the last tap from that row and the first
    from the next; stride 4 over a 3-tap kernel leaves a phase no tap
    reaches, and one whose tap starts a row of dy later (skipped)."""
    phases = fastconv.conv._stride_phases
    assert phases(3, 2, 1, 1, 56, 28) == [(0, [1], 1, 0, 0), (1, [2, 0], 1, 0, 0)]
    # i = 4*o - 1 + k: phase 3 is tap 0 of o = a + 1; phase 2 no tap
    assert phases(3, 4, 1, 1, 17, 5) == [(0, [1], 1, 0, 0), (1, [2], 1, 0, 0),
                                         (2, [], 1, 0, 0), (3, [0], 1, 0, 1)]
    # dilation 2, stride 2, padding 2: every tap lands on even rows, d 1
    assert phases(3, 2, 2, 2, 10, 5) == [(0, [2, 1, 0], 1, 1, 0), (1, [], 1, 0, 0)]


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    ((2, 56, 56, 64), (48, 3, 3, 64), dict(stride=2, padding=1)),          # ResNet's 3x3/2
    ((1, 15, 13, 40), (24, 3, 3, 40), dict(stride=2, padding=1)),          # odd sizes
    ((2, 16, 16, 32), (16, 4, 4, 32), dict(stride=2, padding=1)),          # 2x2 taps a phase
    # overlapping windows (extent 5 > 4) with tapless phases and one whose
    # tap starts a row of dy later
    ((1, 17, 19, 33), (8, 3, 3, 33), dict(stride=4, dilation=2, padding=3)),
    ((1, 20, 18, 32), (12, 3, 3, 32), dict(stride=(2, 3), dilation=(2, 1), padding=(2, 1))),
    ((1, 9, 9, 48), (16, 1, 3, 48), dict(stride=(1, 2), padding=(0, 1))),  # one axis strided
    ((1, 23, 21, 32), (40, 7, 7, 32), dict(stride=2, padding=3)),          # a 7x7/2 stem
])
@pytest.mark.parametrize("dy_layout", ["contiguous", "channel-slice", "channels-strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_input_gradient_by_phases(isa, x_shape, w_shape, kwargs, dy_layout, dtype,
                                          request, monkeypatch):
    """A strided layer with at least _PHASE_MIN_CHANNELS input channels gets
    its input gradient as one stride-1 convolution per phase of dx, each
    written straight into dx[:, p::S, q::S] (conv._phase_data_grad): against
    torch in float64, against the col2im form, and the same bits on 1 and 2
    threads; for dy contiguous, a channel slice (pixels strided) and with
    strided channels (copied)."""
    assert x_shape[3] >= fastconv.conv._PHASE_MIN_CHANNELS
    rng = np.random.default_rng(list(x_shape) + list(w_shape))
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = np.zeros(w_shape[0], dtype)
    y = conv2d(x, w, **kwargs)
    dy0 = rng.standard_normal(y.shape).astype(dtype)
    if dy_layout == "channel-slice":
        dy = np.zeros(y.shape[:3] + (y.shape[3] + 5,), dtype)[..., 2:2 + y.shape[3]]
        dy[...] = dy0
    elif dy_layout == "channels-strided":
        dy = np.zeros(y.shape + (2,), dtype)[..., 0]
        dy[...] = dy0
    else:
        dy = dy0
    _, ref_gx, _, _ = torch_grads(x, w, b, dy0, **kwargs)
    calls = []
    by_phases = fastconv.conv._phase_data_grad
    monkeypatch.setattr(fastconv.conv, "_phase_data_grad",
                        lambda *args: calls.append(1) or by_phases(*args))
    results = []
    for nt in on_1_and_2_threads(isa, request):
        gx, _, _ = conv2d_backward(dy, x, w, output_mask=(True, False, False), **kwargs)
        assert_close(gx, ref_gx, dtype, w_shape[0] * w_shape[1] * w_shape[2],
                     f"grad_input, {nt} threads")
        results.append(gx)
    with fastconv._dispatch.use_isa(isa):
        fastconv.conv._PHASE_MIN_CHANNELS, saved = 10**9, fastconv.conv._PHASE_MIN_CHANNELS
        try:
            by_col2im, _, _ = conv2d_backward(dy, x, w, output_mask=(True, False, False),
                                              **kwargs)
        finally:
            fastconv.conv._PHASE_MIN_CHANNELS = saved
    assert len(calls) == 2                  # the two runs above, not the col2im one
    np.testing.assert_array_equal(results[0], results[1])
    assert_close(results[0], by_col2im.astype(np.float64), dtype,
                 w_shape[0] * w_shape[1] * w_shape[2], "phases vs col2im")


def test_conv2d_forward_view_checks_its_arguments():
    """The phase kernel refuses taps outside w and shapes that disagree (it
    would read out of bounds), and zero-fills y from an empty image."""
    kernels = fastconv._dispatch.kernels
    x = np.ones((1, 4, 4, 8), np.float32)
    w = np.ones((8, 9 * 6), np.float32)                 # 9 taps of 6 output channels
    y = np.empty((1, 6, 5, 16), np.float32)[..., ::2, 2:8]
    kernels.conv2d_forward_view(x, w, y, (2, 2), (1, 1), (0, 0), [8, 6, 2, 0], 1)
    assert np.all(y[:, :3, :3] == 32) and np.all(y[:, 4:] == 0)
    for bad_taps in ([8, 6, 2], [9, 6, 2, 0], [-1, 6, 2, 0]):
        with pytest.raises(ValueError, match="taps"):
            kernels.conv2d_forward_view(x, w, y, (2, 2), (1, 1), (0, 0), bad_taps, 1)
    with pytest.raises(ValueError, match="y must be"):
        kernels.conv2d_forward_view(x, w[:4], y, (2, 2), (1, 1), (0, 0), [8, 6, 2, 0], 1)
    y[...] = 7
    kernels.conv2d_forward_view(x[:, :0], w, y, (2, 2), (1, 1), (0, 0), [8, 6, 2, 0], 1)
    assert np.all(y == 0)


def test_strided_conv_transpose2d_by_phases(monkeypatch):
    """conv_transpose2d is a data gradient: a stride-2 upsampling to 32
    channels runs by phases, against torch in float64."""
    calls = []
    by_phases = fastconv.conv._phase_data_grad
    monkeypatch.setattr(fastconv.conv, "_phase_data_grad",
                        lambda *args: calls.append(1) or by_phases(*args))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, 8, 24))
    w = rng.standard_normal((24, 4, 4, 32))            # (C_in, KH, KW, C_out)
    b = rng.standard_normal(32)
    y = conv_transpose2d(x, w, b, stride=2, padding=1)
    ref = F.conv_transpose2d(to_torch(x, "NHWC"),
                             torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2))),
                             torch.from_numpy(b), stride=2, padding=1)
    assert y.shape == (2, 18, 16, 32)
    assert_close(y, from_torch(ref, "NHWC"), np.float64, 24 * 16, "conv_transpose2d")
    assert calls == [1]


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("N, H, W, C, OC, k, s, d, pads", [
    (2, 56, 56, 40, 24, (1, 1), (2, 2), (1, 1), ((0, 0), (0, 0))),   # 1x1/2 downsampling
    (1, 13, 11, 5, 7, (1, 1), (3, 2), (1, 1), ((0, 0), (0, 0))),     # odd sizes, uncovered edges
    (1, 17, 16, 6, 9, (2, 2), (2, 2), (1, 1), ((0, 0), (0, 0))),     # patchify 2x2/2
    (2, 10, 12, 3, 5, (3, 2), (3, 2), (1, 1), ((1, 0), (0, 1))),     # padded, asymmetric
    (1, 15, 14, 4, 6, (2, 2), (3, 3), (2, 2), ((0, 2), (1, 0))),     # dilated, extent 3 = stride
    (1, 9, 9, 500, 4, (1, 1), (2, 2), (1, 1), ((0, 0), (0, 0))),     # C beyond one k-block
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_disjoint_windows_write_every_input_gradient_pixel(isa, N, H, W, C, OC, k, s, d, pads,
                                                           dtype, request):
    """Where windows do not overlap the input gradient is written, not
    accumulated: every pixel once, by its one tap or with zero.  A NaN-filled
    dx shows that none is left unwritten; torch is the reference."""
    one_panel_chunks(request)       # chunk and band boundaries inside small images
    rng = np.random.default_rng(C * OC + H)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, *k, C)).astype(dtype)
    (top, bottom), (left, right) = pads
    OH = (H + top + bottom - d[0] * (k[0] - 1) - 1) // s[0] + 1
    OW = (W + left + right - d[1] * (k[1] - 1) - 1) // s[1] + 1
    dy = rng.standard_normal((N, OH, OW, OC)).astype(dtype)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_()
    yt = torch_conv2d(xt, torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), None, s, pads,
                      d, 1, "zeros")
    yt.backward(torch.from_numpy(dy.transpose(0, 3, 1, 2).copy()))
    expected = xt.grad.numpy().transpose(0, 2, 3, 1).astype(np.float64)
    with fastconv._dispatch.use_isa(isa):
        gx = conv2d_backward(dy, x, w, stride=s, padding=pads, dilation=d,
                             output_mask=(True, False, False))[0]
        assert_close(gx, expected, dtype, OC, "grad_input")
        kernels = fastconv._dispatch.kernels
        dx = np.full((N, H, W, C), np.nan, dtype)
        kernels.conv2d_grad_input(dy.reshape(-1, OC), w.reshape(OC, -1), dx, k, s, d,
                                  (top, left), (OH, OW), 2, True)
        assert_close(dx, expected, dtype, OC, "grad_input, overwritten")


def test_overwriting_input_gradient_of_overlapping_windows_is_refused():
    # Overlapping windows add several taps into a pixel: overwriting would
    # keep one of them.
    dy = np.ones((3 * 3, 4), np.float32)
    w = np.ones((4, 3 * 3 * 2), np.float32)
    dx = np.zeros((1, 8, 8, 2), np.float32)
    with pytest.raises(ValueError, match="overwrite"):
        fastconv._dispatch.kernels.conv2d_grad_input(dy, w, dx, (3, 3), (2, 2), (1, 1), (0, 0),
                                                     (3, 3), 1, True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_batch(layout):
    x = np.zeros(shaped((0, 6, 5, 4), layout), np.float32)
    w = np.ones((6, 3, 3, 2) if layout == "NHWC" else (6, 2, 3, 3), np.float32)
    y = conv2d(x, w, np.ones(6, np.float32), padding=1, groups=2, layout=layout)
    assert y.shape == shaped((0, 6, 5, 6), layout) and y.dtype == np.float32
    gx, gw, gb = conv2d_backward(y, x, w, padding=1, groups=2, layout=layout)
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == (6,)
    assert not gw.any() and not gb.any()

    wt = np.ones((4, 3, 3, 3) if layout == "NHWC" else (4, 3, 3, 3), np.float32)
    y = conv_transpose2d(x, wt, stride=2, layout=layout)
    assert y.shape == shaped((0, 13, 11, 3), layout)
    gx, gw, gb = conv_transpose2d_backward(y, x, wt, stride=2, layout=layout)
    assert gx.shape == x.shape and gw.shape == wt.shape and not gw.any() and not gb.any()


def test_output_mask_and_threads():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 20, 20, 8))
    w = rng.standard_normal((8, 3, 3, 8))
    dy = rng.standard_normal((2, 20, 20, 8))
    full = conv2d_backward(dy, x, w, padding=1)
    masked = conv2d_backward(dy, x, w, padding=1, output_mask=(True, False, False))
    assert masked[1:] == (None, None)
    np.testing.assert_array_equal(masked[0], full[0])
    gx, gw, gb = conv2d_backward(dy, x, w, padding=1, output_mask=(False, True, True))
    assert gx is None
    np.testing.assert_array_equal(gw, full[1])
    assert conv_transpose2d_backward(dy, x, w, padding=1, output_mask=[0, 0, 1])[:2] == (None, None)
    previous = fastconv.get_num_threads()
    fastconv.set_num_threads(1)
    try:
        single = conv2d_backward(dy, x, w, padding=1)
    finally:
        fastconv.set_num_threads(previous)
    for a, b in zip(single, full):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_nchw_results_chain_without_copies():
    # NCHW results are views of NHWC memory; fed back in, they need no copy.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 8, 8))
    w1, w2 = rng.standard_normal((5, 3, 3, 3)), rng.standard_normal((4, 5, 3, 3))
    y = conv2d(conv2d(x, w1, padding=1, layout="NCHW"), w2, layout="NCHW")
    ref = F.conv2d(F.conv2d(torch.from_numpy(x), torch.from_numpy(w1), padding=1),
                   torch.from_numpy(w2))
    assert_close(y, ref.numpy(), np.float64, 45, "chained")


def test_strided_inputs_are_read_in_place(monkeypatch):
    # Pixel-strided NHWC views, and NCHW views of NHWC memory (what NCHW
    # calls return), reach the kernels without a copy.
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 18, 9, 6))[:, ::2, ::-1]
    w = rng.standard_normal((4, 3, 3, 3))
    w_nchw = rng.standard_normal((5, 4, 3, 3))
    y = conv2d(np.ascontiguousarray(x), w, padding=1, groups=2)
    z = conv2d(np.ascontiguousarray(y.transpose(0, 3, 1, 2)), w_nchw, layout="NCHW")

    def no_copies(*args, **kwargs):
        raise AssertionError("unexpected copy")

    monkeypatch.setattr(np, "ascontiguousarray", no_copies)
    np.testing.assert_array_equal(conv2d(x, w, padding=1, groups=2), y)
    np.testing.assert_array_equal(conv2d(y.transpose(0, 3, 1, 2), w_nchw, layout="NCHW"), z)


def test_misaligned_and_odd_stride_inputs():
    # A packed structured array's float field: 9-byte strides, misaligned.
    rng = np.random.default_rng(13)
    packed = np.zeros((2, 6, 5, 3), dtype=[("tag", "u1"), ("value", "<f8")])
    packed["value"] = rng.standard_normal(packed.shape)
    x = packed["value"]
    assert x.strides[3] == 9 and not x.flags.aligned
    w = rng.standard_normal((4, 3, 3, 3))
    np.testing.assert_array_equal(conv2d(x, w, padding=1), conv2d(x.copy(), w, padding=1))
    np.testing.assert_array_equal(fastconv.im2col(x, 3), fastconv.im2col(x.copy(), 3))


def test_odd_stride_on_a_length_one_axis():
    # numpy calls an array with a length-1 axis C-contiguous whatever that
    # axis' stride is, even one that is not whole elements, and an empty
    # array C-contiguous whatever its strides: the facade's fast stride
    # test must not take either for whole elements.
    from fastconv._args import element_strides
    rng = np.random.default_rng(14)
    base = rng.standard_normal(1 + 5 * 7 * 3 + 1)
    x = np.lib.stride_tricks.as_strided(base[1:], (1, 5, 7, 3), (3, 7 * 3 * 8, 3 * 8, 8))
    empty = np.lib.stride_tricks.as_strided(base, (0, 4), (3, 8))
    assert x.flags.c_contiguous and x.strides[0] % x.itemsize and empty.flags.c_contiguous
    assert not element_strides(x) and not element_strides(empty)
    assert element_strides(x.copy()) and element_strides(base[::3].reshape(1, -1))
    w = rng.standard_normal((4, 3, 3, 3))
    np.testing.assert_array_equal(conv2d(x, w, padding=1), conv2d(x.copy(), w, padding=1))


def _odd_stride_view(kind, shape, rng):
    """An NHWC view of the given shape and kind (length-1 kinds: H = W = 1)."""
    N, H, W, C = shape
    if kind == "broadcast along W":
        return np.broadcast_to(rng.standard_normal((N, H, 1, C)), shape)
    if kind == "broadcast along H":
        return np.broadcast_to(rng.standard_normal((N, 1, W, C)), shape)
    if kind == "pixels overlapping":     # pixels 2 values apart, C values each
        row = 2 * W + C
        base = rng.standard_normal(N * H * row)
        return np.lib.stride_tricks.as_strided(base, shape, (8 * H * row, 8 * row, 16, 8))
    # NCHW with H = W = 1 and the batch reversed: as NHWC, length-1 axes
    # with strides of one value (numpy keeps whatever they were).
    x = rng.standard_normal((N, C, H, W))[::-1].transpose(0, 2, 3, 1)
    assert x.strides[0] < 0 and abs(x.strides[2]) < C * 8
    return x


ODD_STRIDE_KINDS = ["broadcast along W", "broadcast along H", "pixels overlapping",
                    "length-1 axes, batch reversed"]


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("kind", ODD_STRIDE_KINDS)
@pytest.mark.parametrize("algorithm", ["implicit", "im2col", "winograd"])
def test_overlapping_pixels_and_length_one_axes(isa, kind, algorithm):
    """Views whose pixels overlap (np.broadcast_to along W, pixels fewer
    than C values apart) or whose length-1 axes carry odd strides: implicit
    GEMM builds a border pixel's window at the image's tap offsets, where
    such taps overwrote each other (wrong sums on every ISA, found by
    fuzzing); now such windows space their taps C apart (shadow_layout).
    Every algorithm against the same call on a copy."""
    rng = np.random.default_rng(len(kind))
    one = kind.startswith("length-1")
    x = _odd_stride_view(kind, (2, 1, 1, 5) if one else (2, 6, 7, 5), rng)
    w = rng.standard_normal((4, 3, 3, 5))
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, padding=1, algorithm=algorithm)
        ref = conv2d(np.ascontiguousarray(x), w, padding=1, algorithm=algorithm)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("kind", ODD_STRIDE_KINDS)
def test_strided_input_gradient_of_overlapping_grad_output(isa, kind):
    """The input gradient of a 5x5 stride-4 layer, 32 channels in and out
    (by stride phases, through the same windows), its grad_output such a
    view: dy (2, 1, 1, 32) of an 8x8 image, (2, 2, 2, 32) of 9x9; against
    the same call on a copy."""
    rng = np.random.default_rng(len(kind))
    one = kind.startswith("length-1")
    dy = _odd_stride_view(kind, (2, 1, 1, 32) if one else (2, 2, 2, 32), rng)
    x = rng.standard_normal((2, 8, 8, 32) if one else (2, 9, 9, 32))
    w = rng.standard_normal((32, 5, 5, 32))
    with fastconv._dispatch.use_isa(isa):
        gx = conv2d_backward(dy, x, w, stride=4, output_mask=(True, False, False))[0]
        ref = conv2d_backward(np.ascontiguousarray(dy), x, w, stride=4,
                              output_mask=(True, False, False))[0]
    np.testing.assert_allclose(gx, ref, rtol=0, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C", [16, 32, 64, 96, 128, 160])
@pytest.mark.parametrize("stride", [1, 2])
def test_weight_gradient_of_one_output_channel(isa, dtype, C, stride):
    """A 1x1 layer with one output channel: dy is then one value a pixel,
    a plain row as much as an A.T view, and on AVX-512 the weight gradient
    read the image's rows in place (rows of at most 512 bytes) beside it
    with a kernel that reads packed panels (wrong for C*itemsize of 256,
    384 and 512 bytes, found by fuzzing)."""
    rng = np.random.default_rng(C + stride)
    x = rng.standard_normal((2, 7, 4, C)).astype(dtype)
    w = rng.standard_normal((1, 1, 1, C)).astype(dtype)
    dy = rng.standard_normal((2, 7, 4, 1) if stride == 1 else (2, 4, 2, 1)).astype(dtype)
    with fastconv._dispatch.use_isa(isa):
        gw = conv2d_backward(dy, x, w, stride=stride, output_mask=(False, True, False))[1]
    xs = x[:, ::stride, ::stride].astype(np.float64)
    ref = np.einsum("nhwc,nhwo->oc", xs, dy.astype(np.float64)).reshape(1, 1, 1, C)
    assert_close(gw, ref, dtype, xs.shape[0] * xs.shape[1] * xs.shape[2], "grad_weight")


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, harmless
@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, w_shape, kwargs, view", [
    # a kernel row's taps as one window of KW*C values (192), borders tap by tap
    ((1, 13, 11, 64), (3, 3, 3, 64), dict(padding=1), None),
    # 60-value windows: whole vectors, then the last lanes of one; 4 + 1 channels
    ((2, 9, 10, 20), (5, 3, 3, 20), dict(padding=1), None),
    ((2, 12, 9, 24), (16, 3, 3, 24), dict(stride=2, padding=(1, 2)), None),
    ((1, 9, 8, 16), (3, 4, 4, 16), dict(padding="same"), None),
    # dilated: tap by tap
    ((1, 8, 7, 32), (1, 3, 3, 32), dict(padding=2, dilation=2), None),
    # an image narrower than the kernel: every pixel a border pixel
    ((2, 5, 3, 40), (4, 5, 5, 40), dict(padding=2), None),
    ((1, 1, 1, 48), (2, 3, 3, 48), dict(padding=1), None),
    ((2, 11, 10, 32), (3, 2, 2, 32), dict(stride=3), None),
    ((1, 6, 6, 16), (15, 1, 1, 16), dict(stride=2), None),
    # groups: a group's channels are a slice of each pixel, tap by tap
    ((2, 7, 8, 64), (6, 3, 3, 32), dict(padding=1, groups=2), None),
    # rows of the image two apart in memory
    ((2, 7, 9, 32), (3, 3, 3, 32), dict(padding=1), "every other row"),
    # up to 48 output channels on rows at least 28 wide
    ((1, 30, 29, 16), (40, 3, 3, 16), dict(padding=1), None),
    # the GEMM's path, just past the few-outputs one
    ((2, 7, 9, 32), (17, 3, 3, 32), dict(padding=1), None),
    ((1, 30, 27, 16), (40, 3, 3, 16), dict(padding=1), None),
])
def test_weight_gradient_of_few_output_channels(isa, dtype, x_shape, w_shape, kwargs, view):
    """Layers with at most 16 output channels (48 on wide rows) take
    few_outputs_kernel.h's tiles, straight from the image
    (grad_weight_few_outputs): against float64 torch for every geometry
    its row walk distinguishes."""
    rng = np.random.default_rng(x_shape[3] * 100 + w_shape[0])
    x = rng.standard_normal(x_shape).astype(dtype)
    if view:
        x = np.repeat(x, 2, axis=1)[:, ::2]
        assert not x.flags.c_contiguous
    w = rng.standard_normal(w_shape).astype(dtype)
    b = np.zeros(w_shape[0], dtype)
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, **kwargs)
        dy = rng.standard_normal(y.shape).astype(dtype)
        gw = conv2d_backward(dy, x, w, **kwargs, output_mask=(False, True, False))[1]
    ref_gw = torch_grads(x, w, b, dy, **kwargs)[2]
    assert_close(gw, ref_gw, dtype, dy.size // dy.shape[3], "grad_weight")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C, OC", [(32, 2), (64, 3), (32, 64)])
def test_weight_gradient_of_a_broadcast_image(isa, dtype, C, OC):
    """A 1x1 layer's weight gradient reads the image's pixels in place as
    the rows of its GEMM's right operand; for an image broadcast to every
    pixel they are 0 apart, which the frame takes for a packed operand
    (AVX-512: garbage, found by fuzzing)."""
    rng = np.random.default_rng(C + OC)
    x = np.broadcast_to(rng.standard_normal((1, 1, 1, C)).astype(dtype), (2, 5, 6, C))
    w = rng.standard_normal((OC, 1, 1, C)).astype(dtype)
    dy = rng.standard_normal((2, 5, 6, OC)).astype(dtype)
    with fastconv._dispatch.use_isa(isa):
        gw = conv2d_backward(dy, x, w, output_mask=(False, True, False))[1]
    ref = np.einsum("nhwc,nhwo->oc", x.astype(np.float64), dy.astype(np.float64))
    assert_close(gw, ref.reshape(OC, 1, 1, C), dtype, 60, "grad_weight")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_byte_swapped_input_is_refused(dtype):
    x = np.zeros((1, 4, 4, 2), np.dtype(dtype).newbyteorder())
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        conv2d(x, np.zeros((3, 3, 3, 2), dtype))


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (2, 3, 5, 7), (1, 1, 1, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_aligned(shape, dtype):
    from fastconv.gemm import empty_aligned
    for _ in range(8):                 # numpy's own allocations land anywhere mod 64
        a = empty_aligned(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.flags.writeable and a.ctypes.data % 64 == 0


# --------------------------------------------------------------- errors

X = np.zeros((1, 5, 5, 4))
W = np.zeros((6, 3, 3, 4))
WT = np.zeros((4, 3, 3, 2))  # conv_transpose2d: (C_in, KH, KW, C_out/groups)
DY = np.zeros((1, 3, 3, 6))


@pytest.mark.parametrize("call, exc, name", [
    # shapes and channels
    (lambda: conv2d(X[0], W), ValueError, "x"),
    (lambda: conv2d(X, W[0]), ValueError, "weight"),
    (lambda: conv2d(X, np.zeros((6, 3, 3, 3))), ValueError, "weight"),
    (lambda: conv2d(X, np.zeros((6, 3, 3, 4)), layout="NCHW"), ValueError, "weight"),
    (lambda: conv2d(X, np.zeros((6, 0, 3, 4))), ValueError, "weight"),
    (lambda: conv2d(X, np.zeros((6, 3, 3, 1)), groups=3), ValueError, "groups"),
    (lambda: conv2d(X, np.zeros((5, 3, 3, 2)), groups=2), ValueError, "groups"),
    (lambda: conv2d(X, W, groups=0), ValueError, "groups"),
    (lambda: conv2d(X, W, groups=1.0), TypeError, "groups"),
    (lambda: conv2d(X, W, np.zeros(5)), ValueError, "bias"),
    (lambda: conv2d(X, W, np.zeros((6, 1))), ValueError, "bias"),
    # geometry
    (lambda: conv2d(X, W, stride=0), ValueError, "stride"),
    (lambda: conv2d(X, W, stride=(1, -2)), ValueError, "stride"),
    (lambda: conv2d(X, W, stride=(1, 2, 3)), ValueError, "stride"),
    (lambda: conv2d(X, W, stride="1"), TypeError, "stride"),
    (lambda: conv2d(X, W, dilation=0), ValueError, "dilation"),
    (lambda: conv2d(X, W, padding=-1), ValueError, "padding"),
    (lambda: conv2d(X, W, padding=((0, -1), (0, 0))), ValueError, "padding"),
    (lambda: conv2d(X, W, padding=(1, 2, 3)), ValueError, "padding"),
    (lambda: conv2d(X, W, padding="full"), ValueError, "padding"),
    (lambda: conv2d(X, W, padding=1.5), TypeError, "padding"),
    (lambda: conv2d(X, W, padding_mode="mirror"), ValueError, "padding_mode"),
    (lambda: conv2d(X, W, padding_mode=None), ValueError, "padding_mode"),
    (lambda: conv2d(X, W, layout="NWHC"), ValueError, "layout"),
    (lambda: conv2d(X, W, dilation=3), ValueError, "weight"),
    (lambda: conv2d(X, np.zeros((6, 7, 1, 4)), padding=(0, 1)), ValueError, "weight"),
    (lambda: conv2d(X, W, padding=5, padding_mode="reflect"), ValueError, "padding"),
    (lambda: conv2d(X, W, padding=6, padding_mode="circular"), ValueError, "padding"),
    # extents past the kernels' 64-bit indices (a transposed convolution
    # returned zeros where stride * H overflowed; found by fuzzing)
    (lambda: conv2d(X, W, stride=(1, 2 ** 62)), ValueError, "padding, stride or dilation"),
    (lambda: conv2d(X, W, padding=2 ** 61), ValueError, "padding, stride or dilation"),
    (lambda: conv_transpose2d(X, WT, stride=(2 ** 61, 1), padding=((4 * 2 ** 61 - 10, 0), (0, 0))),
     ValueError, "padding, stride or dilation"),
    (lambda: fastconv.im2col(X, 3, dilation=2 ** 61), ValueError, "padding, stride or dilation"),
    # dtypes
    (lambda: conv2d(X.astype(np.int64), W), TypeError, "x"),
    (lambda: conv2d(X.astype(np.float16), W.astype(np.float16)), TypeError, "x"),
    (lambda: conv2d(X.astype(np.complex128), W), TypeError, "x"),
    (lambda: conv2d(X, W.astype(np.float32)), TypeError, "weight"),
    (lambda: conv2d(X, W.astype(np.int32)), TypeError, "weight"),
    (lambda: conv2d(X, W, np.zeros(6, np.float32)), TypeError, "bias"),
    # backward
    (lambda: conv2d_backward(DY[:, :2], X, W), ValueError, "grad_output"),
    (lambda: conv2d_backward(DY[0], X, W), ValueError, "grad_output"),
    (lambda: conv2d_backward(DY.astype(np.float32), X, W), TypeError, "grad_output"),
    (lambda: conv2d_backward(DY, X, W, output_mask=(True, True)), ValueError, "output_mask"),
    (lambda: conv2d_backward(DY, X, W, stride=0), ValueError, "stride"),
    (lambda: conv2d_backward(DY, X, W, layout="nhwc"), ValueError, "layout"),
    # transposed
    (lambda: conv_transpose2d(X, WT, output_padding=1), ValueError, "output_padding"),
    (lambda: conv_transpose2d(X, WT, stride=2, output_padding=(0, 2)), ValueError,
     "output_padding"),
    (lambda: conv_transpose2d(X, WT, stride=2, output_padding=-1), ValueError, "output_padding"),
    (lambda: conv_transpose2d(X, WT, dilation=2, output_padding=2), ValueError, "output_padding"),
    (lambda: conv_transpose2d(X, np.zeros((3, 3, 3, 2))), ValueError, "weight"),
    (lambda: conv_transpose2d(X, WT, groups=3), ValueError, "groups"),
    (lambda: conv_transpose2d(X, WT, padding="same"), ValueError, "padding"),
    (lambda: conv_transpose2d(X, WT, padding=5), ValueError, "padding"),
    (lambda: conv_transpose2d(X, WT, padding=-1), ValueError, "padding"),
    (lambda: conv_transpose2d(X, WT, np.zeros(3)), ValueError, "bias"),
    (lambda: conv_transpose2d(X, WT.astype(np.float32)), TypeError, "weight"),
    (lambda: conv_transpose2d(X, WT, layout="CHWN"), ValueError, "layout"),
    (lambda: conv_transpose2d_backward(np.zeros((1, 7, 7, 3)), X, WT), ValueError,
     "grad_output"),
    (lambda: conv_transpose2d_backward(np.zeros((1, 7, 7, 2), np.float32), X, WT), TypeError,
     "grad_output"),
])
def test_errors_name_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        call()


# --------------------------------------------------------------- threading

@pytest.mark.parametrize("x_shape, kwargs", [
    ((2, 40, 36, 16), dict(padding=1)),                 # one task per image
    ((1, 23, 19, 8), dict(padding=2, dilation=2)),      # bands within one image
    ((3, 17, 16, 8), dict(stride=2, padding=1)),        # bands, odd batch
    ((4, 64, 64, 8), dict(padding=1)),                  # grad_weight: per-thread partials
])
def test_threads_give_identical_results(x_shape, kwargs, request):
    """Forward and grad_input partition their writes, so 2 threads must
    reproduce 1 thread bit for bit, run after run (a data race shows up as
    an occasional mismatch).  grad_weight sums per-thread partials: close to
    the 1-thread result, and identical from run to run."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((12, 3, 3, x_shape[3])).astype(np.float32)
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(1)
    y1 = conv2d(x, w, **kwargs)
    dy = rng.standard_normal(y1.shape).astype(np.float32)
    gx1, gw1, _ = conv2d_backward(dy, x, w, **kwargs)
    fastconv.set_num_threads(2)
    gw_first = conv2d_backward(dy, x, w, **kwargs)[1]
    np.testing.assert_allclose(gw_first, gw1, rtol=1e-5, atol=1e-4)
    for _ in range(20):
        y2 = conv2d(x, w, **kwargs)
        gx2, gw2, _ = conv2d_backward(dy, x, w, **kwargs)
        np.testing.assert_array_equal(y2, y1)
        np.testing.assert_array_equal(gx2, gx1)
        np.testing.assert_array_equal(gw2, gw_first)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    ((8, 7, 7, 2048), (512, 1, 1, 2048), {}),                    # ResNet-50's 2048->512 b8
    ((8, 7, 7, 256), (512, 3, 3, 256), dict(padding=1)),         # border pixels' windows
    ((3, 5, 7, 1031), (288, 1, 1, 1031), {}),                    # prime K: a k tail
    ((2, 9, 11, 131), (416, 3, 3, 131), dict(stride=2, padding=1)),
])
def test_large_weights_split_by_output_channels(isa, dtype, x_shape, w_shape, kwargs, request):
    """Per-call weights past 1 MiB with at least as many output channels as
    output pixels: on 2 threads the implicit GEMM splits the output channels
    (each thread packs its share of the weights a block at a time), on 1 it
    runs every pixel alone.  Both against float64 torch, and the same bits,
    forward and input gradient (whose "weights" are the flipped ones, input
    channels as outputs).  The weight gradients too, against torch: at 512
    output channels dy's rows are 2 or 4 KiB apart, and its dy^T slices
    are copied (macro_kernel_ld's kmajor_sets)."""
    rng = np.random.default_rng(list(w_shape))
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    assert w.nbytes > 1 << 20
    ref_y = from_torch(F.conv2d(to_torch(x.astype(np.float64), "NHWC"),
                                torch.from_numpy(w.astype(np.float64).transpose(0, 3, 1, 2)),
                                None, kwargs.get("stride", 1), kwargs.get("padding", 0)), "NHWC")
    assert w_shape[0] >= ref_y.size // w_shape[0]           # OC >= M
    dy = rng.standard_normal(ref_y.shape).astype(dtype)
    _, ref_gx, ref_gw, _ = torch_grads(x, w, np.zeros(w_shape[0], dtype), dy, **kwargs)
    results = []
    for nt in on_1_and_2_threads(isa, request):
        y = conv2d(x, w, algorithm="implicit", **kwargs)
        gx, gw, _ = conv2d_backward(dy, x, w, output_mask=(True, True, False), **kwargs)
        assert_close(y, ref_y, dtype, w[0].size, f"output, {nt} threads")
        assert_close(gx, ref_gx, dtype, w_shape[0] * w_shape[1] * w_shape[2],
                     f"grad_input, {nt} threads")
        assert_close(gw, ref_gw, dtype, dy.size // w_shape[0], f"grad_weight, {nt} threads")
        results.append((y, gx))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


# --------------------------------------------------------------- depthwise

@pytest.mark.parametrize("N, H, W, C, mult, k, s, d, p", [
    (2, 9, 8, 5, 1, 3, 1, 1, 1),
    (1, 12, 11, 6, 3, 3, 2, 1, 1),      # channel multiplier 3
    (3, 7, 9, 4, 2, 5, 1, 2, 3),        # dilated, padding wider than the kernel reach
    (1, 15, 15, 32, 1, 3, 2, 1, 0),
    (2, 6, 6, 8, 1, 1, 1, 1, 0),        # 1x1 depthwise
    (1, 5, 4, 3, 1, 3, 3, 1, 2),        # stride = kernel
    # 3x3 multiplier 1: the register-blocked row kernel
    (2, 13, 17, 37, 1, 3, 1, 1, 1),     # two channel vectors + a tail of 5 (float32)
    (1, 11, 10, 40, 1, 3, 2, 2, 2),     # strided and dilated
    (1, 4, 2, 16, 1, 3, 1, 1, 1),       # no interior pixel in a row
    (1, 8, 7, 24, 1, 3, 1, 3, 0),       # dilation 3, valid
    (1, 3, 3, 576, 1, 3, 1, 1, 1),      # MobileNetV2's widest
    # the weight gradient's tasks: blocks of an image's rows by 64 channels
    (2, 40, 5, 70, 1, 3, 1, 1, 1),      # row blocks of 32 and 8, channel blocks of 64 and 6
    (1, 9, 130, 8, 1, 3, 1, 1, 1),      # rows of 130 pixels: a row a block
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_depthwise_kernels_match_torch(N, H, W, C, mult, k, s, d, p, dtype):
    """groups == C runs the direct depthwise kernels (forward, both
    gradients, and the transposed convolution built on them)."""
    rng = np.random.default_rng(N * 1000 + H * 10 + C)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((C * mult, k, k, 1)).astype(dtype)
    b = rng.standard_normal(C * mult).astype(dtype)
    kwargs = dict(stride=s, dilation=d, padding=p, groups=C)
    y = conv2d(x, w, b, **kwargs)
    dy = rng.standard_normal(y.shape).astype(dtype)
    gx, gw, gb = conv2d_backward(dy, x, w, **kwargs)
    ref_y, ref_gx, ref_gw, ref_gb = torch_grads(x, w, b, dy, **kwargs)
    taps = k * k
    assert_close(y, ref_y, dtype, taps, "output")
    assert_close(gx, ref_gx, dtype, taps * mult, "grad_input")
    assert_close(gw, ref_gw, dtype, dy.size // dy.shape[3], "grad_weight")
    w_t = rng.standard_normal((C, mult, k, k)).astype(dtype)  # (C_in, C_out/groups, KH, KW)
    x_nchw = x.transpose(0, 3, 1, 2)
    y_t = fastconv.conv_transpose2d(x_nchw, w_t, None, stride=s, padding=p, groups=C,
                                    dilation=d, layout="NCHW")
    ref_t = F.conv_transpose2d(torch.from_numpy(np.ascontiguousarray(x_nchw, np.float64)),
                               torch.from_numpy(w_t.astype(np.float64)), None, stride=s,
                               padding=p, groups=C, dilation=d).numpy()
    assert_close(y_t, ref_t, dtype, taps * C, "transposed output")


@pytest.mark.parametrize("x_shape, k", [
    ((1, 14, 14, 320), 3),      # ~1 MFLOP, yet two threads (depthwise flops weigh 4x)
    ((1, 13, 9, 200), 5),       # rows split unevenly; the generic row kernel
])
def test_depthwise_threads_give_identical_results(x_shape, k, request):
    """Small depthwise layers get both threads: forward and grad_input
    partition rows, so 2 threads reproduce 1 thread bit for bit; the weight
    gradient sums per-thread partials (close, and the same run to run)."""
    rng = np.random.default_rng(11)
    C = x_shape[3]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((C, k, k, 1)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    kwargs = dict(padding=k // 2, groups=C)
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(1)
    y1 = conv2d(x, w, b, **kwargs)
    dy = rng.standard_normal(y1.shape).astype(np.float32)
    gx1, gw1, _ = conv2d_backward(dy, x, w, **kwargs)
    ref_y, ref_gx, ref_gw, _ = torch_grads(x, w, b, dy, **kwargs)
    fastconv.set_num_threads(2)
    gw_first = conv2d_backward(dy, x, w, **kwargs)[1]
    assert_close(gw_first, ref_gw, np.float32, dy.size // C, "grad_weight, 2 threads")
    for _ in range(10):
        y2 = conv2d(x, w, b, **kwargs)
        gx2, gw2, _ = conv2d_backward(dy, x, w, **kwargs)
        np.testing.assert_array_equal(y2, y1)
        np.testing.assert_array_equal(gx2, gx1)
        np.testing.assert_array_equal(gw2, gw_first)
    assert_close(y1, ref_y, np.float32, k * k, "output")
    assert_close(gx1, ref_gx, np.float32, k * k, "grad_input")
    assert_close(gw1, ref_gw, np.float32, dy.size // C, "grad_weight, 1 thread")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, kwargs", [
    (576, dict(padding=1)),                       # whole vectors
    (100, dict(padding=1, stride=2)),             # a partial last vector, stride 2
    (72, dict(padding=2, dilation=2)),
    (64, dict(padding=1)),                        # four AVX-512 vectors, the fewest shifted
    (48, dict(padding=1)),                        # three lines: pairs of AVX2 vectors stream,
                                                  # AVX-512's last vector alone
])
def test_depthwise_at_every_input_alignment(isa, dtype, C, kwargs, request):
    """The 3x3 row kernel starts its channel vectors after the first on the
    input's vector boundaries (aligned_head): an input at any offset from a
    line gives the aligned input's output bit for bit (each channel sums
    its taps in the same order), with bias and relu6, and so does dy in the
    stride-1 input gradient (the same kernel); streamed outputs (which keep
    the unshifted vectors) too."""
    rng = np.random.default_rng(C)
    x0 = at_line_offset(rng.standard_normal((2, 9, 11, C)).astype(dtype), 0)
    w = rng.standard_normal((C, 3, 3, 1)).astype(dtype)
    b = rng.standard_normal(C).astype(dtype)
    kwargs = dict(kwargs, groups=C)
    with fastconv._dispatch.use_isa(isa):
        y0 = conv2d(x0, w, b, **kwargs, activation="relu6")
        ref_y, _, _, _ = torch_grads(x0, w, b, np.zeros_like(y0), **kwargs)
        assert_close(y0, np.clip(ref_y, 0, 6), dtype, 9, "aligned output")
        dy0 = at_line_offset(rng.standard_normal(y0.shape).astype(dtype), 0)
        gx0 = conv2d_backward(dy0, x0, w, **kwargs, output_mask=(True, False, False))[0]
        for offset in range(0, 64, x0.itemsize):
            x, dy = at_line_offset(x0, offset), at_line_offset(dy0, offset)
            np.testing.assert_array_equal(
                conv2d(x, w, b, **kwargs, activation="relu6"), y0, f"{offset} bytes off")
            np.testing.assert_array_equal(
                conv2d_backward(dy, x0, w, **kwargs, output_mask=(True, False, False))[0],
                gx0, f"dy {offset} bytes off")
        streamed_outputs(request)
        for offset in (0, 16, 32):
            np.testing.assert_array_equal(
                conv2d(at_line_offset(x0, offset), w, b, **kwargs, activation="relu6"), y0,
                f"streamed, {offset} bytes off")


# ------------------------------------------------------ narrow-group kernels

@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("N, H, W, G, KG, k, s, d, p", [
    (2, 12, 29, 32, 4, 3, 1, 1, 1),     # ResNeXt-like: full pixel blocks and border pixels
    (1, 9, 11, 3, 4, 3, 1, 1, 1),       # 12 channels: a partial vector (float32 AVX-512)
    (1, 9, 7, 5, 2, 3, 2, 1, 1),        # strided, 10 channels
    (2, 10, 13, 2, 8, 5, 1, 2, 2),      # 5x5, dilated
    (1, 6, 20, 2, 16, 3, 1, 1, 1),      # 16-wide groups: broadcast inputs
    (1, 7, 6, 4, 16, 1, 1, 1, 0),       # 1x1, 64 channels
    (1, 8, 9, 3, 8, 3, 3, 1, 0),        # stride = kernel: windows do not overlap
    (1, 6, 6, 2, 4, 3, 1, 1, 3),        # padding past the kernel's reach (stride-1 input
                                        # gradient by the generic path)
    (1, 3, 2, 2, 2, 1, 2, 1, 0),        # stride > kernel
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow_group_kernels_match_torch(isa, N, H, W, G, KG, k, s, d, p, dtype):
    """Groups of KG in and KG out channels run the narrow-group direct
    kernels (auto picks them; forward with bias and activation, both
    gradients, the transposed convolution) under every ISA build: against
    float64 torch."""
    rng = np.random.default_rng(N * 1000 + W * 10 + G * KG)
    C = G * KG
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((C, k, k, KG)).astype(dtype)
    b = rng.standard_normal(C).astype(dtype)
    kwargs = dict(stride=s, dilation=d, padding=p, groups=G)
    geo = fastconv.conv._Geometry((k, k), (s, s), (d, d), (p, p), (1, 1))
    assert fastconv.conv._choose_algorithm("auto", G, C, C, N, geo, (H, W)) == "direct"
    taps = k * k * KG
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, b, **kwargs)
        y_relu6 = conv2d(x, w, b, **kwargs, algorithm="direct", activation="relu6")
        dy = rng.standard_normal(y.shape).astype(dtype)
        gx, gw, gb = conv2d_backward(dy, x, w, **kwargs)
        w_t = rng.standard_normal((C, k, k, KG)).astype(dtype)    # (C_in, KH, KW, C_out/groups)
        y_t = conv_transpose2d(x, w_t, None, stride=s, padding=p, groups=G, dilation=d)
    ref_y, ref_gx, ref_gw, ref_gb = torch_grads(x, w, b, dy, **kwargs)
    assert_close(y, ref_y, dtype, taps, "output")
    assert_close(y_relu6, np.clip(ref_y, 0, 6), dtype, taps, "relu6 output",
                 np.abs(ref_y).max())
    assert_close(gx, ref_gx, dtype, taps, "grad_input")
    assert_close(gw, ref_gw, dtype, dy.size // dy.shape[3], "grad_weight")
    assert_close(gb, ref_gb, dtype, dy.size // dy.shape[3], "grad_bias")
    ref_t = F.conv_transpose2d(torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float64)),
                               torch.from_numpy(w_t.transpose(0, 3, 1, 2).astype(np.float64)),
                               None, stride=s, padding=p, groups=G, dilation=d)
    assert_close(y_t, ref_t.numpy().transpose(0, 2, 3, 1), dtype, taps, "transposed output")


def test_narrow_group_kernels_refuse_what_they_are_not_built_for():
    """The kernel entry points check their operands' shapes themselves."""
    k = fastconv._dispatch.kernels
    x = np.zeros((1, 5, 5, 12), np.float32)
    y = np.zeros((1, 5, 5, 12), np.float32)
    args = ((3, 3), (1, 1), (1, 1), (1, 1), 1)
    with pytest.raises(ValueError, match="not built for groups of 3"):
        k.grouped_direct_forward(x, np.zeros((3, 3, 3, 12), np.float32), None, y, *args)
    with pytest.raises(ValueError, match="output channels"):
        k.grouped_direct_forward(x, np.zeros((3, 3, 4, 12), np.float32), None,
                                 np.zeros((1, 5, 5, 8), np.float32), *args)
    with pytest.raises(ValueError, match="w must be"):
        k.grouped_direct_forward(x, np.zeros((3, 3, 4, 8), np.float32), None, y, *args)
    with pytest.raises(ValueError, match="bias"):
        k.grouped_direct_forward(x, np.zeros((3, 3, 4, 12), np.float32),
                                 np.zeros(8, np.float32), y, *args)
    assert not k.grouped_direct_supports(4, 65) and not k.grouped_direct_supports(32, 3)


# ------------------------------------------------------- implicit GEMM paths

@pytest.mark.parametrize("N, H, W, C, OC, k, s, d, p", [
    (2, 9, 10, 700, 40, 3, 1, 1, 1),    # a tap deeper than KC: channel-split k-blocks
    (1, 12, 12, 600, 70, 3, 2, 1, 1),   # the same, strided
    # pixels 4 KiB apart (one L1 set), read in place: AVX-512's tiles of 12
    # float or 14 double rows in halves; one full panel and a part one
    (2, 8, 9, 1024, 33, 3, 1, 1, 1),
    (2, 9, 9, 512, 40, 1, 2, 1, 0),     # the same by the stride
    (1, 10, 11, 20, 50, 5, 1, 2, 2),    # dilated: several taps per k-block
    (3, 7, 7, 512, 64, 3, 1, 1, 0),     # no padding: every pixel interior
    (2, 30, 31, 3, 16, 7, 2, 1, 3),     # RGB stem: 49 taps of 3 channels
    (1, 6, 7, 24, 600, 3, 1, 1, 1),     # output channels over one packed block (NC 512)
    # An odd number of pixel micro-panels: the threads split the output
    # channels (one thread: all of them), over one chunk of every pixel,
    # packing the weights a block at a time: patch rows under 2 MiB; over
    # it (2.4 MB, 3.2 MB) with weights past 1 MiB, windows for 88 border
    # pixels or none (1x1) ...
    (1, 11, 11, 256, 64, 3, 1, 1, 1),
    (1, 23, 23, 128, 256, 3, 1, 1, 1),
    (8, 7, 7, 2048, 192, 1, 1, 1, 0),
    # ... or, with windows past 2 MiB (38 of 3 x 4800 values), each thread
    # walking every chunk for its share.
    (1, 10, 11, 1600, 64, 3, 1, 1, 1),
    # Images past 2 MiB, whose tiles prefetch the next tile's runs (shadow
    # windows and image runs), 3x3/2 and 1x1/2.
    (2, 24, 25, 512, 16, 3, 2, 1, 1),
    (2, 32, 33, 288, 24, 1, 2, 1, 0),
])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_implicit_gemm_paths_match_torch(N, H, W, C, OC, k, s, d, p, dtype, threads, request):
    """Interior pixels are multiplied straight from the image, border pixels
    through their shadow windows; both, across every k-block shape, on one
    thread or two, must agree with torch."""
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(threads)
    rng = np.random.default_rng(C + OC)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, k, k, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    kwargs = dict(stride=s, dilation=d, padding=p)
    y = conv2d(x, w, b, **kwargs, algorithm="implicit")
    ref_y = F.conv2d(to_torch(x, "NHWC"), torch.from_numpy(
        np.ascontiguousarray(w.transpose(0, 3, 1, 2), np.float64)),
        torch.from_numpy(b.astype(np.float64)), **kwargs)
    assert_close(y, from_torch(ref_y, "NHWC"), dtype, k * k * C, "output")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("view, H, W, kernel, stride, dilation, padding", [
    ("columns reversed", 9, 11, (3, 3), (1, 1), (1, 2), (1, 2)),
    ("rows reversed", 10, 8, (5, 3), (1, 2), (2, 1), (4, 1)),
    ("both reversed", 7, 9, (3, 5), (2, 1), (1, 1), (1, 2)),
    ("channel slice, columns reversed", 8, 8, (3, 3), (2, 2), (1, 1), (1, 1)),
    # a window wider than a row of the image: no pixel inside it, the
    # shadows take a pitch of their own
    ("contiguous", 3, 3, (5, 5), (1, 1), (1, 1), (2, 2)),
    ("rows reversed", 2, 4, (3, 5), (1, 1), (1, 2), (1, 4)),
    # one kernel row: a single band of windows
    ("contiguous", 6, 9, (1, 5), (1, 1), (1, 1), (0, 2)),
    # rows 400 apart: a band at the image's pitch would outweigh the patch
    # rows, so the windows take their own (every pixel a shadow)
    ("rows far apart", 6, 7, (3, 3), (1, 1), (1, 1), (1, 1)),
])
@pytest.mark.parametrize("chunks", ["default", "one panel"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("OC", [20, 101])
def test_implicit_gemm_shadow_windows(isa, view, H, W, kernel, stride, dilation, padding,
                                      chunks, threads, OC, request):
    """Border pixels read their taps from shadow windows laid out at the
    image's own tap offsets, which are negative for views that run
    backwards; every pixel, in the image or in a shadow, must agree with
    torch, whatever the chunking and threads.  101 output channels: on
    AVX-512 (float32) two full panels at once (the paired kernel), a third
    alone and a partial one."""
    if chunks == "one panel":
        one_panel_chunks(request)
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(threads)
    rng = np.random.default_rng(H * W + sum(kernel))
    C = 6
    base = rng.standard_normal((2, H, W, 2 * C if "slice" in view else C))

    if "far apart" in view:
        base = rng.standard_normal((2, 400 * H, W, C))

    def the_view(b):
        v = b[:, ::400] if "far apart" in view else b
        v = v[..., :C]
        if "columns" in view or "both" in view:
            v = v[:, :, ::-1]
        if "rows" in view or "both" in view:
            v = v[:, ::-1]
        return v

    x, x32 = the_view(base), the_view(base.astype(np.float32))
    assert x32.strides[1:3] == tuple(s // 2 for s in x.strides[1:3])
    w = rng.standard_normal((OC, *kernel, C))
    kwargs = dict(stride=stride, dilation=dilation, padding=padding)
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, **kwargs, algorithm="implicit")
        y32 = conv2d(x32, w.astype(np.float32), **kwargs, algorithm="implicit")
    ref = F.conv2d(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
                   torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2))), None,
                   stride, padding, dilation).numpy().transpose(0, 2, 3, 1)
    assert_close(y, ref, np.float64, w[0].size, "output")
    assert_close(y32, ref, np.float32, w[0].size, "float32 output")


def test_shadow_windows_of_far_apart_rows_stay_small():
    """A view whose rows are far apart (here 2000 image rows) must not size
    the shadow windows by its row stride: at the image's pitch one band of
    a 3x3 layer's windows would span two such strides (1.3 MB a thread);
    the windows take their own pitch instead and the call's workspace stays
    that of a few dozen patch rows (nothing kept in the 128 KiB cache)."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((1, 2000 * 6, 7, 6)).astype(np.float32)
    x = base[:, ::2000]
    w = rng.standard_normal((20, 3, 3, 6)).astype(np.float32)
    fastconv.release_workspace()
    y = conv2d(x, w, padding=1, algorithm="implicit")
    assert fastconv.release_workspace() < 128 * 1024
    ref = F.conv2d(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
                   torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2))),
                   None, 1, 1).numpy().transpose(0, 2, 3, 1)
    assert_close(y, ref.astype(np.float64), np.float32, w[0].size, "output")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("kernel, stride, dilation, padding", [
    ((3, 5), (2, 1), (2, 1), (2, 2)),   # rows dilated, taps along a row adjacent
    ((5, 3), (1, 2), (1, 1), (1, 0)),   # blocks of whole kernel rows, strided columns
    ((3, 3), (1, 1), (1, 2), (1, 2)),   # dilated along rows: taps stay separate
])
@pytest.mark.parametrize("pixels", ["dense", "channel slice"])
def test_implicit_gemm_kernel_rows_read_as_runs(isa, kernel, stride, dilation, padding, pixels):
    """With dense pixels and no dilation along rows, a kernel row's taps are
    multiplied as one run of KW*C values; a channel slice of a wider image
    (pixels further apart than C) or a row dilation keeps them apart."""
    rng = np.random.default_rng(sum(kernel) + sum(stride))
    wide = rng.standard_normal((2, 23, 21, 5 if pixels == "dense" else 8)).astype(np.float32)
    x = wide[..., :5]
    w = rng.standard_normal((40, *kernel, 5)).astype(np.float32)
    kwargs = dict(stride=stride, dilation=dilation, padding=padding)
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, **kwargs, algorithm="implicit")
    ref = F.conv2d(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
                   torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), None, stride, padding,
                   dilation).numpy().transpose(0, 2, 3, 1)
    assert_close(y, ref.astype(np.float64), np.float32, w[0].size, "output")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("N, H, C, OC, k, s, p", [
    # (each > 4 MFLOP, so that 2 threads share it)
    # patch rows >= 2x patch columns: the patches on the left of the GEMM
    (4, 24, 16, 20, 3, 1, 1),           # 2304 rows of 144 columns
    (4, 40, 3, 13, 7, 2, 3),            # RGB stem, 147 columns
    (4, 24, 70, 16, 1, 1, 0),           # 1x1: the image read in place
    # fewer patch rows, or twice as many output channels as patch columns
    # (AVX2 with chunks shared by the threads: four times): dy on the left
    (1, 8, 96, 48, 3, 1, 1),            # 64 rows of 864 columns
    (2, 8, 600, 40, 1, 1, 0),           # 1x1, 128 rows of 600 columns
    (8, 48, 16, 40, 1, 2, 0),           # 1x1/2, 4608 rows of 16 columns, 40 channels
    # 1x1 with more output channels than input channels: one GEMM over all
    # pixels (default chunks: one), or each thread its chunks of pixels
    # (one panel a chunk) with the image's rows read in place where narrow
    # (32 or 64 float32, 32 float64 values on AVX-512), packed where not
    (4, 24, 32, 96, 1, 1, 0),
    (4, 24, 64, 160, 1, 1, 0),
    (4, 24, 48, 112, 1, 1, 0),
    (4, 24, 16, 80, 1, 1, 0),           # five times as many: dy on the left on AVX2 too
    # the patches on the left with 64 and 128 output channels: dy's rows
    # read in place (at most 512 bytes: 128 float32, 64 float64 values)
    (4, 24, 16, 64, 3, 1, 1),
    (4, 24, 32, 128, 3, 1, 1),
])
@pytest.mark.parametrize("chunks", ["default", "one panel"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_in_either_operand_order(isa, N, H, C, OC, k, s, p, chunks, threads,
                                                 dtype, request):
    """The weight gradient puts whichever of dy and the patch matrix fits
    the GEMM better on its left (conv_frame grad_weight_patches_left); both
    orders, with threads splitting chunks of patch rows (one panel per
    chunk) or the patch columns (one chunk, or, for 64 rows of 864 columns
    in one-panel chunks on 2 threads, six: with dy on the left they are
    summed straight into dw, the first stored over it), must agree with
    torch."""
    if chunks == "one panel":
        one_panel_chunks(request)
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(threads)
    rng = np.random.default_rng(C * OC + k)
    x = rng.standard_normal((N, H, H, C)).astype(dtype)
    w = rng.standard_normal((OC, k, k, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    OH = (H + 2 * p - k) // s + 1
    dy = rng.standard_normal((N, OH, OH, OC)).astype(dtype)
    _, _, ref_gw, _ = torch_grads(x, w, b, dy, stride=s, padding=p)
    with fastconv._dispatch.use_isa(isa):
        gw = conv2d_backward(dy, x, w, s, p, output_mask=(False, True, False))[1]
    assert_close(gw, ref_gw, dtype, N * OH * OH, "grad_weight")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("N, H, C, OC, k, s, p", [
    (1, 8, 96, 48, 3, 1, 1),     # dy on the left: one chunk, or six (one panel a chunk)
    (1, 7, 64, 32, 3, 1, 1),     # 49 pixels, a 7x7 image at batch 1
    (2, 8, 600, 40, 1, 1, 0),    # 1x1, the image read in place
    (2, 12, 40, 24, 1, 2, 0),    # 1x1/2, patch rows built
    (4, 24, 16, 64, 3, 1, 1),    # the patches on the left, chunks shared by the threads
    (4, 24, 32, 96, 1, 1, 0),    # 1x1, more output than input channels: one GEMM
])
@pytest.mark.parametrize("chunks", ["default", "one panel"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_kernel_overwrites_dw(isa, N, H, C, OC, k, s, p, chunks, threads,
                                              dtype, request):
    """The weight-gradient kernel's contract is dw overwritten, whatever it
    held: given a dw of NaNs, every path (a GEMM, chunks summed into
    per-thread accumulators, or straight into dw, the first stored over it)
    must leave none and agree with torch."""
    if chunks == "one panel":
        one_panel_chunks(request)
    rng = np.random.default_rng(C * OC + k + s)
    x = rng.standard_normal((N, H, H, C)).astype(dtype)
    w = rng.standard_normal((OC, k, k, C)).astype(dtype)
    OH = (H + 2 * p - k) // s + 1
    dy = rng.standard_normal((N, OH, OH, OC)).astype(dtype)
    _, _, ref_gw, _ = torch_grads(x, w, np.zeros(OC, dtype), dy, stride=s, padding=p)
    dw = np.full((OC, k * k * C), np.nan, dtype)
    with fastconv._dispatch.use_isa(isa) as kernels:
        kernels.conv2d_grad_weight(x, dy.reshape(-1, OC), dw, (k, k), (s, s), (1, 1), (p, p),
                                   (OH, OH), threads)
    assert_close(dw.reshape(OC, k, k, C), ref_gw, dtype, N * OH * OH, "grad_weight")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("chunks", ["default", "one panel"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, C, OC", [(1, 64, 192), (3, 32, 64)])
def test_grouped_weight_gradient_reads_slices(isa, k, C, OC, chunks, dtype, request):
    """Two groups' weight gradients, each from channel slices of x and dy
    (their pixels C and OC values apart): a 1x1 layer with more output
    than input channels (the GEMM over all pixels, or per-thread chunks
    reading the image slice in place), and a 3x3 layer whose 32-channel
    dy slices sit next to the patches (read in place)."""
    if chunks == "one panel":
        one_panel_chunks(request)
    rng = np.random.default_rng(7 + k)
    x = rng.standard_normal((4, 24, 24, C)).astype(dtype)
    w = rng.standard_normal((OC, k, k, C // 2)).astype(dtype)
    dy = rng.standard_normal((4, 24, 24, OC)).astype(dtype)
    wt = torch.from_numpy(w.transpose(0, 3, 1, 2).astype(np.float64)).requires_grad_()
    ref = F.conv2d(torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float64)), wt, None,
                   padding=k // 2, groups=2)
    ref.backward(torch.from_numpy(dy.transpose(0, 3, 1, 2).astype(np.float64)))
    with fastconv._dispatch.use_isa(isa):
        gw = conv2d_backward(dy, x, w, padding=k // 2, groups=2,
                             output_mask=(False, True, False))[1]
    assert_close(gw, wt.grad.numpy().transpose(0, 2, 3, 1), dtype, 4 * 24 * 24, "grad_weight")


# ------------------------------------------------- algorithms and epilogues

ALGORITHM_CASES = [
    # x_shape, w_shape, kwargs, algorithms that apply
    ((2, 11, 9, 6), (8, 3, 3, 6), dict(padding=1), ("implicit", "im2col", "winograd")),
    ((1, 10, 10, 8), (16, 3, 3, 4), dict(stride=2, groups=2), ("implicit", "im2col")),
    ((2, 7, 6, 12), (20, 1, 1, 12), {}, ("implicit", "im2col", "gemm1x1")),
    ((2, 9, 8, 10), (10, 3, 3, 1), dict(padding=1, groups=10), ("implicit", "im2col", "direct")),
    # 64 output channels: full micro-tiles on aligned rows, which a large
    # output writes with non-temporal stores (forced below by "streamed").
    ((2, 9, 8, 16), (64, 3, 3, 16), dict(padding=1), ("implicit", "im2col", "winograd")),
    ((2, 7, 6, 24), (64, 1, 1, 24), {}, ("implicit", "im2col", "gemm1x1")),
    # Depthwise 3x3 row kernel with the activation fused: whole vectors of
    # 32 channels (streamed when forced), and 40 = vectors + a scalar tail.
    ((2, 9, 8, 32), (32, 3, 3, 1), dict(padding=1, groups=32), ("implicit", "im2col", "direct")),
    ((1, 7, 9, 40), (40, 3, 3, 1), dict(padding=1, groups=40), ("implicit", "direct")),
]


@pytest.mark.parametrize("x_shape, w_shape, kwargs, algorithms", ALGORITHM_CASES)
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("streamed", [False, True], ids=["stored", "streamed"])
def test_every_algorithm_and_activation_match_torch(x_shape, w_shape, kwargs, algorithms,
                                                     activation, dtype, streamed, request):
    if streamed:
        streamed_outputs(request)
    rng = np.random.default_rng(sum(x_shape))
    x = (4 * rng.standard_normal(x_shape)).astype(dtype)   # values past 6 for relu6
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float64))
    wt = torch.from_numpy(w.transpose(0, 3, 1, 2).astype(np.float64))
    ref = F.conv2d(xt, wt, torch.from_numpy(b.astype(np.float64)), **kwargs)
    assert ref.min() < 0 and ref.max() > 6, "both clamps must be exercised"
    # The rounding error is that of the sum before the clamp (relu6 caps the
    # result at 6, not the error of values near it).
    scale = float(ref.abs().max())
    if activation == "relu":
        ref = F.relu(ref)
    elif activation == "relu6":
        ref = F.relu6(ref)
    ref = ref.numpy().transpose(0, 2, 3, 1)
    for algorithm in ("auto", *algorithms):
        y = conv2d(x, w, b, **kwargs, algorithm=algorithm, activation=activation)
        assert_close(y, ref, dtype, w[0].size, f"{algorithm} output", scale)


@pytest.mark.parametrize("x_shape, w_shape, kwargs, algorithms", ALGORITHM_CASES + [
    # Winograd per dilation phase: tiles written (and the residual read) d apart.
    ((2, 13, 11, 8), (8, 3, 3, 8), dict(padding=2, dilation=2), ("implicit", "winograd")),
    # Four 4x4 tiles: Winograd F(2x2, 3x3) for the packed layer.
    ((1, 7, 7, 16), (24, 3, 3, 16), dict(padding=1), ("implicit", "winograd")),
    # Four tiles, 36 x 96 x 96 filter values: per call the fused Winograd path.
    ((1, 7, 7, 96), (96, 3, 3, 96), dict(padding=1), ("implicit", "winograd"))])
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_is_added_before_the_activation(x_shape, w_shape, kwargs, algorithms,
                                                 activation, dtype):
    """conv2d(..., residual=r) = act(conv + bias + r), on every algorithm
    (the GEMM and Winograd epilogues add r; direct kernels add it after),
    from a strided residual, and through PackedConv2d with the activation
    given per call."""
    rng = np.random.default_rng(sum(x_shape) + 1)
    x = (4 * rng.standard_normal(x_shape)).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    ref = F.conv2d(torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float64)),
                   torch.from_numpy(w.transpose(0, 3, 1, 2).astype(np.float64)),
                   torch.from_numpy(b.astype(np.float64)), **kwargs)
    ref = ref.numpy().transpose(0, 2, 3, 1)
    wide = (8 * rng.standard_normal((*ref.shape[:3], 2 * ref.shape[3]))).astype(dtype)
    residual = wide[..., ::2]                              # strided: copied, not aliased
    ref = ref + residual
    scale = float(np.abs(ref).max())
    assert ref.min() < 0 and ref.max() > 6, "both clamps must be exercised"
    if activation is not None:
        ref = np.maximum(ref, 0)
    if activation == "relu6":
        ref = np.minimum(ref, 6)
    before = wide.copy()
    for algorithm in ("auto", *algorithms):
        y = conv2d(x, w, b, **kwargs, algorithm=algorithm, activation=activation,
                   residual=residual)
        assert_close(y, ref, dtype, w[0].size, f"{algorithm} output", scale)
        packed = fastconv.PackedConv2d(w, b, **kwargs, algorithm=algorithm)
        y = packed(x, residual=residual, activation=activation)
        assert_close(y, ref, dtype, w[0].size, f"packed {algorithm} output", scale)
    np.testing.assert_array_equal(wide, before)           # the residual is only read
    # NCHW in, NCHW residual.
    y = conv2d(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2), b, **kwargs, layout="NCHW",
               activation=activation, residual=residual.transpose(0, 3, 1, 2))
    assert_close(y.transpose(0, 2, 3, 1), ref, dtype, w[0].size, "NCHW output", scale)


@pytest.mark.parametrize("residual", [False, True])
def test_no_input_channel_gives_bias_residual_and_activation(residual):
    """With no input channel every output is the bias (+ the residual),
    then the activation: the path that runs no kernel at all."""
    x, w = np.ones((2, 5, 4, 0), np.float32), np.ones((3, 3, 3, 0), np.float32)
    b = np.array([-1.0, 2.0, 7.0], np.float32)
    r = np.random.default_rng(0).standard_normal((2, 5, 4, 3)).astype(np.float32)
    y = conv2d(x, w, b, padding=1, activation="relu6", residual=r if residual else None)
    np.testing.assert_array_equal(y, np.clip(b + r if residual else np.broadcast_to(b, y.shape),
                                             0, 6))


def test_bad_residual_is_refused():
    x, w = np.ones((1, 5, 5, 4), np.float32), np.ones((6, 3, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"residual must have the result's shape \(1, 3, 3, 6\)"):
        conv2d(x, w, residual=np.ones((1, 5, 5, 6), np.float32))
    with pytest.raises(ValueError, match="residual"):
        conv2d(x, w, residual=np.ones((3, 3, 6), np.float32))
    with pytest.raises((TypeError, ValueError), match="residual"):
        conv2d(x, w, residual=np.ones((1, 3, 3, 6), np.float64))
    with pytest.raises((TypeError, ValueError), match="residual"):
        conv2d(x, w, residual="shortcut")
    packed = fastconv.PackedConv2d(w)
    with pytest.raises(ValueError, match="residual"):
        packed(x, residual=np.ones((1, 3, 3, 5), np.float32))
    with pytest.raises(ValueError, match="activation"):
        packed(x, activation="gelu")


@pytest.mark.parametrize("x_shape, w_shape, kwargs, algorithm, message", [
    ((1, 5, 5, 4), (4, 3, 3, 4), {}, "gemm1x1", "1x1"),
    ((1, 5, 5, 4), (4, 1, 1, 4), dict(stride=2), "gemm1x1", "stride 1"),
    ((1, 5, 5, 4), (4, 3, 3, 4), {}, "direct", "groups == C"),
    ((1, 5, 5, 12), (6, 3, 3, 4), dict(groups=3), "direct", "as many output channels"),
    ((1, 5, 5, 12), (12, 3, 3, 3), dict(groups=4), "direct", "2, 4, 8 or 16"),
    ((1, 5, 5, 4), (4, 3, 3, 4), dict(stride=2), "winograd", "stride 1"),
    ((1, 5, 5, 4), (4, 3, 3, 4), {}, "fft", "algorithm"),
])
def test_forced_algorithm_that_does_not_apply_is_refused(x_shape, w_shape, kwargs, algorithm,
                                                         message):
    x = np.ones(x_shape, np.float32)
    w = np.ones(w_shape, np.float32)
    with pytest.raises(ValueError, match=message):
        conv2d(x, w, **kwargs, algorithm=algorithm)


@pytest.mark.parametrize("activation", ["sigmoid", "RELU", ["relu"], 1])
def test_unknown_activation_is_refused(activation):
    with pytest.raises(ValueError, match="activation"):
        conv2d(np.ones((1, 3, 3, 1)), np.ones((1, 1, 1, 1)), activation=activation)


# ------------------------------------------------------------- prepacking

@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    # float32 k-blocks 512 deep: the weight blocks narrow from the GEMM's
    # 512 output channels to 256 (conv_nc_blk), the last one 32 wide
    ((2, 5, 5, 256), (544, 3, 3, 256), dict(padding=1)),
    ((2, 4, 4, 1024), (320, 1, 1, 1024), {}),                   # 160 + 160
    ((1, 7, 7, 2048), (512, 1, 1, 2048), {}),                    # one chunk: own blocks
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_implicit_gemm_with_narrowed_weight_blocks(isa, x_shape, w_shape, kwargs, dtype):
    rng = np.random.default_rng(w_shape[0])
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    expected = F.conv2d(torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float64)),
                        torch.from_numpy(w.transpose(0, 3, 1, 2).astype(np.float64)),
                        torch.from_numpy(b.astype(np.float64)),
                        **kwargs).numpy().transpose(0, 2, 3, 1)
    with fastconv._dispatch.use_isa(isa):
        per_call = conv2d(x, w, b, **kwargs, algorithm="implicit")
        packed = fastconv.PackedConv2d(w, b, **kwargs, algorithm="implicit")(x)
    for got, what in ((per_call, "per call"), (packed, "packed")):
        assert_close(got, expected, dtype, w[0].size, what)



@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    ((2, 11, 9, 6), (8, 3, 3, 6), dict(padding=1, activation="relu")),
    ((1, 10, 10, 8), (16, 3, 3, 4), dict(stride=2, groups=2, padding_mode="reflect", padding=1)),
    ((1, 6, 6, 700), (40, 3, 3, 700), dict(padding="same")),          # channel-split k-blocks
    # one chunk, output channels split between threads: per call each
    # thread packs its own share of every block (the last panel partial)
    ((1, 7, 7, 300), (200, 3, 3, 300), dict(padding=1)),
    ((2, 7, 6, 12), (20, 1, 1, 12), {}),                              # gemm1x1: nothing packed
    ((1, 3, 4, 40), (24, 1, 1, 40), dict(activation="relu")),         # 1x1, auto: implicit
    ((2, 9, 8, 10), (10, 3, 3, 1), dict(padding=1, groups=10)),       # depthwise: auto, direct
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_conv_equals_conv2d(isa, x_shape, w_shape, kwargs, dtype):
    rng = np.random.default_rng(sum(w_shape))
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    with fastconv._dispatch.use_isa(isa):
        layer = fastconv.PackedConv2d(w, b, **kwargs, algorithm="implicit")
        auto = fastconv.PackedConv2d(w, b, **kwargs)
        w[...] = 0                       # the layers own copies
        b[...] = 0
        expected = conv2d(x, layer.weight, layer.bias, **kwargs, algorithm="implicit")
        for _ in range(2):               # packed once, reused
            np.testing.assert_array_equal(layer(x), expected)
        np.testing.assert_array_equal(layer(x[:1]), expected[:1])
        # auto may run Winograd on the prepacked filters (its own tests
        # bound that error): close, not bitwise.
        assert_close(auto(x), expected.astype(np.float64), dtype, w[0].size * 10,
                     "auto-packed")


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("w_shape, groups", [
    ((10, 3, 3, 1), 10),          # depthwise
    ((20, 3, 3, 1), 10),          # depthwise, multiplier 2
    ((16, 3, 3, 4), 4),           # narrow groups of 4
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_direct_rearranges_its_weights_once(isa, w_shape, groups, dtype, monkeypatch):
    """PackedConv2d keeps the direct kernels' tap-major weights (depthwise
    and narrow groups): its calls equal conv2d's bit for bit, and after the
    first none rearranges the weights again."""
    rng = np.random.default_rng(sum(w_shape))
    x = rng.standard_normal((2, 9, 8, w_shape[3] * groups)).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    kwargs = dict(padding=1, groups=groups, activation="relu")
    with fastconv._dispatch.use_isa(isa):
        expected = conv2d(x, w, b, **kwargs, algorithm="direct")
        expected_crop = conv2d(x[:1, 1:], w, b, **kwargs, algorithm="direct")
        layer = fastconv.PackedConv2d(w, b, **kwargs)
        w[...] = 0                       # the layer owns a copy
        np.testing.assert_array_equal(layer(x), expected)
        assert [key[1] for key in layer._packs] == ["direct"]
        rearranged = []
        original = fastconv.conv._direct_tap_weights
        monkeypatch.setattr(fastconv.conv, "_direct_tap_weights",
                            lambda *args: rearranged.append(args) or original(*args))
        np.testing.assert_array_equal(layer(x), expected)
        np.testing.assert_array_equal(layer(x[:1, 1:]), expected_crop)
        assert rearranged == []
        np.testing.assert_array_equal(conv2d(x, layer.weight, b, **kwargs), expected)
        assert len(rearranged) == 1      # conv2d rearranges per call


@pytest.mark.parametrize("N, H, C, OC, prepacked, expected", [
    (1, 7, 2048, 512, False, "short-m"),     # 49 pixels, 512+ channels in and out
    (1, 7, 512, 2048, False, "short-m"),
    (1, 7, 1024, 256, False, "implicit"),    # 256 output channels: a tie; 1024 > 2 x 49
    (2, 7, 2048, 512, False, "implicit"),    # 98 pixels
    (1, 7, 2048, 512, True, "implicit"),     # prepacked: implicit GEMM packs nothing
    (8, 7, 2048, 512, True, "implicit"),     # 2048 > 2 x 392
    (1, 14, 256, 1024, False, "implicit"),   # over 64 output channels, 196 pixels
    (1, 56, 64, 256, True, "implicit"),      # 3136 pixels
    (8, 56, 64, 256, True, "gemm1x1@avx512"),   # 25088 pixels, 64 input channels
    (8, 28, 512, 128, False, "implicit"),    # 512 input channels: over one GEMM k-block
    (8, 56, 256, 64, True, "gemm1x1@avx512"),   # 64 output channels: the GEMM frame
    (1, 14, 256, 64, False, "gemm1x1@avx512"),  # 256 < 2 x 196
    (8, 112, 32, 15, False, "gemm1x1"),      # under 16 output channels: narrow output
    (1, 7, 2048, 64, False, "implicit"),     # 2048 > 2 x 49 pixels
])
def test_auto_picks_for_pointwise(N, H, C, OC, prepacked, expected):
    """"short-m": gemm1x1, whose GEMM runs the short-M kernels, on the
    builds that have them (AVX-512, and AVX2 for float32; float64 while A^T packed
    fits, not at 2048 input channels); implicit GEMM on the others.
    "gemm1x1@avx512": gemm1x1 on AVX-512, implicit GEMM on the AVX2 and
    baseline builds (measured faster there for 16 or more output channels)."""
    geo = fastconv.conv._Geometry((1, 1), (1, 1), (1, 1), (0, 0), (H, H))
    for dtype in ("float32", "float64"):
        want = expected
        if expected == "gemm1x1@avx512":
            want = "gemm1x1" if fastconv._dispatch.kernels.ISA == "avx512" else "implicit"
        if expected == "short-m":
            short = (has_short_m(fastconv._dispatch.kernels.ISA, dtype)
                     and (dtype == "float32" or C < 2048))
            want = "gemm1x1" if short else "implicit"
        got = fastconv.conv._choose_algorithm("auto", 1, C, OC, N, geo, (H, H), prepacked, dtype)
        assert got == want, dtype


def test_auto_keeps_gemm1x1_for_grouped_pointwise():
    """The AVX2 and baseline builds' implicit GEMM for 1x1 layers of 16 or
    more output channels was measured ungrouped only: a grouped 1x1 layer on
    a large image keeps gemm1x1 on every build."""
    geo = fastconv.conv._Geometry((1, 1), (1, 1), (1, 1), (0, 0), (56, 56))
    for dtype in ("float32", "float64"):
        assert fastconv.conv._choose_algorithm("auto", 2, 64, 256, 8, geo, (56, 56), False,
                                               dtype) == "gemm1x1"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N, H, W, C, OC", [
    (1, 7, 7, 512, 512),      # 49 pixels: 3 vectors and the extra row (float32)
    (1, 5, 7, 520, 517),      # 35 pixels; C past a vector, OC past a short tile
    (1, 4, 4, 512, 600),      # 16 pixels: one vector, no extra row
    (2, 3, 3, 640, 512),      # 18 pixels over two images
])
def test_pointwise_short_image_matches_torch(N, H, W, C, OC, dtype, request):
    """1x1 layers on at most 49 pixels with 512+ channels in and out: auto
    runs gemm1x1, whose GEMM takes the short-M kernels on AVX-512 and, for
    float32, AVX2 (the weights read in place; implicit GEMM on the other
    builds); with bias, a residual and relu6, NHWC and NCHW, 1 and 2
    threads, against torch in float64."""
    rng = np.random.default_rng([N, H, W, C, OC, np.dtype(dtype).itemsize])
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 1, 1, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    res = rng.standard_normal((N, H, W, OC)).astype(dtype)
    geo = fastconv.conv._Geometry((1, 1), (1, 1), (1, 1), (0, 0), (H, W))
    short = has_short_m(fastconv._dispatch.kernels.ISA, dtype)
    assert fastconv.conv._choose_algorithm("auto", 1, C, OC, N, geo, (H, W), False,
                                           np.dtype(dtype).name) == (
        "gemm1x1" if short else "implicit")
    exact = F.conv2d(torch.from_numpy(x).double().permute(0, 3, 1, 2),
                     torch.from_numpy(w).double().permute(0, 3, 1, 2),
                     torch.from_numpy(b).double()).permute(0, 2, 3, 1).numpy() + res
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    for nt in (1, 2):
        fastconv.set_num_threads(nt)
        got = conv2d(x, w, b, residual=res, activation="relu6")
        assert_close(got, np.clip(exact, 0, 6), dtype, C, f"NHWC, {nt} threads")
        got = conv2d(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2), b, layout="NCHW")
        assert_close(got, (exact - res).transpose(0, 3, 1, 2), dtype, C, f"NCHW, {nt} threads")
        assert_close(conv2d(x, w, algorithm="implicit"), exact - res - b, dtype, C,
                     f"implicit, {nt} threads")


def test_packed_weights_of_another_layer_are_refused():
    kernels = fastconv._dispatch.kernels
    w_small = np.ones((8, 3 * 3 * 4), np.float32)
    w_big = np.ones((16, 3 * 3 * 4), np.float32)
    packed = kernels.pack_conv_weights(w_small, (3, 3), 1)
    x = np.ones((1, 5, 5, 4), np.float32)
    y = np.empty((9, 16), np.float32)
    with pytest.raises(ValueError, match="packed"):
        kernels.conv2d_forward(x, w_big, None, y, (3, 3), (1, 1), (1, 1), (0, 0), (3, 3), 1,
                               0, packed)


# ------------------------------------------------------ groups in parallel

@pytest.mark.parametrize("groups, C, OC, kernel, kwargs", [
    (2, 8, 6, 3, dict(padding=1)),
    (3, 12, 9, 3, dict(stride=2, padding=1)),
    (4, 64, 64, 3, dict(padding=1)),                    # 16 per group: Winograd
    (32, 128, 128, 3, dict(padding=1)),                 # ResNeXt: 4 channels per group
    (4, 16, 8, 1, dict(stride=2)),                      # strided 1x1
    (4, 16, 32, 1, {}),                                 # 1x1, more out than in per group
    (2, 32, 16, 1, {}),                                 # 1x1, fewer
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_groups_in_parallel_match_torch_and_each_other(groups, C, OC, kernel, kwargs, dtype,
                                                       request):
    """With at least as many groups as threads, whole groups run on separate
    threads (kernels.conv2d_*_groups); with fewer, one after another.  Both
    against torch, and forward and grad_input bit for bit the same whatever
    the thread count (each group's result does not depend on it)."""
    rng = np.random.default_rng(groups * C)
    x = rng.standard_normal((2, 15, 13, C)).astype(dtype)
    w = rng.standard_normal((OC, kernel, kernel, C // groups)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    results = {}
    for nt in (1, 2, 3, groups + 1):
        fastconv.set_num_threads(nt)
        y = conv2d(x, w, b, groups=groups, **kwargs)
        dy = np.random.default_rng(1).standard_normal(y.shape).astype(dtype)
        packed = fastconv.PackedConv2d(w, b, groups=groups, **kwargs)(x)
        results[nt] = (y, packed) + conv2d_backward(dy, x, w, groups=groups, **kwargs)
    ref_y, ref_gx, ref_gw, _ = torch_grads(x, w, b, dy, groups=groups, **kwargs)
    depth = kernel * kernel * C // groups
    for nt, (y, packed, gx, gw, gb) in results.items():
        assert_close(y, ref_y, dtype, depth * 10, f"output, {nt} threads")   # maybe Winograd
        assert_close(packed, ref_y, dtype, depth * 10, f"packed output, {nt} threads")
        assert_close(gx, ref_gx, dtype, depth * 10, f"grad_input, {nt} threads")
        assert_close(gw, ref_gw, dtype, y.shape[0] * y.shape[1] * y.shape[2], "grad_weight")
        np.testing.assert_array_equal(y, results[1][0])
        np.testing.assert_array_equal(packed, results[1][1])
        np.testing.assert_array_equal(gx, results[1][2])


# ------------------------------------------------- 1x1 layers with few outputs

@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("OC, C, extras", [
    (3, 64, dict()),
    (2, 17, dict(bias=True)),
    (15, 256, dict(bias=True, activation="relu")),
    (8, 40, dict(residual=True, activation="relu6")),
    (5, 1000, dict(bias=True, residual=True)),      # K rows 4000 bytes: 6 a tile
    (1, 64, dict(bias=True)),                       # one channel: gemv
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow_output_1x1_layers_match_torch(isa, OC, C, extras, dtype):
    """1x1 layers with fewer than 16 output channels run by the narrow-output
    GEMM (the short-M kernels, roles swapped: y^T = w @ x^T) on builds that
    have it, with bias, residual and activation applied around its own
    epilogue; every build must agree with torch."""
    rng = np.random.default_rng(OC * C)
    x = rng.standard_normal((2, 9, 11, C)).astype(dtype)
    w = rng.standard_normal((OC, 1, 1, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype) if extras.get("bias") else None
    r = rng.standard_normal((2, 9, 11, OC)).astype(dtype) if extras.get("residual") else None
    act = extras.get("activation")
    with fastconv._dispatch.use_isa(isa):
        narrow = fastconv.conv._narrow_output_pays(1, x, w.reshape(OC, C))
        y = conv2d(x, w, b, activation=act, residual=r)
    # at most one vector of output channels (AVX-512: 16 float32, 8 float64)
    assert narrow == (has_short_m(isa, dtype)
                      and 2 <= OC <= VECTOR_BYTES[isa] // np.dtype(dtype).itemsize)
    ref = to_torch(x, "NHWC").double()
    ref = F.conv2d(ref, torch.from_numpy(w.transpose(0, 3, 1, 2).astype(np.float64)),
                   None if b is None else torch.from_numpy(b.astype(np.float64)))
    ref = from_torch(ref, "NHWC")
    if r is not None:
        ref = ref + r
    if act is not None:
        ref = np.clip(ref, 0, 6 if act == "relu6" else None)
    assert_close(y, ref, dtype, C, "output")


def test_narrow_output_gemm_refuses_what_it_does_not_run():
    """The kernel entry checks its shapes and its limits (no read past w or
    x, no write past y)."""
    kernels = fastconv._dispatch.kernels
    x = np.zeros((40, 8), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        kernels.narrow_output_gemm(x, np.zeros((3, 9), np.float32), 0.0,
                                   np.zeros((40, 3), np.float32), 1)
    with pytest.raises(ValueError):
        kernels.narrow_output_gemm(x, np.zeros((40, 8), np.float32), 0.0,
                                   np.zeros((40, 40), np.float32), 1)
