"""Winograd F(4x4, 3x3) and F(2x2, 3x3) (conv2d(..., algorithm="winograd"),
the latter for layers with few tiles) against a float64
PyTorch reference: its float32 error must stay within 10x that of the
direct (implicit GEMM) method on the same inputs, its float64 result within
rounding.  Also: every ISA build, chunking, partial and all-padding tiles,
channel tails, groups, strided inputs, fused epilogues, thread invariance,
NaN/inf, prepacked filters and the auto heuristic."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastconv
import fastconv.conv
from fastconv import conv2d
from reference import at_line_offset, explicit_pads

#: The issue's bound: Winograd's float32 error at most this multiple of the
#: direct method's (both against float64).
ERROR_RATIO = 10.0

#: set_winograd_fused arguments: every layer with per-call filters on the
#: fused path (filters transformed a panel at a time), or none.
ALWAYS_FUSED = (1 << 40, 0)
NEVER_FUSED = (0, 0)


def reference(x, w, b, pads, groups=1, activation=None, dilation=(1, 1)):
    """float64 torch conv of NHWC x, OHWI w, explicit ((t, b), (l, r)) pads."""
    (top, bottom), (left, right) = pads
    xt = torch.from_numpy(x.astype(np.float64).transpose(0, 3, 1, 2))
    xt = F.pad(xt, (left, right, top, bottom))
    wt = torch.from_numpy(w.astype(np.float64).transpose(0, 3, 1, 2))
    bt = None if b is None else torch.from_numpy(b.astype(np.float64))
    y = F.conv2d(xt, wt, bt, groups=groups, dilation=dilation).numpy().transpose(0, 2, 3, 1)
    if activation is not None:
        y = np.maximum(y, 0)
    if activation == "relu6":
        y = np.minimum(y, 6)
    return y


def data_gradient_reference(x, w, dy, pads, groups=1, dilation=(1, 1)):
    """float64 torch gradient, with respect to NHWC x, of reference(x, w,
    None, pads, groups, dilation) for output gradient dy (NHWC)."""
    (top, bottom), (left, right) = pads
    tx = torch.from_numpy(x.astype(np.float64).transpose(0, 3, 1, 2)).requires_grad_()
    tw = torch.from_numpy(w.astype(np.float64).transpose(0, 3, 1, 2))
    F.conv2d(F.pad(tx, (left, right, top, bottom)), tw, groups=groups,
             dilation=dilation).backward(torch.from_numpy(dy.astype(np.float64).transpose(0, 3, 1, 2)))
    return tx.grad.numpy().transpose(0, 2, 3, 1)


def max_error(y, ref):
    return np.abs(y.astype(np.float64) - ref).max()


def check_against_direct(x, w, b=None, padding=1, groups=1, activation=None,
                         dilation=(1, 1), **kw):
    """Run Winograd and implicit GEMM on the same call; Winograd's error vs
    float64 within ERROR_RATIO x the direct one's (float32) or 1e-12
    relative (float64)."""
    pads = explicit_pads(padding, x.shape[1:3], (3, 3), (1, 1), dilation)
    ref = reference(x, w, b, pads, groups, activation, dilation)
    kw["dilation"] = dilation
    y = conv2d(x, w, b, padding=padding, groups=groups, activation=activation,
               algorithm="winograd", **kw)
    assert y.dtype == x.dtype and y.shape == ref.shape
    scale = max(np.abs(ref).max(), 1e-30)
    err = max_error(y, ref)
    if x.dtype == np.float64:
        assert err <= 1e-12 * scale, f"float64 error {err:.3g} of {scale:.3g}"
        return err / scale
    direct = conv2d(x, w, b, padding=padding, groups=groups, activation=activation,
                    algorithm="implicit", **kw)
    # Floor: a direct sum can be exact on tiny cases (one channel, one tap).
    bound = ERROR_RATIO * max(max_error(direct, ref), 1e-7 * scale)
    assert err <= bound, f"winograd error {err:.3g} > {bound:.3g} (10x direct)"
    return err / scale


CASES = [
    # (N, H, W, C, OC), padding, groups
    ((1, 1, 1, 1, 1), 1, 1),                      # one pixel, one channel
    ((2, 7, 9, 3, 5), 1, 1),                      # channel tails below a vector, partial tiles
    ((1, 8, 8, 16, 16), 0, 1),                    # whole tiles, valid
    ((3, 13, 11, 17, 33), ((2, 0), (1, 2)), 1),   # primes, asymmetric padding
    ((1, 5, 23, 40, 7), "same", 1),
    ((1, 2, 2, 4, 6), ((0, 5), (0, 5)), 1),       # tiles whose window is all padding
    ((2, 9, 10, 24, 20), 1, 2),                   # groups: per-group column slices
    ((1, 30, 30, 64, 48), 1, 1),
    ((1, 6, 6, 400, 40), 1, 1),                   # C over one GEMM k-block (KC 256, 384)
    ((1, 4, 4, 8, 600), 1, 1),                    # OC over one packed block (NC 512)
    ((2, 12, 13, 64, 3), 1, 1),                   # an RGB output layer (auto: large images)
]


@pytest.fixture(params=[4, 2], ids=["F4x4", "F2x2"])
def tile(request, monkeypatch):
    """The Winograd variant every conv2d of the test runs (auto takes
    F(2x2) only for prepacked filters and few tiles; the few-tile packed
    column halves have tests of their own)."""
    monkeypatch.setattr(fastconv.conv, "_winograd_variant",
                        lambda N, geo, Cg, OCg, dtype, prepacked=False: request.param)
    return request.param


@pytest.fixture(params=["fused", "default-chunks", "tiny-chunks"])
def chunking(request):
    """fused: the filters transformed a panel at a time (what layers with
    few tiles run when their filters are not prepacked); the chunked path
    otherwise, and with tiny-chunks one micro-panel of tiles per chunk, so
    that small images cross chunk boundaries."""
    kernels = fastconv._dispatch.kernels
    previous_fused = kernels.set_winograd_fused(*(ALWAYS_FUSED if request.param == "fused"
                                                  else NEVER_FUSED))
    request.addfinalizer(lambda: kernels.set_winograd_fused(*previous_fused))
    if request.param == "tiny-chunks":
        previous = kernels.set_winograd_chunk_bytes(1)
        request.addfinalizer(lambda: kernels.set_winograd_chunk_bytes(previous))
    return request.param


def check_whole_and_one_tile_chunks(isa, x, w, b, padding, groups, dilation=(1, 1)):
    """check_against_direct under ISA build `isa`: on the fused path (the
    filters transformed a panel at a time, as per-call layers with few tiles
    run), and on the chunked one with the default chunk budget and with one
    tile per chunk (every chunk boundary exercised)."""
    with fastconv._dispatch.use_isa(isa) as kernels:
        for fused, budget in ((ALWAYS_FUSED, None), (NEVER_FUSED, None), (NEVER_FUSED, 1)):
            previous_fused = kernels.set_winograd_fused(*fused)
            if budget is not None:
                previous = kernels.set_winograd_chunk_bytes(budget)
            try:
                check_against_direct(x, w, b, padding, groups, dilation=dilation)
            finally:
                kernels.set_winograd_fused(*previous_fused)
                if budget is not None:
                    kernels.set_winograd_chunk_bytes(previous)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("shape, padding, groups", CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_winograd_matches_reference(isa, shape, padding, groups, dtype, tile):
    N, H, W, C, OC = shape
    rng = np.random.default_rng(H * W + C)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C // groups)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    check_whole_and_one_tile_chunks(isa, x, w, b, padding, groups)


DILATED_CASES = [
    # (N, H, W, C, OC), padding, dilation, groups
    ((1, 28, 28, 32, 32), 2, (2, 2), 1),              # "same": every phase alike
    ((2, 13, 11, 16, 24), (1, 4), (3, 2), 1),         # phases of unequal sizes
    ((1, 9, 10, 20, 18), 0, (2, 3), 1),
    ((1, 5, 7, 17, 16), 4, (4, 4), 1),                # phases mostly padding
    ((2, 16, 15, 16, 16), ((2, 0), (1, 3)), (2, 1), 1),
    ((1, 6, 6, 16, 16), ((3, 7), (7, 3)), (5, 5), 1), # windows wholly in the padding
    ((1, 12, 11, 64, 64), 2, (2, 3), 4),              # groups in parallel
]


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("shape, padding, dilation, groups", DILATED_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dilated_winograd_matches_reference(isa, shape, padding, dilation, groups, dtype,
                                           tile):
    """A dilated layer's tiles are cut per dilation phase (outputs a + d*i of
    each residue a), their windows and pixels d apart."""
    N, H, W, C, OC = shape
    rng = np.random.default_rng(H * W + C + dilation[0])
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C // groups)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    check_whole_and_one_tile_chunks(isa, x, w, b, padding, groups, dilation)


@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_winograd_epilogue(activation, dtype, chunking, tile):
    rng = np.random.default_rng(3)
    x = (4 * rng.standard_normal((2, 11, 10, 19))).astype(dtype)   # past 6 for relu6
    w = rng.standard_normal((21, 3, 3, 19)).astype(dtype)
    b = rng.standard_normal(21).astype(dtype)
    check_against_direct(x, w, b, activation=activation)
    check_against_direct(x, w, None, activation=activation)


@pytest.mark.parametrize("view", ["pixel-stride", "reversed-rows", "reversed-columns", "nchw"])
def test_winograd_reads_strided_inputs(view, tile):
    rng = np.random.default_rng(4)
    base = rng.standard_normal((2, 18, 22, 16)).astype(np.float32)
    w = rng.standard_normal((12, 3, 3, 16)).astype(np.float32)
    if view == "nchw":
        check_nchw_input(base, w)
        return
    x = {"pixel-stride": base[:, ::2, ::2], "reversed-rows": base[:, ::-1],
         "reversed-columns": base[:, :, ::-1]}[view]
    check_against_direct(x, w)


def check_nchw_input(x, w):
    """conv2d(algorithm="winograd", padding=1) of NHWC x passed as NCHW (and
    OHWI w as OIHW) against float64 torch."""
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    y = conv2d(x_nchw, w.transpose(0, 3, 1, 2), padding=1, layout="NCHW", algorithm="winograd")
    ref = reference(x, w, None, ((1, 1), (1, 1)))
    assert max_error(y.transpose(0, 2, 3, 1), ref) <= 1e-5 * np.abs(ref).max()


def test_winograd_error_is_documented_size():
    """The benchmarks/README.md figure: a ResNet 3x3 256->256 layer, inputs
    and weights N(0, 1), Winograd float32 error vs float64 a few times the
    direct method's (measured 4-10x in max norm, under 5x RMS)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 14, 14, 256)).astype(np.float32)
    w = rng.standard_normal((256, 3, 3, 256)).astype(np.float32)
    rel = check_against_direct(x, w)
    assert rel < 1e-5


