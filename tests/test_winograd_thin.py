"""Winograd F(2x2, 3x3) for thin layers (fewer than 16 input channels): the
kernels' thin path (_kernels/winograd_thin_kernel.h), which conv2d runs for
algorithm="winograd" on such layers (and auto on AVX-512 builds), checked
against float64 torch under every ISA build."""

import numpy as np
import pytest

import fastconv
import fastconv.conv
from fastconv import conv2d
from reference import at_line_offset, explicit_pads
from test_winograd import (ERROR_RATIO, assert_same_for_every_thread_count,
                           assert_specials_stay_in_tiles, check_against_direct, check_nchw_input,
                           data_gradient_reference, max_error, reference)

ISAS = fastconv._dispatch.AVAILABLE


@pytest.fixture
def data_grad_tiles(monkeypatch):
    """The tile size of each Winograd input gradient run from here on (a
    list, appended to by a wrapper of conv._winograd_data_grad)."""
    tiles = []
    data_grad = fastconv.conv._winograd_data_grad
    monkeypatch.setattr(fastconv.conv, "_winograd_data_grad",
                        lambda *a, **kw: tiles.append(kw.get("tile")) or data_grad(*a, **kw))
    return tiles


CASES = [
    # (N, H, W, C, OC), padding
    ((1, 1, 1, 1, 1), 1),                      # one pixel, one channel
    ((2, 7, 9, 3, 5), 1),                      # odd sizes: partial last tiles, part vector
    ((1, 8, 8, 3, 64), 0),                     # whole tiles, valid
    ((3, 13, 11, 4, 33), ((2, 0), (1, 2))),    # primes, asymmetric padding
    ((1, 5, 23, 2, 24), "same"),
    ((1, 2, 2, 5, 6), ((0, 5), (0, 5))),       # windows wholly in the padding
    ((1, 3, 300, 1, 16), 1),                   # C 1: 150 tiles a row, two chunks
    ((2, 6, 41, 15, 20), 2),                   # C 15: 8-tile chunks, a short last one
    ((1, 9, 10, 8, 130), ((3, 1), (0, 4))),    # C 8 (the loop kernel), 9 vectors
    ((1, 4, 4, 7, 3), ((4, 4), (4, 4))),       # output all from padding at the edges
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape, padding", CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thin_winograd_matches_reference(isa, shape, padding, dtype):
    N, H, W, C, OC = shape
    rng = np.random.default_rng(H * W + C)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    geo = fastconv.conv._conv_setup(x, w, 1, padding, 1, 1, "zeros", "NHWC").geo
    assert fastconv.conv._winograd_variant(N, geo, C, OC, dtype) == "thin"
    with fastconv._dispatch.use_isa(isa):
        check_against_direct(x, w, b, padding)
        check_against_direct(x, w, None, padding)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("OC", [64, 40])          # whole vectors; a part one
def test_thin_winograd_epilogue(isa, activation, dtype, OC, request):
    """Bias, activation and a residual, on plain and streamed stores (the
    stream threshold set to 0; streaming needs whole vectors of channels)."""
    rng = np.random.default_rng(3)
    x = (4 * rng.standard_normal((2, 11, 10, 3))).astype(dtype)   # past 6 for relu6
    w = rng.standard_normal((OC, 3, 3, 3)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    res = rng.standard_normal((2, 11, 10, OC)).astype(dtype)
    with fastconv._dispatch.use_isa(isa) as kernels:
        for stream_bytes in (None, 0):
            if stream_bytes is not None:
                previous = kernels.set_stream_bytes(stream_bytes)
            try:
                check_against_direct(x, w, b, activation=activation)
                check_against_direct(x, w, None, activation=activation)
                y = conv2d(x, w, b, padding=1, activation=activation, residual=res,
                           algorithm="winograd")
                ref = reference(x, w, b, ((1, 1), (1, 1)))
                ref = ref + res
                if activation is not None:
                    ref = np.maximum(ref, 0)
                if activation == "relu6":
                    ref = np.minimum(ref, 6)
                tol = 1e-12 if dtype == np.float64 else 2e-5
                assert max_error(y, ref) <= tol * np.abs(ref).max()
            finally:
                if stream_bytes is not None:
                    kernels.set_stream_bytes(previous)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("view", ["channel-slice", "pixel-stride", "reversed-rows",
                                  "reversed-columns", "nchw", "line-offset"])
def test_thin_winograd_reads_strided_inputs(isa, view):
    """Pixels further apart than their channels (a channel slice, a pixel
    stride), negative strides, an NCHW input, and an input off its lines."""
    rng = np.random.default_rng(4)
    base = rng.standard_normal((2, 18, 22, 5)).astype(np.float32)
    w = rng.standard_normal((12, 3, 3, 3)).astype(np.float32)
    with fastconv._dispatch.use_isa(isa):
        if view == "nchw":
            check_nchw_input(base[..., :3], w)
            return
        if view == "line-offset":
            x = at_line_offset(np.ascontiguousarray(base[..., :3]), 4)
        else:
            x = {"channel-slice": base[..., 1:4], "pixel-stride": base[:, ::2, ::2, :3],
                 "reversed-rows": base[:, ::-1, :, :3],
                 "reversed-columns": base[:, :, ::-1, 2:]}[view]
        check_against_direct(x, w)


def test_thin_winograd_is_independent_of_the_thread_count(request):
    """Each band of two output rows is computed whole by one thread."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 29, 31, 3)).astype(np.float32)
    w = rng.standard_normal((40, 3, 3, 3)).astype(np.float32)
    assert_same_for_every_thread_count(request, x, w)


def test_thin_winograd_error_is_documented_size():
    """The benchmarks/README.md figure: VGG16 conv1_1 (3 -> 64 @224, N(0, 1)
    inputs and weights), thin Winograd's float32 error vs float64 about the
    direct method's (measured 0.78-0.85x in max norm, 1.25x RMS, over three
    seeds; with 8 and 15 channels 0.4-0.6x max, 0.8-0.9x RMS)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 224, 224, 3)).astype(np.float32)
    w = rng.standard_normal((64, 3, 3, 3)).astype(np.float32)
    ref = reference(x, w, None, ((1, 1), (1, 1)))
    err = max_error(conv2d(x, w, padding=1, algorithm="winograd"), ref)
    direct = max_error(conv2d(x, w, padding=1, algorithm="implicit"), ref)
    assert err <= 2 * direct


