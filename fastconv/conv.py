"""2-D convolutions on NHWC images: the facade over the fused kernels of
fastconv/_kernels/conv_frame.pxi.

Three products make up every call (Cg = C / groups, K = KH*KW*Cg):

* forward      y[pixels, OC]   = patches(x)[pixels, K] @ w2d.T (+ bias)
* data grad    dx = col2im(dy[pixels, OC] @ w2d); or as convolutions of dy
               that write dx once: with the flipped kernel (stride 1:
               Winograd, depthwise, narrow groups), or one per phase of dx
               with the taps that reach it (strided, _phase_data_grad)
* weight grad  dw2d[OC, K]     = dy.T @ patches(x)

where w2d is the (OC, KH, KW, Cg) weight viewed as (OC, K).  The kernels
never build the whole patch matrix: they build and multiply it a chunk of
rows at a time in per-thread buffers.  A transposed convolution is the data
gradient of a convolution whose weight has the (C_in, KH, KW, C_out/groups)
layout of its own weight, so it reuses the same three products with the
roles swapped.

Grouped convolutions run one kernel call per group on strided views
(channel slices of x, row blocks of w2d, column blocks of the output), or,
with at least as many groups as threads, one call that runs whole groups
on separate threads.  Narrow groups (2-16 channels in and out) and
depthwise layers skip the GEMMs: direct kernels vectorised over channels
run every group at once.

NCHW results are NCHW-shaped views of NHWC memory (PyTorch's channels_last):
feeding one into the next NCHW call needs no copy.
"""
import math
from typing import NamedTuple

import numpy as np

from . import _args, _dispatch, _tune
from ._threads import get_num_threads
from .gemm import empty_aligned

__all__ = ["im2col", "col2im", "conv2d", "conv2d_backward",
           "conv_transpose2d", "conv_transpose2d_backward", "PackedConv2d"]

class _Geometry(NamedTuple):
    """What the im2col kernels need, in their argument order."""
    kernel: tuple
    stride: tuple
    dilation: tuple
    pad_before: tuple  # (top, left); bottom/right are implied by out_hw
    out_hw: tuple


# --------------------------------------------------------------- layouts

def _to_nhwc(a, layout):
    # NCHW -> NHWC, and likewise OIHW -> OHWI for weights.
    return a if layout == "NHWC" else a.transpose(0, 2, 3, 1)


def _from_nhwc(a, layout):
    return a if layout == "NHWC" else a.transpose(0, 3, 1, 2)


def _shape_from_nhwc(shape, layout):
    return tuple(shape) if layout == "NHWC" else (shape[0], shape[3], shape[1], shape[2])


def _channels_last(a):
    """a with contiguous channels, the one thing the im2col kernels require."""
    return a if a.strides[3] == a.itemsize else np.ascontiguousarray(a)


def _unit_columns(m):
    """2-D m with contiguous rows, which the conv kernels require; the GEMM
    kernel reads any strides, but these products stream whole rows."""
    return m if m.shape[1] <= 1 or m.strides[1] == m.itemsize else np.ascontiguousarray(m)


def _pixel_matrix(a):
    """NHWC a as its (pixels, channels) matrix: a view when the pixel strides
    allow one, else a copy."""
    n, h, w, c = a.shape
    return a.reshape(n * h * w, c)


def _weight_matrix(w):
    """(O, KH, KW, I) weight as (O, KH*KW*I) with contiguous rows, copied
    only if it must be."""
    return _unit_columns(w.reshape(w.shape[0], w.shape[1] * w.shape[2] * w.shape[3]))


# ------------------------------------------------------- non-zero padding

_NUMPY_PAD_MODE = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _source_index(size, before, after, mode):
    """For each row of a padded axis, the input row it is a copy of."""
    return np.pad(np.arange(size), (before, after), mode=_NUMPY_PAD_MODE[mode])


def _pad(x, pads, mode):
    """NHWC x padded by reflect/replicate/circular (PyTorch semantics).  Zero
    padding is left to the kernels, which never materialise it."""
    if mode == "zeros" or pads == ((0, 0), (0, 0)):
        return x
    rows = _source_index(x.shape[1], *pads[0], mode)
    cols = _source_index(x.shape[2], *pads[1], mode)
    # Indexing the batch axis too makes numpy lay the result out in C order.
    images = np.arange(x.shape[0])
    return x[images[:, None, None], rows[None, :, None], cols[None, None, :]]


def _unpad(grad, pads, mode, in_hw):
    """Adjoint of _pad: each padded pixel's gradient is added back onto the
    input pixel it copied."""
    if mode == "zeros" or pads == ((0, 0), (0, 0)):
        return grad
    (top, bottom), (left, right) = pads
    H, W = in_hw
    rows = _source_index(H, top, bottom, mode)
    folded = grad[:, top:top + H].copy()
    for p in [*range(top), *range(top + H, len(rows))]:
        folded[:, rows[p]] += grad[:, p]
    grad = folded
    cols = _source_index(W, left, right, mode)
    folded = grad[:, :, left:left + W].copy()
    for p in [*range(left), *range(left + W, len(cols))]:
        folded[:, :, cols[p]] += grad[:, :, p]
    return folded


# ------------------------------------------------------------ the products

def _is_pointwise(geo, in_hw):
    # 1x1, stride 1, no padding: the patch matrix is the image itself.
    return (geo.kernel == (1, 1) and geo.stride == (1, 1) and geo.pad_before == (0, 0)
            and geo.out_hw == tuple(in_hw))


def _is_depthwise(groups, C):
    # One input channel per group: the GEMM would be K = KH*KW deep and
    # `multiplier` wide, so a direct kernel vectorised over channels runs it.
    return groups == C and C > 1