def test_winograd_is_independent_of_the_thread_count(request, tile, chunking):
    """Tiles and the 36 GEMMs (or, fused, the output channel panels) are
    each computed whole by one thread, so the result does not depend on how
    many there are, bit for bit (these small filters give each thread
    chunks of its own from 2 threads on; one thread runs the shared-chunk
    loop)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 29, 31, 24)).astype(np.float32)
    w = rng.standard_normal((40, 3, 3, 24)).astype(np.float32)
    assert_same_for_every_thread_count(request, x, w)


def assert_same_for_every_thread_count(request, x, w):
    """conv2d(algorithm="winograd") bit-identical on 1, 2, 3 and 2 threads."""
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    results = []
    for nt in (1, 2, 3, 2):
        fastconv.set_num_threads(nt)
        results.append(conv2d(x, w, padding=1, algorithm="winograd"))
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_winograd_nan_and_inf_stay_in_their_tiles():
    """A NaN or inf in the input spreads over the 4x4 output tiles whose
    6x6 windows contain it (the transforms mix a window), never beyond;
    every output PyTorch makes non-finite is non-finite here too."""
    rng = np.random.default_rng(6)
    # 16 channels: F(4x4) (fewer take the thin path's 2x2 tiles, tested in
    # test_winograd_thin.py)
    x = rng.standard_normal((1, 16, 16, 16)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 16)).astype(np.float32)
    x[0, 2, 3, 1] = np.nan
    x[0, 13, 12, 4] = np.inf
    y = conv2d(x, w, padding=1, algorithm="winograd")
    assert_specials_stay_in_tiles(x, w, y, ((2, 3), (13, 12)), 4)


def assert_specials_stay_in_tiles(x, w, y, specials, m):
    """y = conv2d(x, w, padding=1) by Winograd of m x m tiles, x (one
    image) non-finite at the pixels `specials`: every output PyTorch makes
    non-finite is non-finite, and outside the tiles whose windows hold a
    special every output is finite and right."""
    ref = reference(x, w, None, ((1, 1), (1, 1)))
    assert np.all(~np.isfinite(y[~np.isfinite(ref)]))
    # Tiles of output rows/columns m*t..m*t+m-1 read input rows m*t-1..m*t+m.
    H, W = y.shape[1:3]
    touched = np.zeros((H, W), bool)
    for ih, iw in specials:
        for th in range(-(-H // m)):
            for tw in range(-(-W // m)):
                if m * th - 1 <= ih <= m * th + m and m * tw - 1 <= iw <= m * tw + m:
                    touched[m * th:m * th + m, m * tw:m * tw + m] = True
    clean = y[0][~touched]
    assert np.all(np.isfinite(clean))
    np.testing.assert_allclose(clean, ref[0][~touched], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("OC", [48, 37])        # whole panels; a partial last one
def test_streamed_filter_transform_equals_stored(isa, dtype, OC, request, tile):
    """Filters far larger than the caches are transformed with non-temporal
    stores (forced here for small ones): the same values, for the forward
    and for the input gradient (the flipped weight)."""
    rng = np.random.default_rng(OC)
    x = rng.standard_normal((2, 9, 10, 20)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, 20)).astype(dtype)
    dy = rng.standard_normal((2, 9, 10, OC)).astype(dtype)
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (1, 1), (1, 1), (9, 10))
    flipped = fastconv.conv._flipped_geometry(geo, (9, 10))

    def forward_and_data_grad():
        # PackedConv2d's filters live in a NumPy array, which need not be
        # vector-aligned (streaming is skipped then, never misaligned).
        return (conv2d(x, w, padding=1, algorithm="winograd"),
                fastconv.conv._winograd_data_grad(dy, w.reshape(OC, -1), 1, flipped, x.shape),
                fastconv.PackedConv2d(w, padding=1, algorithm="winograd")(x))

    with fastconv._dispatch.use_isa(isa) as kernels:
        # Per call, these few tiles would take the fused path, which never
        # writes U out.
        previous_fused = kernels.set_winograd_fused(*NEVER_FUSED)
        request.addfinalizer(lambda: kernels.set_winograd_fused(*previous_fused))
        stored = forward_and_data_grad()
        previous = kernels.set_winograd_stream_bytes(0)
        request.addfinalizer(lambda: kernels.set_winograd_stream_bytes(previous))
        for got, expected in zip(forward_and_data_grad(), stored):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C, OC", [(20, 48), (700, 37), (16, 130), (20, 700)])
def test_fused_filters_match_filters_packed_up_front(isa, dtype, C, OC, tile):
    """The fused path (filters transformed a panel of output channels and a
    k-block at a time) against U packed up front, for the forward and for
    the input gradient (the flipped weight: output and input channels
    swap); 700 input channels span several k-blocks (2 of 350 packed up
    front with a KC of 384, 3 or 6 fused), OC = 37 and 130 end
    in a partial panel.  Their k-blocks differ, so sums agree to rounding;
    with 700 input channels they differ in some last bit, which shows the
    fused path ran."""
    rng = np.random.default_rng(C + OC)
    x = rng.standard_normal((1, 9, 10, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    dy = rng.standard_normal((1, 9, 10, OC)).astype(dtype)
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (1, 1), (1, 1), (9, 10))
    flipped = fastconv.conv._flipped_geometry(geo, (9, 10))

    def forward_and_data_grad():
        return (conv2d(x, w, b, padding=1, activation="relu", algorithm="winograd"),
                fastconv.conv._winograd_data_grad(dy, w.reshape(OC, -1), 1, flipped, x.shape))

    rtol = 1e-5 if dtype == np.float32 else 1e-12
    with fastconv._dispatch.use_isa(isa) as kernels:
        results = {}
        previous_short = kernels.set_winograd_short_tiles(0)     # its own test
        try:
            for name, fused in (("fused", ALWAYS_FUSED), ("packed", NEVER_FUSED)):
                previous = kernels.set_winograd_fused(*fused)
                try:
                    results[name] = forward_and_data_grad()
                finally:
                    kernels.set_winograd_fused(*previous)
        finally:
            kernels.set_winograd_short_tiles(previous_short)
    # The forward's input channels are C, the input gradient's OC.
    for got, expected, depth in zip(results["fused"], results["packed"], (C, OC)):
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=0, atol=rtol * scale)
        if depth == 700:
            assert not np.array_equal(got, expected), "the fused path did not run"


def short_m_winograd_runs(isa, dtype, tiles, C):
    """Where the kernels' short-M Winograd path takes per-call forward
    filters: AVX2 float32 (16 registers; AVX-512 has its few-tile path), 8
    (a vector) to 49 tiles, at least 512 input channels, or 256 at up to 16
    tiles."""
    return (isa == "avx2" and np.dtype(dtype) == np.float32 and 8 <= tiles <= 49
            and (C >= 512 or (C >= 256 and tiles <= 16)))


def winograd_tiles(N, H, W, m, dilation=1):
    """m x m output tiles of a 3x3 'same' layer as the kernels cut them:
    each dilation phase as many as the longest."""
    def cut(n):
        return dilation * -(-(-(-n // dilation)) // m)
    return N * cut(H) * cut(W)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N, H, W, C, OC, dilation", [
    (1, 7, 7, 512, 512, 1),    # ResNet stage 4 at batch 1: 16 tiles of 2x2, 4 of 4x4
    (1, 5, 9, 515, 13, 1),     # 15 / 6 tiles; C past a vector, OC a partial short tile
    (1, 14, 14, 512, 20, 1),   # 49 tiles of 2x2: the 49th rides as the extra row
    (2, 7, 7, 520, 30, 1),     # 32 / 8 tiles over two images
    (1, 9, 8, 512, 8, 2),      # per dilation phase: 24 / 8 tiles
    (1, 14, 14, 256, 40, 1),   # 256 channels: 4x4's 16 tiles short-M, 2x2's 49 not
    (1, 7, 7, 300, 24, 1),     # 300: 2x2's 16 tiles short-M (C a vector and a tail)
    (1, 9, 9, 255, 16, 1),     # one channel short of it: fused either way
])
def test_short_m_winograd_matches_reference(request, isa, dtype, N, H, W, C, OC, dilation,
                                            tile):
    """Per-call filters by the short-M kernels (winograd_short_nogil: each
    task transforms short MR output channels' filters along C, straight
    from the OHWI weight, and multiplies every point's packed V^T by them):
    error against float64 torch within 10x the direct method's, with bias,
    relu6 and a residual; the same on 1 and 2 threads (each sum is one
    kernel call over all of C), through a reversed-rows view of x and as
    NCHW / OIHW; close to the fused path's result (the short path off).
    Asserts where the path runs, so a build that stops taking it fails
    here."""
    rng = np.random.default_rng(C * OC + H * W)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    r = rng.standard_normal((N, H, W, OC)).astype(dtype)
    tiles = winograd_tiles(N, H, W, tile, dilation)
    previous_threads = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous_threads))
    with fastconv._dispatch.use_isa(isa) as kernels:
        assert kernels.winograd_short_applies(tiles, C, np.dtype(dtype).name) == (
            short_m_winograd_runs(isa, dtype, tiles, C)), tiles
        check_against_direct(x, w, b, padding=dilation, activation="relu6",
                             dilation=(dilation, dilation))
        results = {}
        for short, nt in ((49, 2), (49, 1), (0, 2)):
            previous = kernels.set_winograd_short_tiles(short)
            fastconv.set_num_threads(nt)
            try:
                results[short, nt] = conv2d(x, w, b, padding=dilation, dilation=dilation,
                                            activation="relu6", residual=r,
                                            algorithm="winograd")
            finally:
                kernels.set_winograd_short_tiles(previous)
        # The same values through a reversed-rows view, and as NCHW / OIHW.
        reversed_rows = np.ascontiguousarray(x[:, ::-1])[:, ::-1]
        viewed = conv2d(reversed_rows, w, b, padding=dilation, dilation=dilation,
                        activation="relu6", residual=r, algorithm="winograd")
        nchw = conv2d(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), w.transpose(0, 3, 1, 2), b,
                      padding=dilation, dilation=dilation, activation="relu6",
                      residual=np.ascontiguousarray(r.transpose(0, 3, 1, 2)), layout="NCHW",
                      algorithm="winograd")
    np.testing.assert_array_equal(viewed, results[49, 2])
    np.testing.assert_array_equal(nchw.transpose(0, 2, 3, 1), results[49, 2])
    ref = reference(x, w, b, ((dilation,) * 2,) * 2, dilation=(dilation, dilation)) + r
    scale = np.abs(ref).max()       # of the sums, before relu6 clips them
    ref = np.clip(ref, 0, 6)
    np.testing.assert_array_equal(results[49, 2], results[49, 1])
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(results[49, 2], ref, rtol=0, atol=rtol * scale)
    np.testing.assert_allclose(results[49, 2], results[0, 2], rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N, H, W, C, OC", [
    (1, 7, 7, 64, 128),      # 4 tiles (a 7x7 image at batch 1), one k-block
    (1, 5, 5, 300, 32),      # k-blocks of 100: a partial transpose block each
    (1, 4, 4, 130, 64),      # 1 tile: V's rows past it are zeros
    (2, 3, 4, 48, 96),       # 2 tiles, one per image
    (1, 8, 8, 16, 48),       # 4 whole tiles, input gradient of 16 channels
    (1, 7, 7, 40, 40),       # float32: not whole vectors, the fused path
    (2, 7, 7, 32, 64),       # 8 tiles: two groups of 4
    (1, 7, 11, 48, 16),      # 6 tiles: the second group half zeros
    (1, 9, 9, 32, 32),       # 9 tiles: the fused path
])
def test_few_tile_filters_match_fused(request, isa, dtype, N, H, W, C, OC):
    """Per-call filters for at most 8 tiles on AVX-512 (winograd_few_nogil:
    the transformed filters never stored, each row of points made per group
    of 4 tiles next to its products) against the fused path (the same sums in the same
    order, but with G's rows scaled, FC_WINO_G_SCALED, so a rounding apart per term): its
    error against float64 torch within 2x the fused path's (measured 0.7-1.5x: a maximum
    over few values), forward with bias and relu6 and the input gradient (the flipped
    weight: C and OC swap), on 1 and 2 threads."""
    rng = np.random.default_rng(C * OC + H)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    dy = rng.standard_normal((N, H, W, OC)).astype(dtype)
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (1, 1), (1, 1), (H, W))
    flipped = fastconv.conv._flipped_geometry(geo, (H, W))
    previous_threads = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous_threads))
    with fastconv._dispatch.use_isa(isa) as kernels:
        previous_fused = kernels.set_winograd_fused(*ALWAYS_FUSED)
        previous_few = kernels.set_winograd_few_tiles(8)
        try:
            check_against_direct(x, w, b, activation="relu6")
            results = {}
            for few, nt in ((8, 2), (8, 1), (0, 2)):
                kernels.set_winograd_few_tiles(few)
                fastconv.set_num_threads(nt)
                results[few, nt] = (
                    conv2d(x, w, b, padding=1, activation="relu6", algorithm="winograd"),
                    fastconv.conv._winograd_data_grad(dy, w.reshape(OC, -1), 1, flipped,
                                                      x.shape))
        finally:
            kernels.set_winograd_fused(*previous_fused)
            kernels.set_winograd_few_tiles(previous_few)
    refs = (reference(x, w, b, ((1, 1), (1, 1)), activation="relu6"),
            F.conv_transpose2d(torch.from_numpy(dy.astype(np.float64).transpose(0, 3, 1, 2)),
                               torch.from_numpy(w.astype(np.float64).transpose(0, 3, 1, 2)),
                               padding=1).numpy().transpose(0, 2, 3, 1))
    floor = 1e-7 if dtype == np.float32 else 1e-15
    for got, one_thread, fused, ref in zip(results[8, 2], results[8, 1], results[0, 2], refs):
        np.testing.assert_array_equal(got, one_thread)
        scale = np.abs(ref).max()
        err, fused_err = max_error(got, ref), max_error(fused, ref)
        assert err <= 2 * max(fused_err, floor * scale), (
            f"few-tile error {err:.3g} vs the fused path's {fused_err:.3g} (scale {scale:.3g})")


@pytest.mark.skipif("avx512" not in fastconv._dispatch.AVAILABLE,
                    reason="the few-tile kernels are AVX-512's; this CPU has no AVX-512")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N, H, W, C, OC, padding, dilation", [
    (1, 7, 7, 64, 128, 1, 1),             # 4 tiles (7x7 at batch 1), one k-block
    (1, 5, 5, 300, 32, 1, 1),             # k-blocks 128, 128, 44: a partial transpose block
    (1, 4, 4, 130, 64, 1, 1),             # 1 tile: V's rows past it are zeros
    (1, 7, 11, 48, 16, ((2, 0), (1, 2)), 1),  # asymmetric padding, 6 tiles
    (1, 7, 7, 24, 32, 2, 2),              # dilation: 4 phases of one tile
    (2, 9, 9, 32, 48, 1, 1),              # 18 tiles (past auto's 4): a partial group
])
def test_packed_few_tile_filters(request, monkeypatch, dtype, N, H, W, C, OC, padding,
                                 dilation):
    """PackedConv2d's few-tile variant (AVX-512): the column halves D^-1 G g
    packed once (pack_winograd_few_weights) and read by winograd_few_nogil
    in place of each call's transform of w.  The same values summed in the
    same order, so bit for bit the per-call few-tile path (forced for every
    tile count here; its k-blocks are the packed path's: one k-block, or
    channels not in whole cache lines, see
    test_few_tile_per_call_at_every_weight_alignment), with a bias, a
    residual and relu6, on 1 and 2 threads; and within float32/float64
    rounding of torch in float64."""
    rng = np.random.default_rng(C * OC + H)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C)).astype(dtype)
    b = rng.standard_normal(OC).astype(dtype)
    kw = dict(padding=padding, dilation=dilation)
    residual = rng.standard_normal(conv2d(x, w, **kw).shape).astype(dtype)
    monkeypatch.setattr(fastconv.conv, "_winograd_variant",
                        lambda N, geo, Cg, OCg, dtype, prepacked=False: "few" if prepacked else 4)
    previous_threads = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous_threads))
    with fastconv._dispatch.use_isa("avx512") as kernels:
        previous_fused = kernels.set_winograd_fused(*ALWAYS_FUSED)
        previous_few = kernels.set_winograd_few_tiles(1 << 20)
        request.addfinalizer(lambda: kernels.set_winograd_fused(*previous_fused))
        request.addfinalizer(lambda: kernels.set_winograd_few_tiles(previous_few))
        layer = fastconv.PackedConv2d(w, b, activation="relu6", algorithm="winograd", **kw)
        results = []
        for nt in (2, 1):
            fastconv.set_num_threads(nt)
            per_call = conv2d(x, w, b, activation="relu6", residual=residual,
                              algorithm="winograd", **kw)
            results.append(layer(x, residual=residual))
            np.testing.assert_array_equal(results[-1], per_call)
        np.testing.assert_array_equal(results[0], results[1])
        assert [key[2] for key in layer._packs] == ["few"]
    pads = explicit_pads(padding, (H, W), (3, 3), (1, 1), (dilation, dilation))
    before_act = reference(x, w, b, pads, dilation=(dilation, dilation)) + residual
    rel = 1e-5 if dtype == np.float32 else 1e-13
    assert (max_error(results[0], np.clip(before_act, 0, 6))
            <= rel * np.abs(before_act).max())


@pytest.mark.skipif("avx512" not in fastconv._dispatch.AVAILABLE,
                    reason="the few-tile kernels are AVX-512's; this CPU has no AVX-512")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C", [272, 512, 136])
def test_few_tile_per_call_at_every_weight_alignment(request, monkeypatch, dtype, C):
    """The per-call few-tile path starts its k-blocks after the first on the
    weight rows' cache lines, and reads each block's taps in line-sized
    blocks that overlap at the ends: weights at every offset from a line
    (numpy's arrays start 16 bytes apart), C = 272 (k-blocks down to 16
    channels), 512 and 136 (not whole lines in float32: no shifted
    k-blocks) all agree with float64 torch."""
    rng = np.random.default_rng(C)
    x = rng.standard_normal((1, 7, 7, C)).astype(dtype)
    w0 = rng.standard_normal((32, 3, 3, C)).astype(dtype)
    monkeypatch.setattr(fastconv.conv, "_winograd_variant",
                        lambda N, geo, Cg, OCg, dtype, prepacked=False: 4)
    ref = reference(x, w0, None, ((1, 1), (1, 1)))
    rel = 1e-5 if dtype == np.float32 else 1e-13
    with fastconv._dispatch.use_isa("avx512") as kernels:
        previous_fused = kernels.set_winograd_fused(*ALWAYS_FUSED)
        previous_few = kernels.set_winograd_few_tiles(1 << 20)
        request.addfinalizer(lambda: kernels.set_winograd_fused(*previous_fused))
        request.addfinalizer(lambda: kernels.set_winograd_few_tiles(previous_few))
        for offset in (0, 16, 32, 48):
            w = at_line_offset(w0, offset)
            got = conv2d(x, w, padding=1, algorithm="winograd")
            assert max_error(got, ref) <= rel * np.abs(ref).max(), offset


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
def test_packed_few_tile_filters_refused_where_they_do_not_fit(isa):
    """pack_winograd_few_weights needs the AVX-512 kernels and output
    channels in whole vectors, and its filters serve F(4x4) Winograd only;
    PackedConv2d with few tiles then packs F(2x2) filters."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 7, 7, 256)).astype(np.float32)
    w = rng.standard_normal((136, 3, 3, 256)).astype(np.float32)   # 8.5 vectors
    w2d = np.ascontiguousarray(w.reshape(136, -1))
    y = np.empty((49, 136), np.float32)
    with fastconv._dispatch.use_isa(isa) as kernels:
        with pytest.raises(ValueError, match="whole vectors of 16; this is avx512 with 136"
                           if isa == "avx512" else "need an AVX-512 build"):
            kernels.pack_winograd_few_weights(w2d, 1)
        layer = fastconv.PackedConv2d(w, padding=1)
        ref = reference(x, w, None, ((1, 1), (1, 1)))
        assert max_error(layer(x), ref) <= 1e-5 * np.abs(ref).max()
        assert [key[1:3] for key in layer._packs] == [("winograd", 2)]
        if isa != "avx512":
            return
        w2d = w2d[:32]
        few = kernels.pack_winograd_few_weights(w2d, 1)
        with pytest.raises(ValueError, match="tile must be 4"):
            kernels.conv2d_winograd(x, w2d, None, y[:, :32], (1, 1), (7, 7), 1, 0, few, tile=2)
        with pytest.raises(ValueError, match="packed weights are winograd-few"):
            kernels.conv2d_forward(x, w2d, None, y[:, :32], (3, 3), (1, 1), (1, 1), (1, 1),
                                   (7, 7), 1, 0, few)
        with pytest.raises(ValueError, match="packed weights are winograd-few"):
            kernels.conv2d_winograd(x, w2d, None, y[:, :32], (1, 1), (7, 7), 1, 0,
                                    kernels.pack_winograd_few_weights(w2d[:16], 1))


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
def test_packed_winograd_filters(isa, tile):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 7, 7, 32)).astype(np.float32)
    w = rng.standard_normal((24, 3, 3, 32)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    with fastconv._dispatch.use_isa(isa) as kernels:
        layer = fastconv.PackedConv2d(w, b, padding=1, activation="relu")
        expected = conv2d(x, w, b, padding=1, activation="relu", algorithm="winograd")
        for _ in range(2):
            np.testing.assert_array_equal(layer(x), expected)
        assert any(key[1:3] == ("winograd", tile) for key in layer._packs)
        # Filters packed for one algorithm are refused by the other.
        w2d = np.ascontiguousarray(w.reshape(24, -1))
        y = np.empty((49, 24), np.float32)
        implicit = kernels.pack_conv_weights(w2d, (3, 3), 1)
        with pytest.raises(ValueError, match="packed weights are implicit"):
            kernels.conv2d_winograd(x, w2d, None, y, (1, 1), (7, 7), 1, 0, implicit)
        winograd = kernels.pack_winograd_weights(w2d, 1, tile)
        with pytest.raises(ValueError, match="packed weights are winograd"):
            kernels.conv2d_forward(x, w2d, None, y, (3, 3), (1, 1), (1, 1), (1, 1), (7, 7), 1,
                                   0, winograd)
        # ...and filters of one Winograd variant by the other.
        with pytest.raises(ValueError, match="packed weights are winograd"):
            kernels.conv2d_winograd(x, w2d, None, y, (1, 1), (7, 7), 1, 0, winograd,
                                    tile=6 - tile)
        with pytest.raises(ValueError, match="tile must be 4"):
            kernels.pack_winograd_weights(w2d, 1, 3)


@pytest.mark.parametrize("N, H, C, OC, stride, prepacked, expected", [
    (1, 56, 64, 64, 1, False, "winograd"),      # ResNet stage 1
    (8, 14, 256, 256, 1, False, "winograd"),
    (1, 7, 512, 512, 1, False, "winograd"),     # 4 tiles, filters fused per call
    (1, 7, 512, 512, 1, True, "winograd"),
    (1, 7, 96, 128, 1, False, "implicit"),      # 4 tiles: too few for 96x128 channels
    (1, 7, 96, 128, 1, True, "winograd"),       # ...unless transformed once
    (1, 224, 3, 64, 1, False, "thin"),          # 3 channels: GEMMs too shallow,
    (1, 56, 8, 8, 1, True, "thin"),             # even prepacked: the thin path
    (1, 14, 512, 512, 1, False, "winograd"),    # 16 tiles, fused
    (1, 28, 512, 512, 1, False, "winograd"),    # 64 tiles, the most fused
    (2, 28, 512, 512, 1, False, "winograd"),    # 128: packed up front, enough tiles
    (1, 14, 64, 64, 1, False, "winograd"),      # 16 tiles: enough for 64x64 (1 thread
                                                # 138 vs implicit 97 GFLOPS, session 13)
    (1, 7, 64, 64, 1, False, "implicit"),       # 4 tiles, 64x64: not fused
    (1, 56, 64, 64, 2, False, "implicit"),      # strided: never im2col, even
    (8, 56, 64, 64, 2, False, "implicit"),      # with 1.8 MiB of patches at b1
    # fewer than 16 output channels: Winograd from 32 input channels and
    # 112x112 output pixels (_THIN_OUTPUT_MIN_PIXELS)
    (1, 224, 64, 3, 1, False, "winograd"),
    (1, 112, 32, 15, 1, False, "winograd"),
    (8, 56, 256, 1, 1, False, "winograd"),
    (1, 56, 64, 3, 1, False, "implicit"),
    (1, 224, 16, 3, 1, False, "implicit"),
])
def test_auto_picks_by_shape(N, H, C, OC, stride, prepacked, expected):
    geo = fastconv.conv._Geometry((3, 3), (stride, stride), (1, 1), (1, 1),
                                  (-(-H // stride),) * 2)
    got = fastconv.conv._choose_algorithm("auto", 1, C, OC, N, geo, (H, H), prepacked)
    if expected == "thin":      # auto takes it on AVX-512 builds only
        expected = "winograd" if fastconv._dispatch.kernels.ISA == "avx512" else "implicit"
    assert got == expected


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("N, H, C, OC, dilation, few", [
    (1, 7, 128, 128, 1, True),      # 4 tiles, 49 of their 64 outputs in the image
    (1, 7, 256, 128, 1, True),
    (2, 7, 128, 256, 1, True),      # 8 tiles
    (1, 6, 128, 128, 1, True),      # 36 of 64
    (1, 7, 128, 128, 2, True),      # 4 dilation phases of one tile
    (1, 5, 128, 128, 1, False),     # 25 of 64: implicit
    (2, 5, 128, 128, 1, False),
    (1, 7, 64, 128, 1, False),      # too few channels
    (1, 7, 128, 136, 1, None),      # 136 output channels: whole vectors in float64 only
    (3, 7, 128, 128, 1, False),     # 12 tiles: past the few-tile path (and the 256x256
                                    # channels the fused path needs)
])
def test_auto_takes_few_tile_winograd_per_call(isa, dtype, N, H, C, OC, dilation, few):
    """Per call, auto takes Winograd for layers of at most 8 tiles from
    128x128 channels where the kernels' few-tile path runs them (AVX-512,
    output channels in whole vectors) and at least half of the tiles'
    outputs are in the image; elsewhere implicit GEMM, as before that path
    made its filters' rows from the raw taps."""
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (dilation, dilation), (dilation, dilation),
                                  (H, H))
    if few is None:
        few = dtype == "float64"
    expected = "winograd" if few and isa == "avx512" else "implicit"
    with fastconv._dispatch.use_isa(isa):
        got = fastconv.conv._choose_algorithm("auto", 1, C, OC, N, geo, (H, H), False, dtype)
    assert got == expected


@pytest.mark.parametrize("isa", fastconv._dispatch.AVAILABLE)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("C, OC", [(128, 256), (256, 128), (512, 520), (64, 256), (64, 128)])
@pytest.mark.parametrize("N, H, dilation, expected", [
    (1, 7, 1, "few"),      # ResNet stage 4 at batch 1: 4 tiles of 4x4, 16 of 2x2
    (1, 8, 1, "few"),
    (1, 6, 1, 2),          # 4 tiles of 4x4 but only 9 of 2x2
    (1, 4, 1, 2),          # 1 tile of 4x4 (computed as 4), 4 of 2x2
    (2, 7, 1, 4),          # 8 tiles
    (1, 14, 1, 4),         # 16 tiles
    (1, 7, 2, "few"),      # per dilation phase: 4 phases of one tile, 16 of 2x2
    (1, 14, 2, 4),         # 4 phases of 4 tiles
])
def test_winograd_variant_by_tile_count(isa, dtype, C, OC, N, H, dilation, expected):
    """For prepacked filters and few tiles, the few-tile path's packed
    column halves where its kernels run (AVX-512, output channels in whole
    vectors: not 520 in float32) and pay (128x128 channels and more: not
    64x128; enough F(2x2) tiles), else F(2x2); filters transformed per call
    stay in the cache (the fused and few-tile paths), where F(4x4) is
    faster, except where F(2x2)'s tiles take the short-M path (AVX2 float32,
    512 input channels: F(4x4)'s few tiles would leave its vectors half
    empty)."""
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (dilation, dilation), (dilation, dilation),
                                  (H, H))
    vector = 64 // np.dtype(dtype).itemsize
    with fastconv._dispatch.use_isa(isa):
        got = fastconv.conv._winograd_variant(N, geo, C, OC, dtype, prepacked=True)
        per_call = fastconv.conv._winograd_variant(N, geo, C, OC, dtype)
    if not short_m_winograd_runs(isa, dtype, winograd_tiles(N, H, H, 2, dilation), C):
        assert per_call == 4        # else test_per_call_winograd_variant_by_short_m
    if expected == "few" and not (isa == "avx512" and OC % vector == 0 and C * OC >= 16384):
        expected = 2
    assert got == expected


@pytest.mark.skipif("avx2" not in fastconv._dispatch.AVAILABLE, reason="needs the AVX2 build")
@pytest.mark.parametrize("N, H, dilation, expected, expected_256", [
    (1, 7, 1, 2, 2),      # 4 tiles of 4x4 (not short-M), 16 of 2x2
    (1, 6, 1, 2, 2),      # 4 / 9
    (1, 7, 2, 2, 2),      # per dilation phase: 4 / 16
    (2, 7, 1, 4, 4),      # 8 / 32, both short-M: 36 x 15 < 16 x 39; 256: 4x4's only
    (1, 14, 1, 4, 4),     # 16 / 49: 36 x 23 < 16 x 56; 256: 4x4's only
    (1, 10, 1, 2, 4),     # 9 / 25: 16 x 32 < 36 x 16; 256: 4x4's only
    (1, 4, 1, 4, 4),      # 1 / 4: neither
    (8, 7, 1, 4, 4),      # 32 / 128: F(2x2) past 49 tiles
])
def test_per_call_winograd_variant_by_short_m(N, H, dilation, expected, expected_256):
    """Per call on AVX2 (float32, 512 input channels), F(2x2) where its tiles
    take the short-M path and F(4x4)'s do not, or cost more as points x
    (tiles + 7); with 256 input channels (short-M up to 16 tiles) F(2x2)
    where its tiles are at most 16; float64 (no AVX2 short-M kernels) and
    fewer than 256 input channels stay on F(4x4)."""
    geo = fastconv.conv._Geometry((3, 3), (1, 1), (dilation, dilation), (dilation, dilation),
                                  (H, H))
    with fastconv._dispatch.use_isa("avx2"):
        assert fastconv.conv._winograd_variant(N, geo, 512, 512, "float32") == expected
        assert fastconv.conv._winograd_variant(N, geo, 512, 512, "float64") == 4
        assert fastconv.conv._winograd_variant(N, geo, 256, 512, "float32") == expected_256
        assert fastconv.conv._winograd_variant(N, geo, 255, 512, "float32") == 4


@pytest.mark.parametrize("kernel, kwargs, message", [
    (3, dict(stride=2), "stride 1"),
    (3, dict(stride=(1, 2), dilation=2), "stride 1"),
    (5, {}, "3x3"),
])
def test_forced_winograd_refuses_other_shapes(kernel, kwargs, message):
    x = np.ones((1, 9, 9, 4), np.float32)
    w = np.ones((4, kernel, kernel, 4), np.float32)
    with pytest.raises(ValueError, match=message):
        conv2d(x, w, algorithm="winograd", **kwargs)


@pytest.mark.parametrize("shape, padding, groups, dilation", [
    ((2, 14, 14, 32, 16), 1, 1, 1),
    ((1, 19, 23, 16, 24), ((2, 0), (1, 2)), 1, 1),
    ((2, 16, 16, 32, 32), 1, 2, 1),
    ((1, 30, 30, 16, 16), 3, 1, 1),            # flipped padding below zero
    ((1, 28, 28, 16, 16), 0, 1, 1),
    ((1, 28, 28, 32, 32), 2, 1, 2),            # dilated: the flipped conv is too
    ((2, 23, 19, 16, 24), ((1, 3), (4, 0)), 1, (3, 2)),
], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_data_gradient_by_winograd(shape, padding, groups, dilation, dtype, monkeypatch):
    """For 3x3 stride-1 layers the input gradient is the convolution of
    grad_output with the flipped kernel, which auto runs by Winograd when
    it pays: against float64 torch, within 10x the direct path's error."""
    N, H, W, C, OC = shape
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    rng = np.random.default_rng(H + C)
    x = rng.standard_normal((N, H, W, C)).astype(dtype)
    w = rng.standard_normal((OC, 3, 3, C // groups)).astype(dtype)
    pads = explicit_pads(padding, (H, W), (3, 3), (1, 1), (dh, dw))
    (top, bottom), (left, right) = pads
    OH, OW = H + top + bottom - 2 * dh, W + left + right - 2 * dw
    dy = rng.standard_normal((N, OH, OW, OC)).astype(dtype)
    ref = data_gradient_reference(x, w, dy, pads, groups, (dh, dw))
    flipped = fastconv.conv._flipped_geometry(
        fastconv.conv._Geometry((3, 3), (1, 1), (dh, dw), (top, left), (OH, OW)), (H, W))
    assert fastconv.conv._winograd_pays(N, flipped, OC // groups, C // groups, False)
    gx = fastconv.conv2d_backward(dy, x, w, padding=padding, groups=groups, dilation=dilation,
                                  output_mask=(True, False, False))[0]
    scale = np.abs(ref).max()
    if dtype == np.float64:
        assert max_error(gx, ref) <= 1e-12 * scale
        return
    monkeypatch.setattr(fastconv.conv, "_winograd_pays", lambda *args: False)
    direct = fastconv.conv2d_backward(dy, x, w, padding=padding, groups=groups,
                                      dilation=dilation, output_mask=(True, False, False))[0]
    assert max_error(gx, ref) <= ERROR_RATIO * max(max_error(direct, ref), 1e-7 * scale)
    assert max_error(gx, ref) > 0 and not np.array_equal(gx, direct)   # two paths ran