@pytest.mark.parametrize("isa", ISAS)
def test_thin_winograd_nan_and_inf_stay_in_their_tiles(isa):
    """A NaN or inf in the input spreads over the 2x2 output tiles whose
    4x4 windows contain it, never beyond (the chunk's row transforms run
    along whole rows, but each tile reads only its own window's values);
    every output PyTorch makes non-finite is non-finite here too."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 16, 16, 3)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    x[0, 2, 3, 1] = np.nan
    x[0, 13, 12, 2] = np.inf
    with fastconv._dispatch.use_isa(isa):
        y = conv2d(x, w, padding=1, algorithm="winograd")
    assert_specials_stay_in_tiles(x, w, y, ((2, 3), (13, 12)), 2)


@pytest.mark.parametrize("isa", ISAS)
def test_auto_takes_thin_winograd_where_measured(isa):
    """auto: the thin path on AVX-512 builds for images of 100 output pixels
    and more, undilated, one group (conv.py, _thin_winograd_pays)."""
    choose = fastconv.conv._choose_algorithm
    with fastconv._dispatch.use_isa(isa):
        for N, H, W, C, dilation, groups in [(1, 224, 224, 3, 1, 1), (1, 10, 10, 15, 1, 1),
                                             (1, 7, 7, 3, 1, 1), (1, 56, 56, 3, 2, 1),
                                             (1, 56, 56, 8, 1, 2)]:
            x = np.zeros((N, H, W, C), np.float32)
            w = np.zeros((32, 3, 3, C // groups), np.float32)
            geo = fastconv.conv._conv_setup(x, w, 1, "same", dilation, groups, "zeros",
                                            "NHWC").geo
            alg = choose("auto", groups, C, 32, N, geo, (H, W))
            thin = (isa == "avx512" and C < 16 and H * W >= 100 and dilation == 1
                    and groups == 1)
            assert (alg == "winograd") == thin, (isa, N, H, W, C, dilation, groups, alg)
        # 16 channels: the general path's (its own rule, _winograd_pays)
        assert not fastconv.conv._is_thin_winograd(geo, 16)


def test_packed_thin_layer_packs_nothing():
    """PackedConv2d of a thin layer runs the same thin path per call: no
    packed filters kept, the result bit-identical to conv2d's."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 20, 21, 3)).astype(np.float32)
    w = rng.standard_normal((16, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    layer = fastconv.PackedConv2d(w, b, padding=1, activation="relu", algorithm="winograd")
    np.testing.assert_array_equal(
        layer(x), conv2d(x, w, b, padding=1, activation="relu", algorithm="winograd"))
    assert layer._packs == {}


def test_thin_winograd_kernel_refuses_bad_arguments():
    """The kernel entry checks the weight's shape against the image (a
    wrong C is a ValueError, never a read past the weights)."""
    kernels = fastconv._dispatch.kernels
    x = np.zeros((1, 6, 6, 3), np.float32)
    y = np.zeros((36, 8), np.float32)
    with pytest.raises(ValueError, match="w must be"):
        kernels.conv2d_winograd(x, np.zeros((8, 9 * 4), np.float32), None, y, (1, 1), (6, 6),
                                1, tile=2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape, padding", [
    # (N, H, W, C, OC) of the forward layer: the input gradient convolves
    # dy's OC (thin) channels into C
    ((2, 14, 15, 64, 3), 1),
    ((1, 19, 23, 40, 15), ((2, 0), (1, 2))),   # part vectors, asymmetric padding
    ((1, 9, 10, 130, 8), 0),                   # flipped padding 2: edges all padding
    ((3, 7, 5, 16, 1), 2),                     # flipped padding 0
    ((1, 12, 11, 24, 5), 3),                   # flipped padding below zero: a crop
], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thin_input_gradient_matches_torch(isa, shape, padding, dtype, data_grad_tiles,
                                           monkeypatch):
    """A 3x3 stride-1 layer with few output channels has a thin input
    gradient (dy's channels in, the layer's input channels out), which the
    thin path runs with the weight's taps reversed and its channels
    swapped: against float64 torch under every ISA build, within 10x the
    direct path's error."""
    N, H, W, C, OC = shape
    rng = np.random.default_rng(H * W + OC)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    pads = explicit_pads(padding, (H, W), (3, 3), (1, 1), (1, 1))
    (top, bottom), (left, right) = pads
    dy = rng.standard_normal((N, H + top + bottom - 2, W + left + right - 2, OC)).astype(dtype)
    ref = data_gradient_reference(x, w, dy, pads)
    tiles = data_grad_tiles
    # the thin path under every build (auto takes it on AVX-512 only)
    monkeypatch.setattr(fastconv.conv, "_thin_winograd_pays", lambda *args: True)
    with fastconv._dispatch.use_isa(isa):
        gx = fastconv.conv2d_backward(dy, x, w, padding=padding,
                                      output_mask=(True, False, False))[0]
        assert tiles == [2]
        monkeypatch.setattr(fastconv.conv, "_thin_winograd_pays", lambda *args: False)
        direct = fastconv.conv2d_backward(dy, x, w, padding=padding,
                                          output_mask=(True, False, False))[0]
    assert tiles == [2]          # not Winograd: few input channels for the general path
    scale = np.abs(ref).max()
    if dtype == np.float64:
        assert max_error(gx, ref) <= 1e-12 * scale
        return
    assert max_error(gx, ref) <= ERROR_RATIO * max(max_error(direct, ref), 1e-7 * scale)
    assert not np.array_equal(gx, direct)   # two paths ran


def test_auto_takes_the_thin_input_gradient_where_measured(data_grad_tiles):
    """auto runs a thin input gradient (few output channels) by the thin
    path where the forward rule would (_thin_winograd_pays, of the flipped
    geometry): on AVX-512 builds, 100 output pixels and more."""
    tiles = data_grad_tiles
    rng = np.random.default_rng(8)
    for H, expected in [(12, [2] if fastconv._dispatch.kernels.ISA == "avx512" else []),
                        (9, [])]:     # 81 pixels
        tiles.clear()
        x = rng.standard_normal((1, H, H, 32)).astype(np.float32)
        w = rng.standard_normal((3, 3, 3, 32)).astype(np.float32)
        dy = rng.standard_normal((1, H, H, 3)).astype(np.float32)
        fastconv.conv2d_backward(dy, x, w, padding=1, output_mask=(True, False, False))
        assert tiles == expected, H


@pytest.mark.parametrize("isa", ISAS)
def test_thin_input_gradient_keeps_specials_in_tiles(isa, monkeypatch):
    """NaN and inf in grad_output spread over the 2x2 tiles of the input
    gradient whose windows hold them (the convolution of dy with the
    flipped, channel-swapped kernel), never beyond."""
    monkeypatch.setattr(fastconv.conv, "_thin_winograd_pays", lambda *args: True)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 16, 15, 20)).astype(np.float32)
    w = rng.standard_normal((3, 3, 3, 20)).astype(np.float32)
    dy = rng.standard_normal((1, 16, 15, 3)).astype(np.float32)
    dy[0, 4, 6, 1] = np.nan
    dy[0, 11, 13, 0] = -np.inf
    with fastconv._dispatch.use_isa(isa):
        gx = fastconv.conv2d_backward(dy, x, w, padding=1, output_mask=(True, False, False))[0]
    flipped = np.ascontiguousarray(w[:, ::-1, ::-1, :].transpose(3, 1, 2, 0))
    assert_specials_stay_in_tiles(dy, flipped, gx, ((4, 6), (11, 13)), 2)