def _is_narrow_grouped(groups, C, OC, kernel):
    """Groups of 2, 4, 8 or 16 input and as many output channels (ResNeXt's
    32 groups of 4 or 8): as GEMMs they would be products only that wide, so
    one direct kernel runs every group, output channels the vector axis and
    each lane's group inputs shuffled to it (grouped_kernel.h).  Measured on
    Zen 4, 2 threads, 3x3 at 28x28 / 14x14, against the implicit GEMM path:
    5-9x at width 4 (1.2-1.9x torch channels_last), 2.4-3x at width 8
    (0.5-0.9x torch), 1.2-1.5x at 16 (0.4-0.55x torch)."""
    return (groups > 1 and C == OC and C // groups >= 2
            and _dispatch.kernels.grouped_direct_supports(C // groups, kernel[0]))


def _grouped_tap_weights(w2d, groups, kernel, flip=False):
    """(OC, KH*KW*KG) weights of KG-wide groups as the narrow-group kernels
    take them, (KH, KW, KG, C): [kh, kw, i, g*KG + j] is output channel
    g*KG + j's weight for input g*KG + i.  flip: the weights of the input
    gradient at stride 1 (kernel rotated 180 degrees, inputs and outputs of
    each group swapped)."""
    KH, KW = kernel
    OC = w2d.shape[0]
    KG = OC // groups
    w = w2d.reshape(groups, KG, KH, KW, KG)        # [g, j (out), kh, kw, i (in)]
    if flip:
        w = w[:, :, ::-1, ::-1, :].transpose(2, 3, 1, 0, 4)
    else:
        w = w.transpose(2, 3, 4, 0, 1)
    return np.ascontiguousarray(w).reshape(KH, KW, KG, OC)


def _tap_weights(w2d, kernel):
    """(OC, KH*KW) depthwise weights as (KH, KW, OC): a tap's weights over
    the channels, contiguous."""
    return np.ascontiguousarray(w2d.T).reshape(*kernel, w2d.shape[0])


def _direct_tap_weights(w2d, groups, C, kernel):
    """The (OC, KH*KW*C/groups) weights as the direct forward kernel of
    that grouping takes them."""
    if _is_depthwise(groups, C):
        return _tap_weights(w2d, kernel)
    return _grouped_tap_weights(w2d, groups, kernel)


def _groups_in_parallel(groups, nt):
    """Whether the kernels should run whole groups on separate threads (one
    parallel region for the layer) rather than the groups one after another,
    each split across all threads: when there are at least as many groups
    as threads (many small groups: each alone is too little work to split;
    the narrowest, up to 16 channels in and out, take the direct kernel)."""
    return groups > 1 and groups >= nt


def _group_slices(groups, C, OC):
    Cg, OCg = C // groups, OC // groups
    return [(slice(g * Cg, (g + 1) * Cg), slice(g * OCg, (g + 1) * OCg)) for g in range(groups)]


#: conv2d's algorithm choices; see _choose_algorithm.
ALGORITHMS = ("auto", "tune", "implicit", "im2col", "gemm1x1", "direct", "winograd")
#: conv2d's fused activations, as the kernels' epilogue codes.
_ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


def _is_winograd(geo):
    # Winograd F(4x4, 3x3) or F(2x2, 3x3): 3x3 kernels at stride 1 (any
    # padding, any output size: partial tiles are cut at the edges; a
    # dilated layer's tiles are cut per dilation phase, their pixels d
    # apart).
    return geo.kernel == (3, 3) and geo.stride == (1, 1)


def _is_thin_winograd(geo, Cg):
    # The kernels' thin path (winograd_thin_kernel.h): F(2x2, 3x3) with the
    # products and output transform of a few tiles in registers, for layers
    # with fewer input channels than the general path's GEMMs need (16),
    # undilated; filters transformed per call (16 x C x OC values, nothing
    # to prepack).
    return (_is_winograd(geo) and geo.dilation == (1, 1)
            and 1 <= Cg <= _dispatch.kernels.winograd_thin_max_channels())


def _thin_winograd_pays(groups, N, geo, Cg):
    """Whether auto takes the thin Winograd path over implicit GEMM: on
    AVX-512 builds (three tiles a kernel call, in 25 of 32 registers), for
    images of at least 100 output pixels.  Zen 4, 2 threads, best ms
    implicit -> thin, batch 1 unless given: VGG conv1_1 (3->64 @224) 0.86 ->
    0.54, at batch 8 7.67 -> 4.25; 3->64 @112 0.23 -> 0.15 (with relu 0.24
    -> 0.16), 8->64 @112 0.54 -> 0.32, 15->64 @56 0.26 -> 0.16, 3->16 @112
    0.15 -> 0.06, 4->256 @112 1.10 -> 0.59, 1->16 @56 batch 4 0.18 ->
    0.06; output channels in part vectors cost more (3->24 @112 0.16 ->
    0.10, 1->24 @112 0.10 -> 0.10).  Small images, implicit / thin time
    (the filters transformed a vector of output channels at a time): 7x7
    1.00-1.13, 10x10 0.93-1.49, 14x14 0.87-1.25, 28x28 0.93-1.60, over
    3->64, 8->256, 15->256, 15->24, 1->24, 4->512 (calls of 13-270 us, one
    run each in one process).  On AVX2 (one tile a call: 16 registers) it
    lost (3->64 @112 0.26 vs 0.43) and won with more channels (15->8 @28
    0.050 -> 0.037): forced only.  float64 (AVX-512) won alike: 3->64 @224
    1.80 -> 1.52, @28 0.073 -> 0.044."""
    return (groups == 1 and _dispatch.kernels.ISA == "avx512" and _is_thin_winograd(geo, Cg)
            and N * geo.out_hw[0] * geo.out_hw[1] >= 100)


def _winograd_tiles(N, geo, m=4):
    # m x m output tiles, as the kernel cuts them: per dilation phase (the
    # outputs a + d*i of each residue a form an undilated convolution).
    (DH, DW), (OH, OW) = geo.dilation, geo.out_hw
    return N * DH * -(-(-(-OH // DH)) // m) * DW * -(-(-(-OW // DW)) // m)


def _winograd_variant(N, geo, Cg, OCg, dtype, prepacked=False):
    """"thin" for layers of fewer than 16 input channels, undilated
    (_is_thin_winograd: F(2x2, 3x3), filters transformed per call, prepacked
    or not); else 4 for F(4x4, 3x3); for prepacked filters and layers of at
    most four of its 4x4 tiles (a 7x7 or 8x8 image at batch 1), where
    streaming the 36 x C x OC transformed filters is most of the work:

    - "few": F(4x4) by the kernels' few-tile path from packed column halves
      (pack_winograd_few_weights: 18 x C x OC values, each filter's
      transform half done), on AVX-512 with output channels in whole
      vectors, for 128x128 channels and more and images that F(2x2) cuts
      into at least 12 tiles.  Zen 4, 2 threads, one process alternating,
      best / median ms, few vs F(2x2), batch 1: 512->512 @7 0.53 / 0.70 vs
      0.65 / 0.80, @8 0.49 / 0.53 vs 0.64 / 0.66, 256->512 @8 0.253 / 0.256
      vs 0.335 / 0.339, 256->256 @7 0.149 / 0.158 vs 0.182 / 0.195,
      128->256 @7 0.088 / 0.090 vs 0.105 / 0.106.  The few-tile path
      computes tiles four at a time, so with fewer F(2x2) tiles it loses:
      512->512 @6 (9 of them) 0.50 vs 0.38, @4 (4) 0.50 vs 0.18.  Session
      28's factored transform (additions beside the FMAs): 512->512 @7
      0.46 / 0.52 vs 0.65 / 0.69, and down to 128x128 channels it won too
      (@7: 128->128 0.055 vs 0.065, 64->256 0.054 vs 0.066, 96->192 0.057 vs
      0.069, 256->64 0.065 vs 0.068); below, it still lost (64->128 0.051
      vs 0.043, 128->64 0.054 vs 0.044), though 64->64 won (0.036 vs
      0.046).  At batch 2 (8 tiles) it tied with F(4x4)'s packed U (1.00 /
      1.11 vs 1.00 / 1.06 ms).
    - 2 otherwise: F(2x2, 3x3), whose 16 x C x OC pay for its 1.8x the
      multiplications.  Measured, 2 threads, prepacked 512->512: @7 batch 1
      302 vs 273 GFLOPS median (best 348 vs 355) against F(4x4), and in
      ResNet-18 at batch 1 (its three such layers), 13.8-16.0 vs 14.4-15.9
      ms median over three interleaved runs; at batch 2 (8 tiles) F(4x4) was
      faster (315 vs 278), and at 16 tiles far faster.

    Filters transformed per call never leave the cache there (the kernels'
    fused and few-tile paths), and F(4x4) won: 512->512 @7 b1 252/233 vs
    215/203 GFLOPS best/median.  Except where the kernels' short-M path
    takes F(2x2)'s tiles (AVX2, at least 512 input channels, 8 to 49
    tiles, or float32 and 256 channels, 8 to 16 tiles: winograd_frame.pxi,
    wino_short_max_tiles): there F(2x2), whose
    16 tiles fill the short-M kernels' vectors where F(4x4)'s 4 left them
    half empty (Zen 3, 512->512 @7 b1, best ms: F(4x4) fused 1.39-1.50,
    F(2x2) short-M 1.09-1.26), unless F(4x4)'s tiles take that path too
    and cost less, as points x (tiles + 7): a filter's transform costs
    about 7 tiles' products a point.  Zen 3, 512->512, best ms F(4x4) /
    F(2x2), both short-M: @7 b2 (8 / 32 tiles) 1.82-1.85 / 2.01-2.03, @14
    b1 (16 / 49) 2.60-2.68 / 3.11-3.13, but @10 b1 (9 / 25) 2.11-2.14 /
    1.84-1.87."""
    if _is_thin_winograd(geo, Cg):
        return "thin"
    if not prepacked:
        tiles4, tiles2 = _winograd_tiles(N, geo), _winograd_tiles(N, geo, 2)
        short = _dispatch.kernels.winograd_short_applies
        if short(tiles2, Cg, dtype) and (not short(tiles4, Cg, dtype)
                                         or 16 * (tiles2 + 7) < 36 * (tiles4 + 7)):
            return 2
        return 4
    if _winograd_tiles(N, geo) > 4:
        return 4
    if (Cg * OCg >= 128 * 128 and _winograd_tiles(N, geo, 2) >= 12
            and _dispatch.kernels.winograd_few_applies(OCg, dtype)):
        return "few"
    return 2


#: Layers of at most this many 4x4 tiles, with per-call filters, take the
#: kernels' fused path (winograd_frame.pxi, wino_fused_max_tiles): each
#: thread transforms a panel of filters at a time and multiplies every tile
#: by it from L2.
_FUSED_MAX_TILES = 64
#: ...and of at most this many, the few-tile path where it applies
#: (WINO_FEW_MAX_TILES, winograd_few_applies): no transformed filter stored.
_FEW_MAX_TILES = 8


#: Layers with fewer than 16 output channels (an RGB output layer, a
#: segmentation head) leave most of implicit GEMM's 32-wide register tiles
#: empty; Winograd's GEMMs are as narrow, but 4x fewer per output, and its
#: input transform then dominates.  Zen 4, 2 threads, best ms implicit /
#: Winograd F(4x4), Cg -> OCg for OCg in 1, 3, 8, 15: at 112x112 b1 1.03-2.23
#: for 32-256 input channels (16: 0.84-1.72), 224x224 b1 1.70-2.39 (16:
#: 0.89-1.62), 56x56 b8 1.03-2.55 (16: 0.89-1.65); at 56x56 b1 0.87-2.34,
#: at 28x28 0.55-2.14, at 14x14 0.20-1.48 and at 7x7 0.15-0.93 (the
#: per-call overheads, over few tiles).  64->3 @224 b1: implicit 8.7 ms,
#: Winograd 3.5, torch CL 4.1.
_THIN_OUTPUT_MIN_CHANNELS = 32
_THIN_OUTPUT_MIN_PIXELS = 112 * 112


def _winograd_pays(N, geo, Cg, OCg, prepacked, dtype="float32"):
    """Whether Winograd beats implicit GEMM for this 3x3 stride-1 layer (per
    group).  Measured on Zen 4, 2 threads (benchmarks/README.md,
    "Winograd"): with prepacked filters it ran 2-4x faster on every ResNet
    3x3 layer, down to one 7x7 image.  Two things cost it: thin channels
    (below 16 in or out the 36 GEMMs are too shallow or too narrow for the
    micro-kernel and the transforms dominate: 0.5-0.8x at 8), and, unless
    prepacked, the filter transform, 36 x C x OC values per call, which
    enough tiles must pay back.  Written to memory and read back, it lost at
    4 tiles (0.8-0.9x), won from 16 (1.1-1.5x) up to 256x256 channels, and
    from 32 at 512x512 (0.84x at 16, 1.1x at 32).  Transformed a panel at a
    time next to its GEMMs (up to _FUSED_MAX_TILES tiles), it won from 4
    tiles with 256x256 channels and more: GFLOPS best/median vs implicit,
    512->512 @7 b1 252/233 vs 184/173, 256->256 @7 b1 237/224 vs 181/165,
    512->512 @14 b1 439/381 vs 196/173; with 128x128 @7 b1 they tied
    (127-129 vs 136-137).  Zen 5, with the kernels' few-tile path (at most
    8 tiles, AVX-512: U never stored), in one process: 512->512 @7 b1
    458/444 vs 386/370, 256->256 @7 b1 373/358 vs 351/345; below 256x256
    channels the rule stands: 128->128 @7 b1 268/255 vs 253/238 (a tie in
    the noise), 64->128 @7 b1 203/197 vs 252/238.  Zen 4, after the few-tile
    path made its rows of points from the raw taps (session 28), in one
    process, best/median ms Winograd vs implicit: b1 @7 128->256
    0.130/0.145 vs 0.204/0.214, 256->128 0.141/0.159 vs 0.192/0.221, b2 @7
    128->128 0.098/0.116 vs 0.157/0.175, float64 b1 @7 128->128
    0.120/0.124 vs 0.222/0.234; 128->128 @7 b1 won in some processes
    (0.073/0.078 vs 0.092/0.102) and tied in others (0.10-0.13 both).
    Below 128x128 channels it was mixed (64->128 @7 b1 0.082 vs 0.067 in
    one process, 0.058 vs 0.098 in three others; 96->128 a tie, 128->96
    0.080 vs 0.099), so the rule leaves them to implicit GEMM, and images
    where less than half of its 4x4 tiles' outputs are in the image
    (128->128 @5 b1 0.066 vs 0.058, b2 0.097 vs 0.093; @6 b1 0.067 vs
    0.073, b2 0.095 vs 0.143).  Fewer than 16 output channels: see
    _THIN_OUTPUT_MIN_PIXELS."""
    if Cg < 16 or OCg < 16:
        return (OCg < 16 and Cg >= _THIN_OUTPUT_MIN_CHANNELS
                and N * geo.out_hw[0] * geo.out_hw[1] >= _THIN_OUTPUT_MIN_PIXELS)
    tiles = _winograd_tiles(N, geo)
    if prepacked:
        return True
    if (tiles <= _FEW_MAX_TILES and Cg * OCg >= 128 * 128
            and 2 * N * geo.out_hw[0] * geo.out_hw[1] >= 16 * tiles
            and _dispatch.kernels.winograd_few_applies(OCg, dtype)):
        return True
    if 4 <= tiles <= _FUSED_MAX_TILES and Cg * OCg >= 256 * 256:
        return True
    return tiles >= 16 * max(1.0, (Cg * OCg) ** 0.5 / 256)


def _short_m_pays(groups, Cg, OCg, pixels, prepacked, dtype):
    """Whether a 1x1 layer (per call) is faster as gemm1x1, whose GEMM runs
    a short image (at most 49 pixels: 7x7 at batch 1) by the short-M
    kernels (_kernels/short_m_kernel.h: the weights read in place, the
    image packed), than by implicit GEMM, which packs the weights.  Zen 4,
    2 threads, 7x7 batch 1, best ms implicit -> gemm1x1: 2048->512 0.553 ->
    0.491, 512->2048 0.534 -> 0.498, 1024->2048 1.08 -> 0.95, 512->512
    0.151 -> 0.140; ties at 1024->256 and 256->1024, a loss at 2048->64
    (0.092 -> 0.101).  Zen 3 (AVX2, float32: blocks of 16 rows): 2048->512
    0.75-0.79 -> 0.63-0.65, 512->2048 0.73 -> 0.60-0.62, 1024->2048 1.52 ->
    1.16-1.21, 512->512 0.20 -> 0.175.  Prepacked weights cost implicit GEMM
    no packing: 2048->512 0.474 ms (Zen 4), ahead."""
    return (groups == 1 and not prepacked and OCg >= 512
            and _dispatch.kernels.short_m_gemm_applies(pixels, OCg, Cg, dtype))


# Fewer output channels than this: gemm1x1's narrow-output kernels.
_NARROW_OUTPUT_CHANNELS = 16


def _narrow_output_pays(groups, x, w2d):
    """Whether gemm1x1 runs a 1x1 layer with fewer than 16 output channels
    (a segmentation head, an RGB output) by the kernels' narrow-output GEMM
    (narrow_output_gemm: 1x1 64->3 @224 b1 1.08 -> 0.51 ms on Zen 4, torch
    CL 0.51; 0.80 -> 0.50 on Zen 3): one group, pixels and weight rows
    contiguous, at most a vector of output channels, a build that has the
    short-M kernels (AVX-512; AVX2 for float32)."""
    OC, K = w2d.shape
    return (groups == 1 and OC < _NARROW_OUTPUT_CHANNELS
            and x.flags.c_contiguous and w2d.flags.c_contiguous
            and _dispatch.kernels.narrow_output_gemm_applies(
                x.size // K, OC, K, _args.dtype_name(x.dtype)))


def _choose_algorithm(algorithm, groups, C, OC, N, geo, in_hw, prepacked=False,
                      dtype="float32"):
    """The forward algorithm: "auto" picks by shape; a forced one must apply.

    - "direct": depthwise (groups == C > 1) or narrow groups (2, 4, 8 or 16
      channels in and out per group, see _is_narrow_grouped): kernels
      vectorised over channels;
    - "gemm1x1": 1x1, stride 1, unpadded: one GEMM on the image as it is
      (auto takes implicit GEMM, which reads the image in place too, for
      groups of more than 64 output channels on images of at most 4096
      pixels or with more input channels than the GEMM's k-block, and where
      a group has more than twice as many input channels as the image has
      pixels; outside AVX-512, for ungrouped layers of 16 or more output
      channels; but gemm1x1 again, per call, for images of at most 49
      pixels and 512 or more channels in and out, see _short_m_pays);
    - "winograd": 3x3, stride 1, any dilation: Winograd F(4x4, 3x3), 36
      GEMMs in the transformed domain (4x fewer multiplications), or, with
      prepacked filters and few tiles, F(4x4) from packed half-transformed
      filters or F(2x2, 3x3), 16 GEMMs (2.25x fewer; see _winograd_variant
      and _winograd_pays for when auto takes it); for fewer than 16 input
      channels, undilated, F(2x2, 3x3) with the products in registers (the
      kernels' thin path: _thin_winograd_pays);
    - "implicit": implicit GEMM, any convolution (interior pixels read in
      place, border pixels' patch rows built a chunk at a time);
    - "im2col": the whole patch matrix, then one GEMM per group (the
      textbook method: most memory; auto never takes it: with tiles that
      span output rows, implicit GEMM measured 4-13 % faster even where the
      patch matrix stays in cache, ResNet-18's 3x3/2 layers at batch 1).
    """
    if algorithm == "auto":
        if _is_depthwise(groups, C) or _is_narrow_grouped(groups, C, OC, geo.kernel):
            return "direct"
        if _is_pointwise(geo, in_hw):
            # Both read the image in place; which is faster was measured (Zen
            # 5, 2 threads, fresh processes, best/median GFLOPS implicit vs
            # gemm1x1).  Implicit GEMM, for groups of more than 64 output
            # channels, on small images: b1 64->256 @56 420/417 vs 396/392,
            # 512->128 @28 409/405 vs 383/379, 256->1024 @14 381/368 vs
            # 323/309, 512->2048 @7 387/382 vs 350/343 (at b8 256->1024 and
            # 1024->256 @14 tied); and with more input channels than the
            # GEMM's k-block (its own k-blocks are deeper, _kernels
            # conv_frame CONV_KC_F32): b8 512->128 @28 466/455 vs 410/400,
            # 512->2048 @7 488/478 vs 436/425.  Not on large images with few
            # input channels: b8 128->512 @28 482/471 vs 492/483, and
            # 64->256 @56 300-390 vs 480-500 median in most processes (one
            # process measured them equal; the cause was not found).  With
            # 64 output channels (two micro-panels) the GEMM frame, which
            # asks for its next A slice from inside the micro-kernel, is
            # faster: 256->64 @56 b1 445 vs 467, b8 441 vs 496.  And where
            # the weights outweigh the image (more than two input channels a
            # pixel) implicit GEMM packs them a block at a time per thread,
            # or not at all once prepacked (2048->512 @7 b1 0.74 -> 0.58 ms
            # on Zen 4).  The AVX2 and baseline builds (6 x 16 and 6 x 8
            # float32 tiles; baseline is also the aarch64 build, not
            # measured) take implicit GEMM for ungrouped layers of 16 or more
            # output channels: Zen 3, AVX2, 2 threads, one process
            # alternating, best/median GFLOPS implicit vs gemm1x1: b8 64->256
            # @56 108/105 vs 98/96, 64->64 @56 111/105 vs 101/97, 32->128
            # @112 94/90 vs 79/76, 128->512 @28 128/123 vs 121/115; b1 64->64
            # @56 72/69 vs 67/65; 256->64 @56 b8 and b1, 128->32 @112 b8,
            # 256->1024 @14 b8, 1024->256 @14 b8 within 3 %; baseline b8
            # 64->256 23/20 vs 20/18, 64->64 16/14 vs 13/13.  Fewer output
            # channels stay with gemm1x1 and its narrow-output kernels;
            # grouped 1x1 layers were not measured.
            Cg, OCg, pixels = C // groups, OC // groups, N * in_hw[0] * in_hw[1]
            if _short_m_pays(groups, Cg, OCg, pixels, prepacked, dtype):
                return "gemm1x1"
            gemm_kc = _dispatch.kernels.BLOCKING_F32["KC"]
            if Cg > 2 * pixels or (OCg > 64 and (pixels <= 4096 or Cg > gemm_kc)):
                return "implicit"
            if (groups == 1 and _dispatch.kernels.ISA != "avx512"
                    and OCg >= _NARROW_OUTPUT_CHANNELS):
                return "implicit"
            return "gemm1x1"
        if _thin_winograd_pays(groups, N, geo, C) or (
                _is_winograd(geo) and _winograd_pays(N, geo, C // groups, OC // groups,
                                                     prepacked, dtype)):
            return "winograd"
        return "implicit"
    reason = _inapplicable(algorithm, groups, C, OC, geo, in_hw)
    if reason:
        raise ValueError(reason)
    return algorithm


def _inapplicable(algorithm, groups, C, OC, geo, in_hw):
    """Why a forced algorithm cannot run this convolution ("" if it can)."""
    if algorithm == "direct" and not (_is_depthwise(groups, C)
                                      or _is_narrow_grouped(groups, C, OC, geo.kernel)):
        return (f"algorithm='direct' needs a depthwise layer (groups == C > 1) or "
                f"groups of 2, 4, 8 or 16 input and as many output channels "
                f"(got groups={groups}, C={C}, OC={OC})")
    if algorithm == "gemm1x1" and not _is_pointwise(geo, in_hw):
        return "algorithm='gemm1x1' needs a 1x1 kernel with stride 1 and no padding"
    if algorithm == "winograd" and not _is_winograd(geo):
        return (f"algorithm='winograd' needs a 3x3 kernel with stride 1 "
                f"(got kernel {geo.kernel}, stride {geo.stride})")
    return ""


#: What algorithm="tune" times: every algorithm "auto" can choose.  Not
#: im2col, which builds the whole patch matrix (the memory implicit GEMM
#: exists to save) and measured slower than implicit GEMM everywhere.
_TUNE_CANDIDATES = ("implicit", "gemm1x1", "winograd", "direct")


def _tuned_algorithm(x, w2d, groups, geo, bias, activation, packed, residual):
    """algorithm="tune": the fastest algorithm for this problem, timed at
    its first call in the process (fastconv/_tune.py)."""
    N, _, _, C = x.shape
    OC = w2d.shape[0]
    prepacked = packed is not None
    auto = _choose_algorithm("auto", groups, C, OC, N, geo, x.shape[1:3], prepacked,
                             _args.dtype_name(x.dtype))
    if x.size == 0 or N * geo.out_hw[0] * geo.out_hw[1] * OC == 0:
        return auto     # nothing to compute, nothing to time
    problem = _tune.Problem(_dispatch.kernels.ISA, x.dtype.str, x.shape, w2d.shape, groups,
                            *geo, get_num_threads(), prepacked, bias is not None,
                            residual is not None, activation)
    candidates = tuple(a for a in _TUNE_CANDIDATES
                       if not _inapplicable(a, groups, C, OC, geo, x.shape[1:3]))
    return _tune.choose(problem, candidates, auto, lambda a: _forward(
        x, w2d, groups, geo, bias, a, activation, packed, residual))


def _forward(x, w2d, groups, geo, bias=None, algorithm="auto", activation=None, packed=None,
             residual=None):
    """(N, OH, OW, OC) convolution of NHWC x by w2d (OC, KH*KW*Cg), + bias,
    + residual (None or an array of the result's shape), then the
    activation.  packed: None, or a callable giving the packed weights for
    (kernels, group, algorithm[, Winograd tile])."""
    if algorithm == "tune":
        algorithm = _tuned_algorithm(x, w2d, groups, geo, bias, activation, packed, residual)
    N, _, _, C = x.shape
    OC, K = w2d.shape
    OH, OW = geo.out_hw
    algorithm = _choose_algorithm(algorithm, groups, C, OC, N, geo, x.shape[1:3],
                                  packed is not None, _args.dtype_name(x.dtype))
    y = empty_aligned((N, OH, OW, OC), x.dtype)
    if y.size == 0:
        return y
    if x.size == 0:
        # No input pixel (every tap is padding) or no input channel.
        y[...] = 0 if bias is None else bias
        if residual is not None:
            y += residual
        return _activate(y, activation)
    kernels, nt = _dispatch.kernels, get_num_threads()
    act = _ACTIVATIONS[activation]
    # Kernels that cannot add a residual run without the activation then;
    # _add_late_residual adds both after them.
    act_alone = act if residual is None else _ACTIVATIONS[None]
    if algorithm == "direct":
        # The weights as the direct kernels take them: rearranged per call
        # (~2 us of a 35 us depthwise 576 @14 call), or once by PackedConv2d.
        taps = (_direct_tap_weights(w2d, groups, C, geo.kernel) if packed is None
                else packed(kernels, 0, algorithm))
        forward = (kernels.depthwise_forward if _is_depthwise(groups, C)
                   else kernels.grouped_direct_forward)
        forward(x, taps, bias, y, *geo[:4], nt, act_alone)
        return _add_late_residual(y, residual, activation)
    y_rows = _pixel_matrix(y)
    if _groups_in_parallel(groups, nt) and algorithm in ("implicit", "winograd"):
        kernels.conv2d_forward_groups(
            x, w2d, bias, y_rows, groups, *geo, nt, act_alone, algorithm == "winograd",
            None if packed is None else [packed(kernels, g, algorithm) for g in range(groups)])
        return _add_late_residual(y, residual, activation)
    # The GEMM and Winograd paths add a residual in their epilogue, before
    # the activation: y starts as a copy of it and they accumulate onto it
    # (ResNet's relu(conv(x) + shortcut): no sum array, no separate add and
    # relu passes).
    accumulate = residual is not None
    if accumulate:
        np.copyto(y, residual)
    beta = 1.0 if accumulate else 0.0
    # One group's operands are the arrays themselves (views cost ~0.3 us
    # each, a fair share of a small layer's call).
    group_operands = ([(x, w2d, y_rows, bias)] if groups == 1 else
                      [(x[..., c], w2d[oc], y_rows[:, oc], None if bias is None else bias[oc])
                       for c, oc in _group_slices(groups, C, OC)])
    for g, (xg, wg, yg, b) in enumerate(group_operands):
        if algorithm == "gemm1x1" and _narrow_output_pays(groups, x, wg):
            # The kernel adds no bias along its pixels' axis: y starts as
            # it (over any residual) and the kernel accumulates onto y.
            if b is not None and accumulate:
                yg += b
            elif b is not None:
                yg[...] = b
            kernels.narrow_output_gemm(_pixel_matrix(xg), wg, 1.0 if accumulate or b is not None
                                       else 0.0, yg, nt, act)
        elif algorithm == "gemm1x1":
            kernels.gemm(1.0, _pixel_matrix(xg), wg.T, beta, yg, nt, b, act)
        elif algorithm == "im2col":
            cols = np.empty((y_rows.shape[0], K), x.dtype)
            kernels.im2col(xg, cols, *geo, nt)
            kernels.gemm(1.0, cols, wg.T, beta, yg, nt, b, act)
        elif algorithm == "winograd":
            variant = _winograd_variant(x.shape[0], geo, xg.shape[3], wg.shape[0],
                                        _args.dtype_name(x.dtype), packed is not None)
            filters = (None if packed is None or variant == "thin"
                       else packed(kernels, g, algorithm, variant))
            kernels.conv2d_winograd(xg, wg, b, yg, geo.pad_before, geo.out_hw, nt, act,
                                    filters, dilation=geo.dilation, accumulate=accumulate,
                                    tile=2 if variant in (2, "thin") else 4)
        else:
            kernels.conv2d_forward(xg, wg, b, yg, *geo, nt, act,
                                   None if packed is None else packed(kernels, g, algorithm),
                                   accumulate)
    return y


def _add_late_residual(y, residual, activation):
    """For a y computed without its activation when there is a residual
    (a path whose kernel cannot add one): y + residual, then the
    activation.  Without a residual y is finished already."""
    if residual is None:
        return y
    y += residual
    return _activate(y, activation)


def _activate(y, activation):
    if activation is not None:
        np.maximum(y, 0, out=y)
        if activation == "relu6":
            np.minimum(y, 6, out=y)
    return y


def _data_grad(dy, w2d, groups, geo, in_shape):
    """Gradient (in_shape, NHWC) of _forward's input for output gradient dy."""
    C = in_shape[3]
    OC = w2d.shape[0]
    if 0 not in in_shape and dy.size and _is_winograd(geo):
        flipped = _flipped_geometry(geo, in_shape[1:3])
        if _thin_winograd_pays(groups, dy.shape[0], flipped, OC // groups):
            # Few output channels: the input gradient is a thin layer.
            return _winograd_data_grad(_channels_last(dy), w2d, groups, flipped, in_shape,
                                       tile=2)
        # Not for few input channels (the gradient's outputs), where the
        # forward's thin-output rule would take Winograd: col2im over patch
        # rows K = 9*C wide beat it (VGG conv1_1's backward, 2 threads, fc /
        # torch CL: 1.32 / 1.33 at b1 and 1.61 / 1.62 at b8 that way, 0.91 /
        # 0.96 and 1.13 / 1.09 by Winograd).
        if C // groups >= 16 and _winograd_pays(dy.shape[0], flipped, OC // groups,
                                                C // groups, False, _args.dtype_name(dy.dtype)):
            return _winograd_data_grad(_channels_last(dy), w2d, groups, flipped, in_shape)
    kernels, nt = _dispatch.kernels, get_num_threads()
    if (_is_pointwise(geo, in_shape[1:3]) and not _is_depthwise(groups, C)
            and not _is_narrow_grouped(groups, C, OC, geo.kernel)
            and 0 not in in_shape and dy.size):
        # col2im would be a plain copy: the GEMMs write dx, each element
        # once, so it needs no zeroing, and aligned it may be streamed.
        # Grouped layers too, a GEMM per group on all threads: the groups-
        # in-parallel kernel (zeroed dx, accumulated) measured 2.5-5x slower
        # here (Zen 5, 2 threads, best ms: 256->256 g32 @28 b8 0.32 vs
        # 1.62, g4 0.46 vs 1.20, 128->128 g8 @56 b1 0.062 vs 0.25;
        # 512->1024 g32 @14 b8 0.76 vs 0.69, its median 0.77 vs 1.22).
        dx = empty_aligned(in_shape, dy.dtype)
        dy_rows = _unit_columns(_pixel_matrix(dy))
        for c, oc in _group_slices(groups, C, OC):
            kernels.gemm(1.0, dy_rows[:, oc], w2d[oc], 0.0, _pixel_matrix(dx[..., c]), nt)
        return dx
    if (_windows_disjoint(geo) and not _is_depthwise(groups, C)
            and not _is_narrow_grouped(groups, C, OC, geo.kernel)
            and not _groups_in_parallel(groups, nt) and 0 not in in_shape and dy.size):
        # Windows that do not overlap (1x1/2 downsampling, patchify stems):
        # each input pixel gets its one tap's value or zero, so dx is written
        # once, never zeroed first nor read.
        dx = np.empty(in_shape, dy.dtype)
        dy_rows = _unit_columns(_pixel_matrix(dy))
        for c, oc in _group_slices(groups, C, OC):
            kernels.conv2d_grad_input(dy_rows[:, oc], w2d[oc], dx[..., c], *geo, nt, True)
        return dx
    if 0 in in_shape or dy.size == 0:
        return np.zeros(in_shape, dy.dtype)
    # The stride-1 depthwise and narrow-grouped input gradients are forward
    # convolutions, which write every element of dx: no zeroing (depthwise
    # 3x3 at batch 8, 2 threads: 32 @112, a 12.8 MB dx, 0.64 -> 0.36 ms; 576
    # @14 0.16-0.18 -> 0.14 ms).
    if _is_depthwise(groups, C):
        taps = _tap_weights(w2d, geo.kernel)
        (DH, DW), (PT, PL) = geo.dilation, geo.pad_before
        if (geo.kernel == (3, 3) and geo.stride == (1, 1) and OC == C
                and PT <= 2 * DH and PL <= 2 * DW):
            # At stride 1 the input gradient is dy convolved with the flipped
            # kernel (see _flipped_geometry): the forward's 3x3 row kernel.
            dx = empty_aligned(in_shape, dy.dtype)
            kernels.depthwise_forward(_channels_last(dy), np.ascontiguousarray(taps[::-1, ::-1]),
                                      None, dx, geo.kernel, (1, 1), geo.dilation,
                                      (2 * DH - PT, 2 * DW - PL), nt)
            return dx
        dx = np.zeros(in_shape, dy.dtype)
        kernels.depthwise_grad_input(np.ascontiguousarray(dy), taps, dx, *geo[:4], nt)
        return dx
    if geo.stride == (1, 1) and _is_narrow_grouped(groups, C, OC, geo.kernel):
        flipped = _flipped_geometry(geo, in_shape[1:3])
        if min(flipped.pad_before) >= 0:
            dx = empty_aligned(in_shape, dy.dtype)
            kernels.grouped_direct_forward(
                _channels_last(dy), _grouped_tap_weights(w2d, groups, geo.kernel, flip=True),
                None, dx, *flipped[:4], nt)
            return dx
    if geo.stride != (1, 1) and groups == 1 and C >= _PHASE_MIN_CHANNELS:
        return _phase_data_grad(dy, w2d, geo, in_shape)
    dx = np.zeros(in_shape, dy.dtype)
    dy_rows = _unit_columns(_pixel_matrix(dy))
    if _groups_in_parallel(groups, nt):
        kernels.conv2d_grad_input_groups(dy_rows, w2d, dx, groups, *geo, nt)
        return dx
    for c, oc in _group_slices(groups, C, OC):
        kernels.conv2d_grad_input(dy_rows[:, oc], w2d[oc], dx[..., c], *geo, nt)
    return dx


def _windows_disjoint(geo):
    """No input pixel lies in two windows (or twice in one): the stride is
    at least the dilated kernel's extent along both axes."""
    return all(s >= (k - 1) * d + 1 for s, k, d in zip(geo.stride, geo.kernel, geo.dilation))


def _flipped_geometry(geo, in_hw):
    """For stride 1, the data gradient is itself a convolution: dx[i] =
    sum_k dy[i + pad - d*k] w[k] = sum_j dy[i - (d*(K-1)-pad) + d*j]
    w[K-1-j], i.e. dy convolved with the flipped kernel (input and output
    channels swapped) at the same dilation d under padding d*(K-1)-pad
    before, giving the input size.  This is that convolution's geometry."""
    (KH, KW), (DH, DW), (PT, PL) = geo.kernel, geo.dilation, geo.pad_before
    return _Geometry(geo.kernel, (1, 1), geo.dilation,
                     (DH * (KH - 1) - PT, DW * (KW - 1) - PL), tuple(in_hw))


#: The phase form of a strided layer's input gradient (_phase_data_grad) for
#: groups of at least this many input channels (the phases' output channels).
_PHASE_MIN_CHANNELS = 32


def _stride_phases(K, S, D, P, size, out):
    """Along one axis of a strided layer (kernel K, stride S, dilation D,
    padding P before, input size, output size out): for each phase p of
    the input (indices p, p + S, ...), the stride-1 correlation of dy that
    gives its gradient: (p, kernel taps in the order it reads them, its
    dilation, its padding before, how many dy rows it skips).
    Input index i = o*S - P + k*D takes tap k from output o, so phase p
    gets the taps with k*D = p + P (mod S), from o = a + (p + P - k*D)/S
    for its a-th index: offsets that grow by D/gcd(S, D) as k falls.  A
    phase no tap reaches has no taps (its gradient is zero)."""
    g = math.gcd(S, D)
    phases = []
    for p in range(min(S, size)):
        taps = [k for k in range(K) if (p + P - k * D) % S == 0][::-1]
        first = (p + P - taps[0] * D) // S if taps else 0
        skip = max(0, first)
        if not taps or skip >= out:
            phases.append((p, [], 1, 0, 0))
        else:
            phases.append((p, taps, D // g, skip - first, skip))
    return phases


def _phase_data_grad(dy, w2d, geo, in_shape):
    """The input gradient of a strided layer (one group) as S_H x S_W
    stride-1 convolutions of dy, one per phase of dx (the pixels p + S*a,
    q + S*b), each with the taps that reach it (a 3x3/2 layer: 1, 2, 2 and 4
    of them), written straight into dx[:, p::S_H, q::S_W] by the implicit
    GEMM, which packs the phase's weights from w2d's taps itself
    (kernels.conv2d_forward_view): every element of dx once, from
    registers, where dy @ w2d followed by col2im wrote and read back KH*KW
    values a pixel and added them into a zeroed dx.  Zen 5, 2 threads, in
    one process alternating, median GFLOPS col2im -> phases: 3x3/2 64->128
    @56 b1 387 -> 420, b8 411 -> 405 (384 -> 455 once the implicit GEMM
    stopped prefetching images an L3 holds, as dy is here); 128->256 @28 b1
    369 -> 411, b8 434 -> 440; 256->512 @14 b1 321 -> 359, b8 419 -> 460;
    32->64 @112 b8 356 -> 405; 7x7/2 32->64 @224 b8 306 -> 388; 4x4/2
    64->64 @64 b4 375 -> 449; 5x5/2 64->64 @56 b8 377 -> 445.  With 16
    channels (the phases' output channels, half a micro-panel) 225 -> 172:
    hence _PHASE_MIN_CHANNELS.  Grouped layers keep col2im, whose results do not
    depend on whether groups run in parallel."""
    kernels, nt = _dispatch.kernels, get_num_threads()
    _, H, W, C = in_shape
    (KH, KW), (SH, SW), (DH, DW), (PT, PL), (OH, OW) = (
        geo.kernel, geo.stride, geo.dilation, geo.pad_before, geo.out_hw)
    dy = _channels_last(dy)
    w2d = _unit_columns(w2d)
    dx = np.empty(in_shape, dy.dtype)
    for p, taps_h, dil_h, pad_h, skip_h in _stride_phases(KH, SH, DH, PT, H, OH):
        for q, taps_w, dil_w, pad_w, skip_w in _stride_phases(KW, SW, DW, PL, W, OW):
            out = dx[:, p::SH, q::SW]
            if not taps_h or not taps_w:
                out[...] = 0
                continue
            # The kernel packs the phase's weights from w2d's taps as it goes.
            kernels.conv2d_forward_view(
                dy[:, skip_h:, skip_w:], w2d, out, (len(taps_h), len(taps_w)),
                (dil_h, dil_w), (pad_h, pad_w), [kh * KW + kw for kh in taps_h for kw in taps_w],
                nt)
    return dx


def _winograd_data_grad(dy, w2d, groups, flipped, in_shape, tile=4):
    """The input gradient of a 3x3 stride-1 layer as the Winograd F(tile x
    tile, 3x3) convolution of dy with the flipped kernel (geometry
    `flipped`); the kernels read w2d's taps backwards, so no flipped copy is
    made (tile 2: the thin path, for few output channels)."""
    C, OC = in_shape[3], w2d.shape[0]
    kernels, nt = _dispatch.kernels, get_num_threads()
    dx = np.empty(in_shape, dy.dtype)
    dx_rows = _pixel_matrix(dx)
    if _groups_in_parallel(groups, nt):
        kernels.conv2d_forward_groups(dy, w2d, None, dx_rows, groups, *flipped, nt,
                                      winograd=True, flipped=True)
        return dx
    for c, oc in _group_slices(groups, C, OC):
        kernels.conv2d_winograd(dy[..., oc], w2d[oc], None, dx_rows[:, c], flipped.pad_before,
                                flipped.out_hw, nt, flipped=True, dilation=flipped.dilation,
                                tile=tile)
    return dx


def _weight_grad(dy, x, groups, geo):
    """Gradient (OC, KH*KW*Cg) of _forward's w2d for output gradient dy."""
    C = x.shape[3]
    OC = dy.shape[3]
    KH, KW = geo.kernel
    dw = np.zeros((OC, KH * KW * (C // groups)), x.dtype)
    if dw.size == 0 or dy.size == 0 or x.size == 0:
        return dw
    kernels, nt = _dispatch.kernels, get_num_threads()
    if _is_depthwise(groups, C):
        dw_taps = np.empty((KH, KW, OC), x.dtype)
        kernels.depthwise_grad_weight(x, np.ascontiguousarray(dy), dw_taps, *geo[:4], nt)
        return np.ascontiguousarray(dw_taps.reshape(KH * KW, OC).T)
    if _is_narrow_grouped(groups, C, OC, geo.kernel):
        KG = OC // groups
        dw_taps = np.empty((KH, KW, KG, OC), x.dtype)
        kernels.grouped_direct_grad_weight(x, np.ascontiguousarray(dy), dw_taps, *geo[:4], nt)
        # [kh, kw, i, g*KG + j] -> [g*KG + j, (kh, kw, i)]
        return np.ascontiguousarray(
            dw_taps.reshape(KH, KW, KG, groups, KG).transpose(3, 4, 0, 1, 2)).reshape(OC, -1)
    dy_rows = _unit_columns(_pixel_matrix(dy))
    if _groups_in_parallel(groups, nt):
        # 1x1 layers too, since their weight gradient left the GEMM for the
        # same kernel: Zen 5, 2 threads, best/median GFLOPS group by group
        # vs groups in parallel: 256->256 g4 @28 b8 281/269 vs 367/355,
        # 240->240 g8 @28 b8 75/73 vs 150/146, 128->128 g4 @56 b1 208/196
        # vs 338/325 (the same sums: equal results).
        kernels.conv2d_grad_weight_groups(x, dy_rows, dw, groups, *geo, nt)
        return dw
    for c, oc in _group_slices(groups, C, OC):
        # A 1x1 layer's patch rows are its image's pixels, read in place;
        # with more output channels than input channels the kernel runs
        # one GEMM (dy^T @ image) unless its per-thread chunks of pixels
        # are faster (see conv_grad_weight_nogil).
        kernels.conv2d_grad_weight(x[..., c], dy_rows[:, oc], dw[oc], *geo, nt)
    return dw


def _bias_grad(dy):
    # Accumulated in float64: a float32 running sum over millions of pixels
    # would lose several digits.
    return dy.sum(axis=(0, 1, 2), dtype=np.float64).astype(dy.dtype)


# ------------------------------------------------------- argument checking

class _Conv(NamedTuple):
    x: np.ndarray        # NHWC view of the caller's x
    weight: np.ndarray   # NHWC view of the caller's weight: (OC, KH, KW, C/groups)
    geo: _Geometry       # of the convolution of padded_x()
    pads: tuple
    padding_mode: str
    layout: str

    def padded_x(self):
        """What the kernels convolve: x, explicitly padded unless the
        padding is zeros, with contiguous channels."""
        return _channels_last(_pad(self.x, self.pads, self.padding_mode))

    def out_shape(self):
        """The result's NHWC shape."""
        return (self.x.shape[0], *self.geo.out_hw, self.weight.shape[0])

    def padded_shape(self):
        if self.padding_mode == "zeros":
            return self.x.shape
        (top, bottom), (left, right) = self.pads
        N, H, W, C = self.x.shape
        return (N, H + top + bottom, W + left + right, C)


def _check_arrays(x, weight, layout):
    layout = _args.choice(layout, "layout", _args.LAYOUTS)
    x = _args.float_array(x, "x", 4)
    weight = _args.float_array(weight, "weight", 4)
    _args.same_dtype(weight, "weight", x.dtype)
    x, weight = _to_nhwc(x, layout), _to_nhwc(weight, layout)
    if weight.shape[1] < 1 or weight.shape[2] < 1:
        raise ValueError(f"weight has an empty kernel: shape {weight.shape} in {layout} order")
    return x, weight, layout


def _check_bias(bias, dtype, channels):
    if bias is None:
        return None
    bias = _args.float_array(bias, "bias", 1)
    _args.same_dtype(bias, "bias", dtype)
    if bias.shape != (channels,):
        raise ValueError(f"bias must have shape ({channels},); got {bias.shape}")
    return np.ascontiguousarray(bias)  # the kernels add it from contiguous memory


def _check_residual(residual, c):
    """residual as an NHWC view (None stays None): the result shape of the
    convolution c (a _Conv) in the caller's layout, the dtype of x."""
    if residual is None:
        return None
    dtype, nhwc_shape, layout = c.x.dtype, c.out_shape(), c.layout
    r = _args.float_array(residual, "residual", 4)
    _args.same_dtype(r, "residual", dtype)
    r = _to_nhwc(r, layout)
    if r.shape != tuple(nhwc_shape):
        raise ValueError(f"residual must have the result's shape "
                         f"{_shape_from_nhwc(nhwc_shape, layout)}; "
                         f"got {_shape_from_nhwc(r.shape, layout)}")
    return r


def _check_activation(activation):
    if not (activation is None or activation in ("relu", "relu6")):
        raise ValueError(f"activation must be None, 'relu' or 'relu6'; got {activation!r}")


def _check_grad_output(grad_output, dtype, nhwc_shape, layout):
    dy = _args.float_array(grad_output, "grad_output", 4)
    _args.same_dtype(dy, "grad_output", dtype)
    dy = _to_nhwc(dy, layout)
    if dy.shape != tuple(nhwc_shape):
        raise ValueError(f"grad_output must have shape {_shape_from_nhwc(nhwc_shape, layout)}; "
                         f"got {_shape_from_nhwc(dy.shape, layout)}")
    return _channels_last(dy)


def _check_grouping(x, groups, stride, dilation):
    """groups, stride and dilation normalised; groups must divide x's channels."""
    groups = _args.positive_int(groups, "groups")
    stride = _args.positive_pair(stride, "stride")
    dilation = _args.positive_pair(dilation, "dilation")
    if x.shape[3] % groups:
        raise ValueError(f"groups={groups} does not divide the {x.shape[3]} channels of x")
    return groups, stride, dilation


def _conv_setup(x, weight, stride, padding, dilation, groups, padding_mode, layout):
    x, weight, layout = _check_arrays(x, weight, layout)
    padding_mode = _args.choice(padding_mode, "padding_mode", _args.PADDING_MODES)
    groups, stride, dilation = _check_grouping(x, groups, stride, dilation)
    N, H, W, C = x.shape
    OC, KH, KW, Cg = weight.shape
    if OC % groups:
        raise ValueError(f"groups={groups} does not divide the {OC} output channels of weight")
    if Cg != C // groups:
        raise ValueError(f"weight has {Cg} input channels per group, but x has {C} channels "
                         f"in {groups} group(s), i.e. {C // groups} per group")
    pads = _args.conv_padding(padding, (H, W), (KH, KW), stride, dilation)
    out_hw = _args.conv_output_hw((H, W), (KH, KW), stride, pads, dilation, "weight")
    pad_before = (pads[0][0], pads[1][0])
    if padding_mode != "zeros":
        _args.check_mode_padding(pads, (H, W), padding_mode)
        pad_before = (0, 0)
    geo = _Geometry((KH, KW), stride, dilation, pad_before, out_hw)
    return _Conv(x, weight, geo, pads, padding_mode, layout)


class _Transposed(NamedTuple):
    x: np.ndarray        # NHWC view (only ever a GEMM operand: any strides do)
    weight: np.ndarray   # (C_in, KH, KW, C_out/groups)
    geo: _Geometry       # of the convolution whose data gradient this is
    out_shape: tuple     # NHWC
    layout: str


def _transpose_setup(x, weight, stride, padding, output_padding, groups, dilation, layout):
    x, weight, layout = _check_arrays(x, weight, layout)
    groups, stride, dilation = _check_grouping(x, groups, stride, dilation)
    output_padding = _args.int_pair(output_padding, "output_padding")
    N, H, W, C = x.shape
    C_w, KH, KW, OCg = weight.shape
    if C_w != C:
        raise ValueError(f"weight has {C_w} input channels (its first axis), x has {C}")
    pads = _args.explicit_padding(padding)
    out_hw = _args.transpose_output_hw((H, W), (KH, KW), stride, pads, dilation, output_padding)
    # The forward convolution from out_hw yields at least (H, W) patches;
    # this is the adjoint of its first H x W (the rest see no input).
    geo = _Geometry((KH, KW), stride, dilation, (pads[0][0], pads[1][0]), (H, W))
    return _Transposed(x, weight, geo, (N, *out_hw, OCg * groups), layout)


# ------------------------------------------------------------- public API

def im2col(x, kernel_size, stride=1, padding=0, dilation=1):
    """Patch matrix of an NHWC image batch.

    Returns the (N*OH*OW, KH*KW*C) matrix whose row (n, oh, ow) holds the
    input pixels under the kernel placed at output pixel (oh, ow), in
    (kh, kw, c) order, zero where the kernel overlaps the padding.  padding
    takes conv2d's forms (int, pair, per-side pairs, "valid", "same").
    """
    x = _args.float_array(x, "x", 4)
    kernel = _args.positive_pair(kernel_size, "kernel_size")
    stride = _args.positive_pair(stride, "stride")
    dilation = _args.positive_pair(dilation, "dilation")
    N, H, W, C = x.shape
    pads = _args.conv_padding(padding, (H, W), kernel, stride, dilation)
    out_hw = _args.conv_output_hw((H, W), kernel, stride, pads, dilation, "kernel_size")
    geo = _Geometry(kernel, stride, dilation, (pads[0][0], pads[1][0]), out_hw)
    cols = np.empty((N * out_hw[0] * out_hw[1], kernel[0] * kernel[1] * C), x.dtype)
    if cols.size == 0:
        return cols
    if x.size == 0:
        cols[...] = 0  # every tap is padding
        return cols
    # Copied (if at all) only once the arguments are known to be valid.
    _dispatch.kernels.im2col(_channels_last(x), cols, *geo, get_num_threads())
    return cols


def col2im(cols, input_shape, kernel_size, stride=1, padding=0, dilation=1):
    """Adjoint of :func:`im2col`: an NHWC array of input_shape (N, H, W, C)
    where every entry of cols is added onto the pixel it was copied from
    (overlapping taps sum, taps in the padding are dropped)."""
    cols = _args.float_array(cols, "cols", 2)
    N, H, W, C = _args.shape4(input_shape, "input_shape")
    kernel = _args.positive_pair(kernel_size, "kernel_size")
    stride = _args.positive_pair(stride, "stride")
    dilation = _args.positive_pair(dilation, "dilation")
    pads = _args.conv_padding(padding, (H, W), kernel, stride, dilation)
    out_hw = _args.conv_output_hw((H, W), kernel, stride, pads, dilation, "kernel_size")
    expected = (N * out_hw[0] * out_hw[1], kernel[0] * kernel[1] * C)
    if cols.shape != expected:
        raise ValueError(f"cols must have shape {expected} for input_shape {(N, H, W, C)}; "
                         f"got {cols.shape}")
    cols = np.ascontiguousarray(cols)
    out = np.zeros((N, H, W, C), cols.dtype)
    if out.size == 0 or cols.size == 0:
        return out
    geo = _Geometry(kernel, stride, dilation, (pads[0][0], pads[1][0]), out_hw)
    _dispatch.kernels.col2im(cols, out, *geo, get_num_threads())
    return out


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
           padding_mode="zeros", layout="NHWC", algorithm="auto", activation=None,
           residual=None):
    """2-D convolution (cross-correlation), torch.nn.functional.conv2d semantics.

    layout="NHWC": x (N, H, W, C), weight (OC, KH, KW, C/groups), result
    (N, OH, OW, OC).  layout="NCHW": x (N, C, H, W), weight (OC, C/groups,
    KH, KW) as in PyTorch, result (N, OC, OH, OW) (a view of NHWC memory).

    stride, dilation: int or (h, w).  padding: int, (ph, pw),
    ((top, bottom), (left, right)), "valid", or "same" (TensorFlow/ONNX
    SAME_UPPER: OH = ceil(H / stride), the odd pixel at the bottom/right).
    padding_mode: "zeros", "reflect", "replicate" or "circular".
    x, weight and bias must share one dtype, float32 or float64.

    algorithm: "auto" (default: "direct" for depthwise and for groups of 2,
    4, 8 or 16 channels in and out, "gemm1x1" for most 1x1 stride-1
    unpadded layers, "winograd" for 3x3 stride-1 layers with enough
    channels and tiles, or with few input channels (an RGB image's first
    layer) on AVX-512, else "implicit"; see _choose_algorithm), or one of
    those or "im2col" to force it (ValueError where it does not apply), or
    "tune": at the problem's first call in the process, time every
    algorithm auto can choose that applies and keep the fastest (auto's
    choice unless another is 5 % faster; fastconv.tuned_algorithms() lists
    the choices).  Winograd F(4x4, 3x3) (F(2x2, 3x3) where there are few
    tiles or input channels) rounds differently from the direct methods
    (float32 error vs a float64 reference a few times larger for F(4x4),
    about the same for F(2x2); benchmarks/README.md has the figures), and
    a NaN or inf in an input window spreads over its whole 4x4 (2x2) output
    tile.  activation: None, "relu" or
    "relu6", applied to the result (with the bias) while each output tile is
    still in cache.  residual: None, or an array of the result's shape and
    dtype added before the activation (ResNet's relu(conv(x) + shortcut));
    the GEMM and Winograd paths add it in the same epilogue.
    """
    c = _conv_setup(x, weight, stride, padding, dilation, groups, padding_mode, layout)
    bias = _check_bias(bias, c.x.dtype, c.weight.shape[0])
    algorithm = _args.choice(algorithm, "algorithm", ALGORITHMS)
    _check_activation(activation)
    residual = _check_residual(residual, c)
    y = _forward(c.padded_x(), _weight_matrix(c.weight), groups, c.geo, bias, algorithm,
                 activation, residual=residual)
    return _from_nhwc(y, c.layout)


_UNSET = object()


class PackedConv2d:
    """conv2d with fixed weights, packed once for fastconv's GEMM kernels and
    reused by every call: for inference, where packing a large layer's
    weights can cost as much as convolving a single image.

    ``PackedConv2d(weight, bias=None, stride=1, padding=0, dilation=1,
    groups=1, *, padding_mode="zeros", layout="NHWC", activation=None,
    algorithm="auto")`` takes conv2d's arguments except x; ``packed(x)``
    equals ``conv2d(x, weight, bias, ..., activation=activation,
    algorithm=a)`` for the algorithm a it runs: the forced one, or auto's
    choice for prepacked filters (see below), which can be Winograd where
    conv2d's per-call auto is not.  The weights and
    bias are copied: changing the arrays afterwards does not change the
    layer.  Packing happens at the first call with each kernel build
    (FASTCONV_ISA / use_isa), for the groups that run the implicit or the
    Winograd algorithm (Winograd-domain filters, G g G^T, for the latter;
    with few tiles their column halves G g, or F(2x2)'s: see
    _winograd_variant; nothing for layers of fewer than 16 input channels,
    whose thin path transforms its few filters per call), and for the direct
    kernels of depthwise and narrow groups (their weights rearranged
    tap-major).
    With the filter transform paid once, "auto" takes Winograd for every
    3x3 stride-1 layer with at least 16 input and output channels per group,
    and with the GEMM panels packed once, implicit GEMM for 1x1 layers whose
    weights outweigh the image (see _choose_algorithm).  With
    algorithm="tune", the first call with each input shape times the
    algorithms (packing the weights for each) and keeps the packs of the
    one chosen.
    """

    def __init__(self, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
                 padding_mode="zeros", layout="NHWC", activation=None, algorithm="auto"):
        layout = _args.choice(layout, "layout", _args.LAYOUTS)
        weight = _args.float_array(weight, "weight", 4)
        self.weight = np.array(weight)                    # the caller's layout, owned
        self.bias = None if bias is None else np.array(
            _check_bias(bias, weight.dtype, _to_nhwc(weight, layout).shape[0]))
        _check_activation(activation)
        self.algorithm = _args.choice(algorithm, "algorithm", ALGORITHMS)
        self.options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                            padding_mode=padding_mode, layout=layout)
        self.activation = activation
        self._w2d = _weight_matrix(_to_nhwc(self.weight, layout))
        self._packs = {}   # (ISA, algorithm, Winograd variant, group) -> packed weights
        self._tuned = set()  # algorithm="tune": the algorithms chosen so far

    def _packed(self, kernels, group, algorithm, variant=4):
        # variant: Winograd's (_winograd_variant), F(4x4) when groups run in
        # parallel.
        key = (kernels.ISA, algorithm, variant if algorithm == "winograd" else None, group)
        pack = self._packs.get(key)
        if pack is None:
            groups = self.options["groups"]
            kernel = _to_nhwc(self.weight, self.options["layout"]).shape[1:3]
            if algorithm == "direct":   # every group's taps at once (group 0)
                C = self._w2d.shape[1] // (kernel[0] * kernel[1]) * groups
                self._packs[key] = _direct_tap_weights(self._w2d, groups, C, kernel)
                return self._packs[key]
            OCg = self._w2d.shape[0] // groups
            w_group = np.ascontiguousarray(self._w2d[group * OCg:(group + 1) * OCg])
            if algorithm == "winograd" and variant == "few":
                pack = kernels.pack_winograd_few_weights(w_group, get_num_threads())
            elif algorithm == "winograd":
                pack = kernels.pack_winograd_weights(w_group, get_num_threads(), variant)
            else:
                pack = kernels.pack_conv_weights(w_group, kernel, get_num_threads())
            self._packs[key] = pack
        return pack

    def __call__(self, x, residual=None, activation=_UNSET):
        """The convolution of x; residual as in conv2d; activation, when
        given, replaces the one of the constructor for this call."""
        o = self.options
        c = _conv_setup(x, self.weight, o["stride"], o["padding"], o["dilation"], o["groups"],
                        o["padding_mode"], o["layout"])
        if activation is _UNSET:
            activation = self.activation
        _check_activation(activation)
        residual = _check_residual(residual, c)
        x, algorithm = c.padded_x(), self.algorithm
        if algorithm == "tune":
            algorithm = _tuned_algorithm(x, self._w2d, o["groups"], c.geo, self.bias,
                                         activation, self._packed, residual)
            # Tuning (of this input shape, or another) packed the weights for
            # every candidate; keep the packs of the algorithms chosen.
            self._tuned.add(algorithm)
            if any(k[1] not in self._tuned for k in self._packs):
                self._packs = {k: v for k, v in self._packs.items() if k[1] in self._tuned}
        y = _forward(x, self._w2d, o["groups"], c.geo, self.bias, algorithm, activation,
                     self._packed, residual)
        return _from_nhwc(y, c.layout)


def conv2d_backward(grad_output, x, weight, stride=1, padding=0, dilation=1, groups=1, *,
                    padding_mode="zeros", layout="NHWC", output_mask=(True, True, True)):
    """Gradients of :func:`conv2d`: (grad_input, grad_weight, grad_bias), each
    None where output_mask is false, in the layout of x and weight.

    grad_output has conv2d's output shape.  Inputs that no kernel tap reads
    (skipped by the stride) get zero; with reflect/replicate/circular padding
    the gradient of each padded pixel is added back onto its source pixel.
    """
    c = _conv_setup(x, weight, stride, padding, dilation, groups, padding_mode, layout)
    want_input, want_weight, want_bias = _args.output_mask(output_mask)
    OC = c.weight.shape[0]
    dy = _check_grad_output(grad_output, c.x.dtype, (c.x.shape[0], *c.geo.out_hw, OC), c.layout)
    grad_input = grad_weight = grad_bias = None
    if want_input:
        grad_padded = _data_grad(dy, _weight_matrix(c.weight), groups, c.geo, c.padded_shape())
        grad_input = _from_nhwc(_unpad(grad_padded, c.pads, c.padding_mode, c.x.shape[1:3]),
                                c.layout)
    if want_weight:
        grad_weight = _weight_grad(dy, c.padded_x(), groups, c.geo).reshape(c.weight.shape)
        grad_weight = _from_nhwc(grad_weight, c.layout)
    if want_bias:
        grad_bias = _bias_grad(dy)
    return grad_input, grad_weight, grad_bias


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1, *, layout="NHWC"):
    """2-D transposed convolution, torch.nn.functional.conv_transpose2d
    semantics (note the argument order: groups before dilation).

    layout="NHWC": x (N, H, W, C_in), weight (C_in, KH, KW, C_out/groups),
    result (N, OH, OW, C_out).  layout="NCHW": x (N, C_in, H, W), weight
    (C_in, C_out/groups, KH, KW) as in PyTorch, result (N, C_out, OH, OW).
    OH = (H-1)*stride - top - bottom + dilation*(KH-1) + output_padding + 1.

    padding: int, (ph, pw) or ((top, bottom), (left, right)), cropped from
    the full output.  output_padding (int or pair) extends the bottom/right
    and must be smaller than max(stride, dilation) on each axis.
    """
    t = _transpose_setup(x, weight, stride, padding, output_padding, groups, dilation, layout)
    bias = _check_bias(bias, t.x.dtype, t.out_shape[3])
    y = _data_grad(t.x, _weight_matrix(t.weight), groups, t.geo, t.out_shape)
    if bias is not None:
        y += bias
    return _from_nhwc(y, t.layout)


def conv_transpose2d_backward(grad_output, x, weight, stride=1, padding=0, output_padding=0,
                              groups=1, dilation=1, *, layout="NHWC",
                              output_mask=(True, True, True)):
    """Gradients of :func:`conv_transpose2d`: (grad_input, grad_weight,
    grad_bias), each None where output_mask is false."""
    t = _transpose_setup(x, weight, stride, padding, output_padding, groups, dilation, layout)
    want_input, want_weight, want_bias = _args.output_mask(output_mask)
    dy = _check_grad_output(grad_output, t.x.dtype, t.out_shape, t.layout)
    grad_input = grad_weight = grad_bias = None
    if want_input:
        grad_input = _from_nhwc(_forward(dy, _weight_matrix(t.weight), groups, t.geo), t.layout)
    if want_weight:
        grad_weight = _weight_grad(t.x, dy, groups, t.geo).reshape(t.weight.shape)
        grad_weight = _from_nhwc(grad_weight, t.layout)
    if want_bias:
        grad_bias = _bias_grad(dy)
    return grad_input, grad_weight, grad_bias
