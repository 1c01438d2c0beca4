# Convolution drivers on the GEMM building blocks of gemm_frame.pxi (included
# before this file by the per-ISA modules).
#
# A convolution is a GEMM whose A operand is the patch matrix ("im2col") of
# the input: row m = (n, oh, ow), column k = (kh, kw, c).  That matrix is
# KH*KW times the input (882 MiB for VGG16 conv1_2 at batch 8), and writing
# then re-reading it from memory costs as much as the arithmetic.  So it is
# never built whole: each task builds a chunk of rows into a per-thread
# buffer that stays in L2 and multiplies it at once.  Workspace per call is
# the packed weights plus nt chunks, independent of the batch size.
#
# Images are NHWC with any pixel strides but contiguous channels (a channel
# slice x[..., c0:c1] of a grouped convolution qualifies).

from libc.string cimport memcpy, memset
from cython.parallel cimport threadid
import numpy as np

# Bytes of patch rows per chunk: half of a 1 MiB L2, leaving room for the B
# panels streaming through.  A variable so that tests can shrink it to one
# micro-panel and drive every chunking path with small images.
cdef Py_ssize_t chunk_bytes = 512 * 1024

# Images up to this size the forward's tiles do not prefetch: a quarter of
# the 32 MiB L3 of the machines measured (see multiply_pixel_rows).
cdef Py_ssize_t PREFETCH_IMAGE_BYTES = 8 << 20


def set_chunk_bytes(Py_ssize_t nbytes):
    """Set the patch-chunk budget (tests only: not thread-safe); returns the
    previous value."""
    global chunk_bytes
    previous = chunk_bytes
    chunk_bytes = max(1, nbytes)
    return previous


cdef enum:
    # dW reduces over chunk rows; a deeper chunk amortises the read-modify-
    # write of the thread's dW accumulator.
    GRAD_W_MIN_ROWS = 256
    # A test-sized chunk budget below this also lifts the GRAD_W_MIN_ROWS
    # floor.
    CHUNK_BYTES_FLOOR = 65536
    # Weight gradients of layers with at most FEW_OUTPUTS_MAX_OC output
    # channels run few_outputs_kernel.h's tiles instead of the GEMM's, and
    # of layers with up to FEW_OUTPUTS_WIDE_MAX_OC where output rows are at
    # least FEW_OUTPUTS_WIDE_MIN_OW wide; see few_outputs_applies.
    FEW_OUTPUTS_MAX_OC = 16
    FEW_OUTPUTS_WIDE_MAX_OC = 48
    FEW_OUTPUTS_WIDE_MIN_OW = 28
    # Below this many elements per thread, waking a team for a memory-bound
    # copy costs more than the extra bandwidth brings.
    COPY_ELEMENTS_PER_THREAD = 65536


cdef extern from "few_outputs_kernel.h":
    # acc[oc*ldacc + j] (+)= sum_m dy[m*rsdy + oc] * p[m*ldp + j]
    void fc_few_outputs_grad_weight_f32(Py_ssize_t rows, Py_ssize_t OC, Py_ssize_t ncols,
                                        const float* dy, Py_ssize_t rsdy, const float* p,
                                        Py_ssize_t ldp, float* acc, Py_ssize_t ldacc,
                                        int overwrite) noexcept nogil
    void fc_few_outputs_grad_weight_f64(Py_ssize_t rows, Py_ssize_t OC, Py_ssize_t ncols,
                                        const double* dy, Py_ssize_t rsdy, const double* p,
                                        Py_ssize_t ldp, double* acc, Py_ssize_t ldacc,
                                        int overwrite) noexcept nogil


cdef struct ConvGeom:
    Py_ssize_t N, H, W, C        # image, C = channels of one group
    Py_ssize_t KH, KW
    Py_ssize_t SH, SW            # stride
    Py_ssize_t DH, DW            # dilation
    Py_ssize_t PT, PL            # padding before (top, left); after is implied by OH, OW
    Py_ssize_t OH, OW


cdef struct ImageStrides:
    Py_ssize_t n, h, w           # in elements; channels are contiguous


cdef inline Py_ssize_t patch_cols(const ConvGeom* g) noexcept nogil:
    return g.KH * g.KW * g.C


cdef inline Py_ssize_t patch_ld(real dtype_tag, Py_ssize_t K) noexcept nogil:
    # Leading dimension of a chunk buffer: K, padded when rows would be a
    # multiple of 2 KiB apart (they would share L1 sets, see macro_kernel).
    if (K * <Py_ssize_t>sizeof(real)) % 2048 == 0:
        return K + A_PANEL_PAD
    return K


cdef inline Py_ssize_t chunk_rows(real dtype_tag, Py_ssize_t K, Py_ssize_t M,
                                  Py_ssize_t min_rows) noexcept nogil:
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t rows = chunk_bytes // (K * <Py_ssize_t>sizeof(real))
    if chunk_bytes >= CHUNK_BYTES_FLOOR:
        rows = max(rows, min_rows)
    rows = max(MR, rows // MR * MR)
    return min(rows, cdiv(M, MR) * MR)


cdef void im2col_pixel(const ConvGeom* g, const real* x, ImageStrides xs, Py_ssize_t m,
                       real* d, Py_ssize_t d_row, Py_ssize_t d_tap) noexcept nogil:
    # Pixel m's taps -> d: tap (kh, kw) at d + kh*d_row + kw*d_tap, C
    # contiguous values each; taps in the padding are zero.  A patch row
    # has d_row = KW*C, d_tap = C; a shadow window (see ShadowLayout) the
    # image's own tap offsets.  When pixels are dense and dilation is 1
    # (d_tap = C then), a kernel row's taps inside the image are a single
    # run of up to KW*C values (7x7 over RGB: 21 values in one copy, not 7).
    cdef Py_ssize_t ohw = g.OH * g.OW
    cdef Py_ssize_t n = m // ohw
    cdef Py_ssize_t r = m - n * ohw
    cdef Py_ssize_t oh = r // g.OW
    cdef Py_ssize_t ow = r - oh * g.OW
    cdef Py_ssize_t kh, kw, ih, iw, kw_lo, kw_hi
    cdef Py_ssize_t iw0 = ow * g.SW - g.PL
    cdef size_t run = g.C * sizeof(real)
    cdef bint dense_rows = g.DW == 1 and xs.w == g.C
    cdef real* dr
    cdef const real* xrow
    for kh in range(g.KH):
        dr = d + kh * d_row
        ih = oh * g.SH - g.PT + kh * g.DH
        if ih < 0 or ih >= g.H:
            if d_tap == g.C:
                memset(dr, 0, g.KW * run)
            else:
                for kw in range(g.KW):
                    memset(dr + kw * d_tap, 0, run)
            continue
        xrow = x + n * xs.n + ih * xs.h
        if dense_rows:
            # The taps inside the image as one run, zeros either side
            # (at the stem's border columns, 7 copies of 3 values a
            # kernel row had put 2.4 % of its time in memmove).
            kw_lo = min(g.KW, max(0, -iw0))
            kw_hi = max(kw_lo, min(g.KW, g.W - iw0))
            memset(dr, 0, kw_lo * run)
            if kw_hi > kw_lo:
                memcpy(dr + kw_lo * g.C, xrow + (iw0 + kw_lo) * xs.w, (kw_hi - kw_lo) * run)
            memset(dr + kw_hi * g.C, 0, (g.KW - kw_hi) * run)
            continue
        for kw in range(g.KW):
            iw = iw0 + kw * g.DW
            if iw < 0 or iw >= g.W:
                memset(dr + kw * d_tap, 0, run)
            else:
                memcpy(dr + kw * d_tap, xrow + iw * xs.w, run)


cdef void im2col_rows(const ConvGeom* g, const real* x, ImageStrides xs,
                      Py_ssize_t m0, Py_ssize_t m1, real* dst,
                      Py_ssize_t ldd) noexcept nogil:
    # Patch rows m0..m1 -> dst (row-major, leading dimension ldd): tap
    # (kh, kw) of a row at column (kh*KW + kw)*C.
    cdef Py_ssize_t m
    for m in range(m0, m1):
        im2col_pixel(g, x, xs, m, dst + (m - m0) * ldd, g.KW * g.C, g.C)


cdef void col2im_rows_add(const ConvGeom* g, const real* src, Py_ssize_t lds,
                          Py_ssize_t m0, Py_ssize_t m1,
                          Py_ssize_t ih0, Py_ssize_t ih1,
                          real* dx, ImageStrides xs, bint overwrite) noexcept nogil:
    # The adjoint of im2col_rows for patch rows m0..m1, restricted to input
    # rows ih0..ih1: dx[n, ih, iw, :] += every tap that reads it.  Taps in the
    # padding are dropped.  overwrite (windows_disjoint layers only, where
    # each pixel has at most one tap): dx[n, ih, iw, :] = that tap.
    cdef Py_ssize_t m, n, r, oh, ow, kh, kw, ih, iw, c
    cdef Py_ssize_t ohw = g.OH * g.OW
    cdef const real* s
    cdef real* d
    for m in range(m0, m1):
        n = m // ohw
        r = m - n * ohw
        oh = r // g.OW
        ow = r - oh * g.OW
        s = src + (m - m0) * lds
        for kh in range(g.KH):
            ih = oh * g.SH - g.PT + kh * g.DH
            if ih < ih0 or ih >= ih1:
                s += g.KW * g.C
                continue
            for kw in range(g.KW):
                iw = ow * g.SW - g.PL + kw * g.DW
                if 0 <= iw < g.W:
                    d = dx + n * xs.n + ih * xs.h + iw * xs.w
                    if overwrite:
                        memcpy(d, s, g.C * sizeof(real))
                    else:
                        for c in range(g.C):
                            d[c] += s[c]
                s += g.C


cdef inline bint windows_disjoint(const ConvGeom* g) noexcept nogil:
    # No input pixel is read by two taps (a stride at least the dilated
    # kernel's extent both ways: 1x1/2 downsampling, patchify stems): the
    # input gradient is then a scatter, each pixel written at most once.
    return g.SH >= (g.KH - 1) * g.DH + 1 and g.SW >= (g.KW - 1) * g.DW + 1


cdef inline bint tap_reads(Py_ssize_t i, Py_ssize_t pad, Py_ssize_t K, Py_ssize_t D,
                           Py_ssize_t S, Py_ssize_t O) noexcept nogil:
    # Whether some tap k of some output o in [0, O) reads input index i
    # (o*S - pad + k*D == i), along one axis.
    cdef Py_ssize_t k, t
    for k in range(K):
        t = i + pad - k * D
        if t >= 0 and t % S == 0 and t // S < O:
            return True
    return False


cdef void zero_unread_pixels(const ConvGeom* g, Py_ssize_t n, Py_ssize_t ih0, Py_ssize_t ih1,
                             real* dx, ImageStrides xs) noexcept nogil:
    # Zero the pixels of image n, input rows ih0..ih1, that no tap reads
    # (their gradient); with windows_disjoint the others are written once
    # by col2im_rows_add(overwrite), so dx needs no zeroing pass.
    cdef Py_ssize_t ih, iw
    cdef real* row
    cdef size_t pixel = g.C * sizeof(real)
    for ih in range(ih0, ih1):
        row = dx + n * xs.n + ih * xs.h
        if not tap_reads(ih, g.PT, g.KH, g.DH, g.SH, g.OH):
            if xs.w == g.C:
                memset(row, 0, g.W * pixel)
            else:
                for iw in range(g.W):
                    memset(row + iw * xs.w, 0, pixel)
        else:
            for iw in range(g.W):
                if not tap_reads(iw, g.PL, g.KW, g.DW, g.SW, g.OW):
                    memset(row + iw * xs.w, 0, pixel)


cdef struct KBlock:
    # A depth block of the patch columns: k in [k0, k0 + kc).  For the
    # forward's k-blocks it is also taps t0..t0+ntaps, channels c0..c0+cw of
    # each (kc = ntaps * cw): a block never splits a tap's channels unless it
    # holds that one tap only.
    Py_ssize_t k0, kc, t0, ntaps, c0, cw


cdef Py_ssize_t uniform_k_blocks(Py_ssize_t K, Py_ssize_t kc_blk, KBlock* blocks,
                                 Py_ssize_t lead=0) noexcept nogil:
    # Blocks of kc_blk, the last one short; with lead (< kc_blk), every
    # block after the first starts lead earlier (the last one lead longer).
    cdef Py_ssize_t b, n = cdiv(K, kc_blk)
    for b in range(n):
        blocks[b].k0 = b * kc_blk - lead if b > 0 else 0
        blocks[b].kc = ((b + 1) * kc_blk - lead if b < n - 1 else K) - blocks[b].k0
        blocks[b].t0 = 0
        blocks[b].ntaps = 1
        blocks[b].c0 = blocks[b].k0
        blocks[b].cw = blocks[b].kc
    return n


cdef enum:
    # The forward's k-blocks (float32): about 576 deep, a 3x3 layer's 9 taps
    # of 64 channels in one block, 3 of 128, 1 of 512.  Measured on Zen 5
    # against 256 (in one process, alternating; best GFLOPS of 1 / 2
    # threads): 3x3/2 64->128 @56 b8 242 -> 254 / 447 -> 487, b1 252 -> 263 /
    # 461 -> 482, 3x3/2 128->256 @28 b8 250 -> 259 / 475 -> 491, 3x3 64->64
    # @56 b8 (implicit) 239 -> 256 / 455 -> 492, 512->512 @7 b1 201 -> 207 /
    # 398 -> 408; the AVX2 build +0-3 %.  Fewer blocks: each output tile is
    # loaded and stored, and its run offsets set, once a block.  A tile's A
    # runs (12 pixels x 576 values, 27 KiB) still fit a 32 KiB L1; 768
    # (36 KiB) measured the same or better on Zen 5's 48 KiB L1 (3x3/2
    # 256->512 @14 b8, 2 threads, 476 -> 501 where 576 gave 487) but would
    # overflow a 32 KiB one.
    CONV_KC_F32 = 576
    # The forward's packed weight blocks (k-block x block width) stay under
    # this: a block's NR panels are read again by every tile of pixels, from
    # L2 while the block fits one (1 MiB on the machines measured) beside
    # the tiles' outputs.  The GEMM's NC of 512 made 1x1 2048->512 @7's
    # blocks 512 x 512 (1 MiB); halved to 256 wide (Zen 4, 2 threads,
    # alternating processes, best ms): b8 4.12-4.15 -> 3.99-4.06
    # (prepacked 3.82-3.89 -> 3.78-3.83), b1 prepacked 0.476-0.478 ->
    # 0.473-0.474, 3x3/2 256->512 @14 b8 4.37-4.40 -> 4.34-4.36, b1
    # 0.613-0.616 -> 0.604-0.606.
    CONV_B_BLOCK_BYTES = 640 * 1024
    # The weight gradient's blocks of patch rows (float32): each thread packs
    # KC x K of them (590 KiB at a 3x3 64-channel layer's K = 576) next to
    # its chunk of patch rows in L2.  Kept at 256, what it was before the
    # AVX-512 GEMM's KC became 384: 384 would make that 885 KiB of a 1 MiB
    # L2, and was not measured.
    GRAD_W_KC_F32 = 256


cdef inline Py_ssize_t conv_kc(real dtype_tag) noexcept nogil:
    return CONV_KC_F32 if real is float else D_KC


cdef Py_ssize_t conv_nc_blk(real dtype_tag, Py_ssize_t K, Py_ssize_t OC,
                            Py_ssize_t kc_max) noexcept nogil:
    # Width of the forward's packed weight blocks (the GEMM's, halved while
    # a block of kc_max rows is over CONV_B_BLOCK_BYTES).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t kc_unused, nc_blk
    block_sizes(<real>0, K, OC, &kc_unused, &nc_blk)
    while nc_blk > NR and kc_max * nc_blk * <Py_ssize_t>sizeof(real) > CONV_B_BLOCK_BYTES:
        nc_blk = cdiv(nc_blk // 2, NR) * NR
    return nc_blk


cdef Py_ssize_t conv_k_blocks(real dtype_tag, const ConvGeom* g, KBlock* blocks) noexcept nogil:
    # Blocks of whole taps, about KC deep; a tap deeper than KC is cut into
    # equal channel ranges.  blocks has room for KH*KW*cdiv(C, KC) entries.
    cdef Py_ssize_t KC = conv_kc(<real>0)
    cdef Py_ssize_t T = g.KH * g.KW, C = g.C
    cdef Py_ssize_t n = 0, b, t, tb, ncb, cb
    if C <= KC:
        tb = max(1, KC // C)
        tb = cdiv(T, cdiv(T, tb))
        for b in range(cdiv(T, tb)):
            blocks[n].t0 = b * tb
            blocks[n].ntaps = min(tb, T - b * tb)
            blocks[n].c0 = 0
            blocks[n].cw = C
            n += 1
    else:
        ncb = cdiv(C, KC)
        cb = cdiv(C, ncb)
        for t in range(T):
            for b in range(ncb):
                blocks[n].t0 = t
                blocks[n].ntaps = 1
                blocks[n].c0 = b * cb
                blocks[n].cw = min(cb, C - b * cb)
                n += 1
    for b in range(n):
        blocks[b].k0 = blocks[b].t0 * C + blocks[b].c0
        blocks[b].kc = blocks[b].ntaps * blocks[b].cw
    return n


cdef inline Py_ssize_t max_block_depth(const KBlock* blocks, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t b, depth = 0
    for b in range(n):
        depth = max(depth, blocks[b].kc)
    return depth


cdef inline Py_ssize_t max_block_taps(const KBlock* blocks, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t b, taps = 0
    for b in range(n):
        taps = max(taps, blocks[b].ntaps)
    return taps


cdef inline Py_ssize_t packed_b_size(const KBlock* blocks, Py_ssize_t n_kb, Py_ssize_t N,
                                     Py_ssize_t nc_blk) noexcept nogil:
    return cdiv(N, nc_blk) * n_kb * max_block_depth(blocks, n_kb) * nc_blk


cdef void pack_block_panel(const KBlock* blk, Py_ssize_t nr, const real* b, Py_ssize_t rsb,
                           Py_ssize_t csb, const Py_ssize_t* tap_src, real* dst) noexcept nogil:
    # nr columns of k-block blk of B (b at the first of them), packed as
    # pack_b_panel lays them out: rows k0..k0+kc at b + k*rsb; or, given
    # tap_src (forward blocks only, which hold whole taps), row (tap t,
    # channel c) at b + tap_src[t] + c*rsb -- taps gathered from another
    # layer's weight (see conv2d_forward_view).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t t
    if tap_src == NULL:
        pack_b_panel(blk.kc, nr, b + blk.k0 * rsb, rsb, csb, dst)
    else:
        for t in range(blk.ntaps):
            pack_b_panel(blk.cw, nr, b + tap_src[blk.t0 + t] + blk.c0 * rsb, rsb, csb,
                         dst + t * blk.cw * NR)


cdef void pack_b_blocks_into(const KBlock* blocks, Py_ssize_t n_kb, Py_ssize_t N,
                             const real* b, Py_ssize_t rsb, Py_ssize_t csb,
                             Py_ssize_t nc_blk, int nt, real* dst,
                             const Py_ssize_t* tap_src=NULL) noexcept nogil:
    # All of B (K x N), packed once into dst (packed_b_size elements): block
    # (jb, kb) -- k-block kb, columns jb*nc_blk.. -- at offset
    # (jb * n_kb + kb) * kc_max * nc_blk, its NR panels inside as
    # pack_b_panel lays them.  One task per NR columns, all k-blocks in
    # order, so that a transposed B (conv weights) is read as NR long row
    # streams: a task per k-block cut every row into KC-long pieces, too
    # short for the hardware prefetchers.
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t kc_max = max_block_depth(blocks, n_kb), n_jb = cdiv(N, nc_blk)
    cdef Py_ssize_t panels_per_blk = nc_blk // NR
    cdef Py_ssize_t t, jb, kb, jp, jc
    for t in prange(n_jb * panels_per_blk, num_threads=nt, schedule="static"):
        jb = t // panels_per_blk
        jp = t % panels_per_blk
        jc = jb * nc_blk + jp * NR
        if jc < N:
            for kb in range(n_kb):
                pack_block_panel(blocks + kb, min(NR, N - jc), b + jc * csb, rsb, csb, tap_src,
                                 dst + (jb * n_kb + kb) * kc_max * nc_blk + jp * NR * blocks[kb].kc)


cdef real* pack_b_blocks(const KBlock* blocks, Py_ssize_t n_kb, Py_ssize_t N,
                         const real* b, Py_ssize_t rsb, Py_ssize_t csb,
                         Py_ssize_t nc_blk, int nt,
                         const Py_ssize_t* tap_src=NULL) noexcept nogil:
    # pack_b_blocks_into a new aligned buffer; NULL when out of memory.
    cdef real* dst = <real*>aligned_malloc(packed_b_size(blocks, n_kb, N, nc_blk) * sizeof(real))
    if dst != NULL:
        pack_b_blocks_into(blocks, n_kb, N, b, rsb, csb, nc_blk, nt, dst, tap_src)
    return dst


cdef void multiply_chunk(Py_ssize_t rows, const KBlock* blocks, Py_ssize_t n_kb,
                         Py_ssize_t N, const real* a, Py_ssize_t rsa, Py_ssize_t csa,
                         const real* bpack, Py_ssize_t nc_blk,
                         Py_ssize_t js, Py_ssize_t n_js,
                         real* c, Py_ssize_t rsc, real beta,
                         const real* bias, bint pairs=False) noexcept nogil:
    # c[rows, share js of n_js of the columns] = a @ B (+ beta*c, + bias),
    # one thread, B prepacked by pack_b_blocks; a row-major (unit column
    # stride), so macro_kernel has no A.T rows to prefetch (next_kc 0).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t kc_max = max_block_depth(blocks, n_kb)
    cdef Py_ssize_t jb, kb, jc, nc, n_panels
    for jb in range(cdiv(N, nc_blk)):
        jc = jb * nc_blk
        nc = min(nc_blk, N - jc)
        n_panels = cdiv(nc, NR)
        for kb in range(n_kb):
            macro_kernel(rows, nc, blocks[kb].kc,
                         share_start(js, n_panels, n_js), share_start(js + 1, n_panels, n_js),
                         a + blocks[kb].k0 * csa, rsa, csa,
                         bpack + (jb * n_kb + kb) * kc_max * nc_blk,
                         c + jc, rsc, 1, 1, beta, kb == 0,
                         NULL if bias == NULL else bias + jc, ACT_NONE, 0, pairs)


cdef struct ShadowLayout:
    # Where the pixels with taps in the padding are read from: each gets a
    # shadow window, a copy of its taps (zeros in the padding) laid out with
    # the image's own tap offsets (tap (kh, kw) at kh*pitch + kw*tap, pitch
    # = DH*xs.h, tap = DW*xs.w; either may be negative, for views that run
    # backwards), so that every pixel of a tile, in the image or in a
    # shadow, reads run r at its pointer + run_off[r]: one kernel
    # (fc_shared_runs_kernel) and one pointer a pixel, where built patch
    # rows (runs KW*C apart) needed a table of every run's pointer per tile
    # and a kernel reading it: 3-8 % of a padded layer's time on its
    # border tiles (stem b8, VGG conv1_1, 3x3/2 64->128 @56).
    # A window spans KH rows |pitch| apart, width values each; windows of
    # per_band pixels interleave, slot values apart, within the gaps of a
    # band (a window's rows leave |pitch| - width values free), bands
    # band_size apart; a pixel's pointer is lead values into its slot.  So
    # shadows take about what patch rows took (C = 64 at 56x56: 590 values
    # a pixel for K = 576).  A view whose taps along a row overlap (|DW*xs.w|
    # < C: np.broadcast_to along W, or odd strides on a length-1 W axis)
    # cannot be mirrored, the copied taps would overwrite each other: its
    # windows take tap = C and a pitch of their own, and every pixel is read
    # from a window (wrong sums before, found by fuzzing).
    Py_ssize_t pitch, tap, width, slot, per_band, band_size, lead


cdef ShadowLayout shadow_layout(real dtype_tag, const ConvGeom* g, ImageStrides xs,
                                Py_ssize_t pixels, bint own_pitch) noexcept nogil:
    # For chunks of up to pixels pixels.  own_pitch: the windows' rows
    # width apart, not the image's (then no pixel can be read in place:
    # the run offsets follow the shadows).  Taken where |DH*xs.h| < width,
    # where no pixel is inside the image anyway (a kernel wider than the
    # image), and by conv_forward_nogil for a view whose rows are so far
    # apart that one band would outweigh the chunk's patch rows.
    cdef ShadowLayout sh
    sh.tap = g.DW * xs.w
    if g.KW > 1 and max(sh.tap, -sh.tap) < g.C:
        sh.tap = g.C
        own_pitch = True
    cdef Py_ssize_t span_w = (g.KW - 1) * sh.tap     # tap kw = KW-1's offset
    sh.width = max(span_w, -span_w) + g.C
    sh.pitch = g.DH * xs.h
    if own_pitch or max(sh.pitch, -sh.pitch) < sh.width:
        sh.pitch = sh.width
    cdef Py_ssize_t row_step = max(sh.pitch, -sh.pitch)
    sh.lead = max(0, -span_w) + max(0, -(g.KH - 1) * sh.pitch)
    # Slots (and bands) a multiple of 2 KiB apart would put a tile's pixels
    # in one L1 set (as patch_ld pads patch rows).
    sh.slot = sh.width
    if (sh.slot * <Py_ssize_t>sizeof(real)) % 2048 == 0:
        sh.slot += A_PANEL_PAD
    if g.KH == 1:
        sh.per_band = max(1, pixels)
    else:
        sh.per_band = (row_step - sh.width) // sh.slot + 1
    sh.band_size = (g.KH - 1) * row_step + (sh.per_band - 1) * sh.slot + sh.width
    if (sh.band_size * <Py_ssize_t>sizeof(real)) % 2048 == 0:
        sh.band_size += A_PANEL_PAD
    return sh


cdef inline Py_ssize_t shadow_size(const ShadowLayout* sh, Py_ssize_t pixels) noexcept nogil:
    # Values of shadow windows for up to pixels pixels.
    return cdiv(pixels, sh.per_band) * sh.band_size


cdef inline RowRange interior_columns(const ConvGeom* g, Py_ssize_t oh,
                                      bint use_taps) noexcept nogil:
    # Output columns of output row oh whose every tap is inside the image,
    # as [lo, hi); empty (OW, OW) when none is, or when the image is not to
    # be read in place (use_taps false: the shadows have a pitch of their own).
    cdef RowRange r
    cdef Py_ssize_t ih0 = oh * g.SH - g.PT, last
    r.lo = g.OW
    r.hi = g.OW
    if use_taps and ih0 >= 0 and ih0 + (g.KH - 1) * g.DH < g.H:
        last = g.W - 1 - (g.KW - 1) * g.DW + g.PL     # the last usable ow * SW
        if last >= 0:
            r.lo = min(g.OW, cdiv(g.PL, g.SW))
            r.hi = min(g.OW, last // g.SW + 1)
            if r.hi <= r.lo:
                r.lo = g.OW
                r.hi = g.OW
    return r


cdef Py_ssize_t border_pixels(const ConvGeom* g, bint use_taps) noexcept nogil:
    # Output pixels with a tap in the padding (or all of them when the
    # image is not read in place): those plan_pixel_rows gives a window.
    cdef Py_ssize_t oh, n = 0
    cdef RowRange cols
    for oh in range(g.OH):
        cols = interior_columns(g, oh, use_taps)
        n += g.OW - (cols.hi - cols.lo)
    return n * g.N


cdef void plan_pixel_rows(const ConvGeom* g, const real* x, ImageStrides xs,
                          Py_ssize_t m0, Py_ssize_t m1, bint use_taps,
                          const ShadowLayout* sh, real* buf, const real** pixels) noexcept nogil:
    # pixels[m - m0] for pixels m0..m1: the pixel's tap (0, 0) in the image
    # where all of its taps are inside it; otherwise in its shadow window,
    # built into buf.
    cdef Py_ssize_t ohw = g.OH * g.OW
    cdef Py_ssize_t m = m0, n, r, oh, ow, end, nbuf = 0
    cdef RowRange cols
    cdef real* d
    while m < m1:
        n = m // ohw
        r = m - n * ohw
        oh = r // g.OW
        ow = r - oh * g.OW
        cols = interior_columns(g, oh, use_taps)
        if cols.lo <= ow < cols.hi:
            end = min(m1, m + cols.hi - ow)
            while m < end:
                pixels[m - m0] = (x + n * xs.n + (oh * g.SH - g.PT) * xs.h
                                  + (ow * g.SW - g.PL) * xs.w)
                m += 1
                ow += 1
        else:
            # Up to the row's first interior column, or to the row's end.
            end = min(m1, m + (cols.lo - ow if ow < cols.lo else g.OW - ow))
            while m < end:
                d = (buf + (nbuf // sh.per_band) * sh.band_size
                     + (nbuf % sh.per_band) * sh.slot + sh.lead)
                im2col_pixel(g, x, xs, m, d, sh.pitch, sh.tap)
                pixels[m - m0] = d
                nbuf += 1
                m += 1


cdef inline real* output_pixel(const ConvGeom* g, real* y, const ImageStrides* ys,
                              Py_ssize_t m) noexcept nogil:
    # Output pixel m = (n, oh, ow) of a view with strides ys.
    cdef Py_ssize_t ohw = g.OH * g.OW
    cdef Py_ssize_t n = m // ohw, r = m - n * ohw
    cdef Py_ssize_t oh = r // g.OW
    return y + n * ys.n + oh * ys.h + (r - oh * g.OW) * ys.w


cdef void multiply_pixel_rows(const ConvGeom* g, ImageStrides xs,
                              const Py_ssize_t* tap_off, const real** pixels, Py_ssize_t npix,
                              const KBlock* blocks, Py_ssize_t n_kb, Py_ssize_t OC,
                              const real* bpack, Py_ssize_t nc_blk,
                              Py_ssize_t js, Py_ssize_t n_js,
                              const real* bias, int act, real* y, Py_ssize_t rsy,
                              bint stream, const real* w, Py_ssize_t rsb, Py_ssize_t csb,
                              real* own_block, Py_ssize_t* block_off,
                              real beta, Py_ssize_t m0=0,
                              const ImageStrides* ys=NULL,
                              const Py_ssize_t* tap_src=NULL) noexcept nogil:
    # y[the npix pixels, share js of the output channels] = patches @ w.T
    # (+ bias) (+ y when beta is 1): the forward's macro-kernel.  Up to MR
    # consecutive pixels are one tile, whatever output rows and borders they
    # span (pixels: each one's tap (0, 0), in the image or its shadow
    # window, see plan_pixel_rows): per k-block, run r of every pixel is at
    # its pointer + block_off[r] (fc_shared_runs_kernel), the tile's A slice
    # stays in L1 while the NR panels of the block stream from L2.  stream:
    # y's full tiles go out with non-temporal stores (can_stream).
    # B comes prepacked (bpack, as pack_b_blocks lays it out), or, when
    # own_block is given, this task packs its share of each block of w into
    # own_block (one block, kc_max x nc_blk) just before multiplying it
    # (w as B, K x OC with strides rsb, csb, read as pack_block_panel
    # reads it, with tap_src).  tap_off holds the KH*KW taps' offsets, then
    # the KH kernel rows'.
    # Pixel i's output row is y + i*rsy; or, with ys (an output view whose
    # rows are not evenly spaced, see conv_forward_nogil), pixel m0 + i's
    # (n, oh, ow) at y + n*ys.n + oh*ys.h + ow*ys.w (rsy = ys.w): a tile
    # within one output row is finished in place as any other, one that
    # crosses a row end through acc, a row at a time.
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t kc_max = max_block_depth(blocks, n_kb)
    cdef real acc[MAX_TILE]
    cdef Py_ssize_t jb, kb, jc, nc, n_panels, jp0, jp1, ti, i0, mr, i, r, jp, jr, n_runs, run_len
    cdef const Py_ssize_t* run_off
    cdef const real* bblk
    cdef const KBlock* blk
    cdef real* yt
    cdef real* out
    cdef const real* tile_bias
    cdef const real* out_bias
    cdef Py_ssize_t rso
    cdef int flags, tile_act, out_act
    cdef Py_ssize_t n_pan, half
    cdef real* y_tile
    cdef bint split
    # With dense pixels and no dilation along rows, a kernel row's taps are
    # one run of KW*C values in the image (and in a shadow window): a
    # block of whole kernel rows is read as one run per row (7x7 over RGB:
    # 7 runs of 21 instead of 49 of 3; each run restarts the micro-kernel's
    # inner loop).
    cdef bint rows_dense = g.DW == 1 and xs.w == g.C
    # Tiles of equal size (within one pixel): 49 pixels as 4 x 12 + 1 spent
    # ~8 % of a 512->512 @7 batch-1 call in the 1-row tile, whose loop
    # waits on its B loads; as 9 + 4 x 10 every tile keeps the FMAs busy.
    cdef Py_ssize_t n_tiles = cdiv(npix, MR), nx0, nxm
    # While a tile is multiplied, its panels ask for the next tile's runs
    # (into L2), as the GEMM frame does for the next slice of A: an image
    # past L2 made the micro-kernel wait on its broadcasts (1 thread, in one
    # process alternately: 1x1 256->64 @56 batch 8, forced implicit, 82-88
    # -> 100-106 GFLOPS; 3x3/2 64->128 @56 batch 8 97-101 -> 103-107).  Not
    # for an image of at most PREFETCH_IMAGE_BYTES, which the L3 holds from
    # one k-block to the next: the requests, issued at once at the tile's
    # first panel, then cost more than they hide (Zen 5, 2 threads, in one
    # process alternating, best/median GFLOPS with a 2 MiB threshold -> 16
    # MiB: 3x3/2 64->128 @56 b8, a 6.4 MB image, 490/478 -> 511/497; 128->256
    # @28 b8 488/478 -> 500/488; the 2x2-tap phase of its input gradient
    # (dy 3.2 MB) 456/445 -> 484/471; 2048->512 @7 b8 466/446 -> 471/454;
    # at 12.8 MB mixed, 503/482 -> 509/470, so images past 8 MiB keep it;
    # at 25.7 MB, b32, prefetching is 7-10 % faster, 2 threads and 1), nor
    # for runs shorter than 4 lines, whose prefetch loop costs more than it
    # hides (VGG conv1_1, 9-value runs: 77-93 -> 68-84).
    cdef bint prefetch_runs
    # Pixels read in place a multiple of 4 KiB apart all fall in one L1 set
    # (8-way on the CPUs measured): past 8 rows (AVX-512's 12 float and 14
    # double), a tile's kernel call takes half of them at a time.
    # Copying every such pixel into a shadow window instead cost more (Zen
    # 4, 2 threads, in one process alternating, median ms, copy -> in
    # place): 1x1 2048->512 @7 b8 4.55 -> 4.03, 1024->256 @14 b8 4.42 ->
    # 3.97, b1 0.540 -> 0.508, 1024->48 @14 b2 0.363 -> 0.310; float64 8.24
    # -> 8.13, 8.30 -> 8.10, 1.48 -> 1.44, 0.538 -> 0.493; 3x3/2 512->128
    # @8 b4 0.818 -> 0.826 (float64 1.079 -> 0.955); AVX2 (6 rows)
    # 1.01-1.05x faster.  Whole tiles of 14 float64 rows read in place
    # were 1.2-1.3x slower than the copies.
    cdef bint halve_tiles = MR > 8 and (g.SW * xs.w * <Py_ssize_t>sizeof(real)) % 4096 == 0
    cdef Py_ssize_t part, h0
    cdef bint image_past_l3 = (g.N * g.H * g.W * xs.w * <Py_ssize_t>sizeof(real)
                               > PREFETCH_IMAGE_BYTES)
    for jb in range(cdiv(OC, nc_blk)):
        jc = jb * nc_blk
        nc = min(nc_blk, OC - jc)
        n_panels = cdiv(nc, NR)
        jp0 = share_start(js, n_panels, n_js)
        jp1 = share_start(js + 1, n_panels, n_js)
        for kb in range(n_kb):
            blk = blocks + kb
            if (rows_dense and blk.cw == g.C and blk.t0 % g.KW == 0
                    and blk.ntaps % g.KW == 0):
                n_runs = blk.ntaps // g.KW
                run_off = tap_off + g.KH * g.KW + blk.t0 // g.KW
                run_len = g.KW * g.C
            else:
                n_runs = blk.ntaps
                run_off = tap_off + blk.t0
                run_len = blk.cw
            for r in range(n_runs):
                block_off[r] = run_off[r] + blk.c0
            prefetch_runs = image_past_l3 and run_len * <Py_ssize_t>sizeof(real) >= 256
            if own_block != NULL:
                for jp in range(jp0, jp1):
                    jr = jp * NR
                    pack_block_panel(blk, min(NR, nc - jr), w + (jc + jr) * csb, rsb, csb,
                                     tap_src, own_block + jr * blk.kc)
                bblk = own_block
            else:
                bblk = bpack + (jb * n_kb + kb) * kc_max * nc_blk
            for ti in range(n_tiles):
                i0 = share_start(ti, npix, n_tiles)
                mr = share_start(ti + 1, npix, n_tiles) - i0
                split = False
                if ys == NULL:
                    y_tile = y + i0 * rsy
                else:
                    y_tile = output_pixel(g, y, ys, m0 + i0)
                    split = (m0 + i0) % g.OW + mr > g.OW
                jp = jp0
                while jp < jp1:
                    jr = jp * NR
                    # Two full panels at once where the build has the tile
                    # (S_PAIR_MR; the tile's pixels in two halves): each
                    # pixel's runs are read once per 2*NR output channels.
                    # Zen 5, 2 threads, processes alternating (median
                    # GFLOPS, 12x32 -> pairs of 6x64): VGG conv1_1 b1 387-406
                    # -> 438-440, stem b1 426-457 -> 448-469, 3x3/2 64->128
                    # @56 b8 455 -> 463-466, 2048->512 @7 b1 338 -> 350;
                    # conv1_1 b8 (102 MB streamed out) 369-378 -> 358-360,
                    # stem b8 441-444 either way.  (A whole AVX-512 build at
                    # 6x64 lost 8-22 % on Winograd's GEMMs, hence pairs here
                    # rather than another tile for every product.)
                    n_pan = 1
                    if (real is float and S_PAIR_MR > 0 and jp + 1 < jp1
                            and nc - jr >= 2 * NR and mr <= 2 * S_PAIR_MR and not split):
                        n_pan = 2
                    if prefetch_runs and ti + 1 < n_tiles:
                        # These panels' share of the next tile's pixels.
                        nx0 = share_start(ti + 1, npix, n_tiles)
                        nxm = share_start(ti + 2, npix, n_tiles) - nx0
                        for i in range(share_start(jp - jp0, nxm, jp1 - jp0),
                                       share_start(jp - jp0 + n_pan, nxm, jp1 - jp0)):
                            for r in range(n_runs):
                                fc_prefetch_rows(pixels[nx0 + i] + block_off[r], 1, 0,
                                                 run_len * sizeof(real))
                    yt = y_tile + jc + jr
                    tile_bias = NULL if bias == NULL or kb != 0 else bias + jc + jr
                    tile_act = act if kb == n_kb - 1 else ACT_NONE
                    # Finished by the kernel into y, or into acc for write_tile.
                    flags = -1 if split else tile_out_flags(min(NR, nc - jr), NR, yt, 1,
                                                            <real>1, beta, kb == 0, stream)
                    if n_pan == 2 and flags >= 0:
                        if real is float:
                            half = (mr + 1) // 2
                            fc_shared_runs_pair_kernel_f32(
                                half, n_runs, block_off, <const float* const*>(pixels + i0),
                                run_len, bblk + jr * blk.kc, bblk + (jr + NR) * blk.kc, yt, rsy,
                                flags, tile_bias, tile_act)
                            if mr > half:
                                fc_shared_runs_pair_kernel_f32(
                                    mr - half, n_runs, block_off,
                                    <const float* const*>(pixels + i0 + half), run_len,
                                    bblk + jr * blk.kc, bblk + (jr + NR) * blk.kc,
                                    yt + half * rsy, rsy, flags, tile_bias, tile_act)
                        jp += 2
                        continue
                    if flags >= 0:
                        out, rso, out_bias, out_act = yt, rsy, tile_bias, tile_act
                    else:
                        out, rso, flags, out_bias, out_act = acc, NR, 0, NULL, ACT_NONE
                    part = (mr + 1) // 2 if halve_tiles else mr
                    h0 = 0
                    while h0 < mr:
                        if real is float:
                            fc_shared_runs_kernel_f32(min(part, mr - h0), n_runs, block_off,
                                                      <const float* const*>(pixels + i0 + h0),
                                                      run_len, bblk + jr * blk.kc,
                                                      out + h0 * rso, rso, flags, out_bias,
                                                      out_act)
                        else:
                            fc_shared_runs_kernel_f64(min(part, mr - h0), n_runs, block_off,
                                                      <const double* const*>(pixels + i0 + h0),
                                                      run_len, bblk + jr * blk.kc,
                                                      out + h0 * rso, rso, flags, out_bias,
                                                      out_act)
                        h0 += part
                    if split:
                        for i in range(mr):
                            write_tile(acc + i * NR, NR,
                                       output_pixel(g, y, ys, m0 + i0 + i) + jc + jr, rsy, 1,
                                       1, min(NR, nc - jr), 1, beta, kb == 0, tile_bias,
                                       tile_act, stream)
                    elif out == acc:
                        write_tile(acc, NR, yt, rsy, 1, mr, min(NR, nc - jr), 1, beta,
                                   kb == 0, tile_bias, tile_act, stream)
                    jp += 1
    if stream:
        fc_store_fence()


cdef int conv_forward_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                            const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                            const real* bias, int act, real* y, Py_ssize_t rsy,
                            const real* prepacked, int max_threads,
                            bint accumulate=False,
                            const ImageStrides* ys=NULL,
                            const Py_ssize_t* tap_src=NULL) noexcept nogil:
    # y[m, oc] = act(sum_k patches[m, k] * w[oc, k] (+ bias[oc]) (+ y[m, oc]
    # when accumulate: a residual the caller stored there)); w is OHWI
    # flattened (OC x K, row stride rsw), y row m has stride rsy (or, given
    # ys, y is an NHWC view with those strides, rsy = ys.w; with tap_src, w
    # holds taps gathered from another layer's weight, see
    # pack_block_panel).  prepacked,
    # when not NULL, is w as pack_conv_weights laid it out.  Implicit
    # GEMM with a pointer per pixel: pixels whose taps are all inside the
    # image are multiplied straight from it, the border pixels from their
    # shadow windows (ShadowLayout), built a chunk at a time; tiles mix
    # both (multiply_pixel_rows).
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t KC = conv_kc(<real>0)
    cdef Py_ssize_t M = g.N * g.OH * g.OW, K = patch_cols(g), T = g.KH * g.KW
    cdef int nt = threads_for(2.0 * M * OC * K, max_threads)
    cdef KBlock* blocks = <KBlock*>malloc(T * cdiv(g.C, KC) * sizeof(KBlock))
    cdef Py_ssize_t* tap_off = <Py_ssize_t*>malloc((T + g.KH) * sizeof(Py_ssize_t))
    if blocks == NULL or tap_off == NULL:
        free(blocks)
        free(tap_off)
        return -1
    cdef Py_ssize_t n_kb = conv_k_blocks(<real>0, g, blocks)
    cdef Py_ssize_t nc_blk = conv_nc_blk(<real>0, K, OC, max_block_depth(blocks, n_kb))
    cdef Py_ssize_t kh, kw
    cdef Py_ssize_t R = chunk_rows(<real>0, K, M, MR)
    cdef Py_ssize_t ld = patch_ld(<real>0, K)
    # Threads split the pixels (in chunks), or, when their micro-panels are
    # too few to share evenly (batch 1 at 7x7), the output channels too;
    # then threads plan the same chunk, a small price next to its
    # multiplication.
    cdef Py_ssize_t m_panels = cdiv(M, MR), n_chunks = cdiv(M, R), n_ic, n_js
    cdef Py_ssize_t item = sizeof(real)
    # Weights that outgrow an L2 (1 MiB) once packed.
    cdef bint weights_past_l2 = K * OC * item > 2 * chunk_bytes
    best_split(m_panels, cdiv(nc_blk, NR), nt, &n_ic, &n_js)
    # Per-call weights past an L2 and at least as large as the patches (OC
    # >= M: batch 8 at 7x7) are split by columns whenever they split evenly:
    # each thread then packs and reads only its share of them, a block at a
    # time into its own L2 (pack_own below), and reads all the patches, the
    # smaller operand.  Split by pixels, the weights were packed whole to
    # memory and each thread read all of them back.  Zen 3, 2 threads, in
    # one process alternating, best / median ms pixels -> columns: 1x1
    # 2048->512 @7 b8 6.10 / 7.20 -> 5.43 / 7.10 and 7.02 / 8.12 -> 6.46 /
    # 7.30; 512->2048 @7 b8 medians 7.64 -> 6.56, 7.95 -> 6.77; 1x1/2
    # 1024->2048 @14 b8 15.7 -> 13.9, 16.1 -> 14.0; 3x3 512->512 @7 b8
    # 13.2 -> 12.7, 15.3 -> 12.4 (best); 3x3/2 256->512 @14 b8 6.42 ->
    # 6.08, 6.35 -> 6.02.  At b16 (patches 1.6x the weights) a tie.
    if (prepacked == NULL and weights_past_l2 and OC >= M and nt > 1
            and cdiv(nc_blk, NR) % nt == 0):
        n_ic = 1
        n_js = nt
    # Chunks of equal size (within one micro-panel), as many as a multiple
    # of the pixel shares: 784 pixels as 512 + 272 left one thread idle a
    # third of the call, and as 3 x 204 + 172 (chunks rounded up to whole
    # panels) one thread waited ~10 % of it (3x3/2 64->128 @56 b1, perf).
    n_chunks = cdiv(n_chunks, n_ic) * n_ic
    R = cdiv(m_panels, n_chunks) * MR
    # Every pixel reads its taps at the same offsets, in the image or in
    # its shadow window (whose pitch is the image's, unless no pixel is
    # inside the image; see shadow_layout).  Only border pixels take a
    # window, so the windows are sized by the border pixels a chunk can
    # hold, not by its pixels (none at all for an unpadded 1x1 layer).
    cdef ShadowLayout sh = shadow_layout(<real>0, g, xs, M, False)
    cdef bint own_pitch = shadow_size(&sh, M) > 2 * M * ld
    if own_pitch:
        sh = shadow_layout(<real>0, g, xs, M, True)
    cdef bint use_taps = sh.pitch == g.DH * xs.h and sh.tap == g.DW * xs.w
    cdef Py_ssize_t n_border = border_pixels(g, use_taps)
    cdef ShadowLayout sh_all = shadow_layout(<real>0, g, xs, max(1, n_border), own_pitch)
    if n_ic == 1 and n_chunks > 1 and (
            M * ld * item <= 4 * chunk_bytes
            or (weights_past_l2
                and shadow_size(&sh_all, n_border) * item <= 4 * chunk_bytes)):
        # Each chunk streams the thread's share of the packed weights from
        # L3 or memory once: when the threads do not split the pixels (they
        # split the columns, or there is one thread), one chunk of every
        # pixel streams it once in all (512->512 @7: 4.7 MiB a thread), and
        # each task packs its share a block at a time (pack_own).  Where
        # the patch rows fit 2 MiB; or where the weights outgrow an L2 (1
        # MiB) and only the chunk's shadow windows need bounding: the
        # pixels' taps are read where they are either way, once a k-block.
        # 1x1 2048->512 @7 b8 (patches 3.2 MB, no window) ran in seven
        # chunks over weights packed up front; in one, with its pixels read
        # in place (see multiply_pixel_rows' halve_tiles), 3.81 -> 3.72 ms
        # best, 4.22 -> 3.89 median (Zen 4, 2 threads, processes
        # alternating, 6 rounds).  Small weights stay in L2 from chunk to
        # chunk, and chunks keep their pixels there: one chunk made the
        # input gradient of 3x3/2 64->128 @56 b8 (weights 128 KiB a phase)
        # 4.67 -> 4.91 ms median.
        R = m_panels * MR
        n_chunks = 1
    n_ic = n_chunks
    # Weights packed per call: up front, shared by every chunk; or, with
    # one chunk (every task owns a column share of all the pixels, as at
    # batch 1 on 7x7 or 14x14), by each task, a block at a time, into a
    # buffer of its own that the block's multiplications read from L2
    # (packing up front wrote all of them out and read them back: 512->512
    # @7 b1 took ~0.6 ms more than with prepacked weights).
    cdef bint pack_own = prepacked == NULL and n_ic == 1
    # w as B (K x OC): OC rows of w transposed; or, with tap_src, the
    # gathered taps' rows (channels) rsw apart, output channels unit.
    cdef Py_ssize_t rsb = 1 if tap_src == NULL else rsw
    cdef Py_ssize_t csb = rsw if tap_src == NULL else 1
    cdef Py_ssize_t own_size = max_block_depth(blocks, n_kb) * nc_blk
    cdef real* bpack = <real*>prepacked
    cdef real* own_blocks = NULL
    if pack_own:
        own_blocks = <real*>aligned_malloc(nt * own_size * sizeof(real))
    elif prepacked == NULL:
        bpack = pack_b_blocks(blocks, n_kb, OC, w, rsb, csb, nc_blk, nt, tap_src)
    cdef Py_ssize_t n_shadow = max(1, min(R, n_border))
    sh = shadow_layout(<real>0, g, xs, n_shadow, own_pitch)
    for kh in range(g.KH):
        for kw in range(g.KW):
            tap_off[kh * g.KW + kw] = kh * sh.pitch + kw * sh.tap
        tap_off[T + kh] = kh * sh.pitch
    cdef Py_ssize_t buf_size = shadow_size(&sh, n_shadow)
    cdef real* bufs = <real*>aligned_malloc(nt * buf_size * sizeof(real))
    cdef const real** pixels = <const real**>malloc(nt * R * sizeof(real*))
    # A block's run offsets: at most one run per tap.
    cdef Py_ssize_t n_off = max_block_taps(blocks, n_kb)
    cdef Py_ssize_t* block_offs = <Py_ssize_t*>malloc(nt * n_off * sizeof(Py_ssize_t))
    if ((bpack == NULL and own_blocks == NULL) or bufs == NULL or pixels == NULL
            or block_offs == NULL):
        if prepacked == NULL:
            aligned_free(bpack)
            aligned_free(own_blocks)
        aligned_free(bufs)
        free(pixels)
        free(block_offs)
        free(blocks)
        free(tap_off)
        return -1
    cdef bint stream = can_stream(M, OC, n_kb, <real>accumulate, rsy, 1)
    # Tasks are ordered by column share, then chunk, so that the static
    # schedule gives each thread whole shares: chunk-major order handed one
    # thread 36 of 49 rows' work at 512->512 @7 batch 1 (3 chunks x 2
    # shares).
    cdef Py_ssize_t task, m0, m1, tid
    for task in prange(n_ic * n_js, num_threads=nt, schedule="static"):
        m0 = min(M, share_start(task % n_ic, m_panels, n_ic) * MR)
        m1 = min(M, share_start(task % n_ic + 1, m_panels, n_ic) * MR)
        tid = threadid()
        plan_pixel_rows(g, x, xs, m0, m1, use_taps, &sh, bufs + tid * buf_size,
                        pixels + tid * R)
        multiply_pixel_rows(g, xs, tap_off, pixels + tid * R, m1 - m0,
                            blocks, n_kb, OC, bpack, nc_blk, task // n_ic, n_js, bias, act,
                            y if ys != NULL else y + m0 * rsy, rsy, stream, w, rsb, csb,
                            own_blocks + tid * own_size if pack_own else NULL,
                            block_offs + tid * n_off, <real>accumulate, m0, ys, tap_src)
    if prepacked == NULL:
        aligned_free(bpack)
        aligned_free(own_blocks)
    aligned_free(bufs)
    free(pixels)
    free(block_offs)
    free(blocks)
    free(tap_off)
    return 0


cdef void grad_weight_chunk(Py_ssize_t rows, Py_ssize_t OC, Py_ssize_t j0, Py_ssize_t j1,
                            const real* dy, Py_ssize_t rsdy,
                            const real* patches, Py_ssize_t ld, bint patches_left,
                            real* bpack, real* acc, Py_ssize_t acc_ld,
                            bint overwrite=False, bint streamed=False) noexcept nogil:
    # One thread's product over rows 0..rows of a chunk, for the patch
    # columns j0..j1, KC rows at a time, added into acc (or, overwrite,
    # stored over it by the first KC rows: acc need not be zeroed); either
    # orientation reads its left operand in place, k-major
    # (fc_kmajor_kernel), and packs the right one, or reads it in place too
    # where its rows are narrow (b_in_place_ok, as gemm_nogil does).  dy's
    # rows so, on the right of the patches: Zen 5, 2 threads, b8,
    # alternating processes, best GFLOPS 3x3/2 64->128 @56
    # 377-397 -> 415-449, 3x3 64->64 @56 388-405 -> 409-436, 512->512 @7
    # 366-383 -> 387-399, 1x1 256->64 @56 +3 %, 128->128 @28 and 256->256
    # @14 within 1-3 %; the patch rows on the right of dy, see
    # conv_grad_weight_nogil.  streamed: the patches are the image itself
    # (patches_are_image), so both operands come from memory, and where
    # the right one is read in place too the kernels prefetch both ahead as
    # they go (macro_kernel_ld's stream_ahead).  Not for patches built into
    # a buffer: dy alone ahead measured alike there, and both ahead lost
    # (3x3 64->64 @56 b8 9.5-9.6 -> 9.9-12.1 ms).
    #   dy on the left:      acc[:, j0:j1] += dy^T @ patches[:, j0:j1]   (acc OC x K)
    #   patches on the left: acc[j0:j1, :] += patches[:, j0:j1]^T @ dy   (acc K x OC)
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t KC = GRAD_W_KC_F32 if real is float else D_KC
    cdef Py_ssize_t pb, pc, kc, next_kc
    cdef real beta
    # The left operand (k-major: mc values a row, rows lda apart), the
    # right one (ncols values a row, rows rsb apart) and the result.
    cdef const real* a = patches + j0 if patches_left else dy
    cdef const real* b = dy if patches_left else patches + j0
    cdef Py_ssize_t lda = ld if patches_left else rsdy
    cdef Py_ssize_t rsb = rsdy if patches_left else ld
    cdef Py_ssize_t mc = j1 - j0 if patches_left else OC
    cdef Py_ssize_t ncols = OC if patches_left else j1 - j0
    cdef real* c = acc + j0 * acc_ld if patches_left else acc + j0
    # The right operand read in place only beside a left one that
    # macro_kernel_ld takes for an A.T view (values of a k contiguous, k
    # lda apart): with one output channel (lda == 1) dy is also a plain row,
    # and the plain kernels read B from packed panels only.
    cdef bint in_place = lda != 1 and b_in_place_ok(ncols, rsb, <real>0)
    for pb in range(cdiv(rows, KC)):
        pc = pb * KC
        kc = min(KC, rows - pc)
        next_kc = min(KC, rows - pc - kc)
        beta = 0 if overwrite and pb == 0 else 1
        if in_place:
            macro_kernel_ld(mc, ncols, kc, 1, 0, cdiv(ncols, NR), a + pc * lda, 1, lda,
                            b + pc * rsb, c, acc_ld, 1, 1, beta, True, NULL, ACT_NONE, False,
                            next_kc, False, rsb, streamed)
        else:
            pack_b_rows(kc, ncols, b + pc * rsb, rsb, bpack)
            macro_kernel(mc, ncols, kc, 0, cdiv(ncols, NR), a + pc * lda, 1, lda, bpack, c,
                         acc_ld, 1, 1, beta, True, NULL, ACT_NONE, next_kc)


cdef inline bint grad_weight_patches_left(Py_ssize_t M, Py_ssize_t K, Py_ssize_t OC,
                                          bint split_chunks) noexcept nogil:
    # Which operand of the weight gradient's GEMM goes on the left (is read
    # in place, tiled MR rows at a time) and which is packed: the patches,
    # where there are at least twice as many patch rows (pixels) as patch
    # columns, and fewer than twice as many output channels.  Then only dy's
    # OC columns are packed, not the K patch columns, and the result's rows
    # are the K patch columns, which MR divides better than a small OC (64 =
    # 5 x 12 + 4 on AVX-512).  Measured in one process alternating (Zen 5,
    # float32, AVX-512, batch 8 unless said, 2 / 1 threads, best GFLOPS
    # dy-left -> patches-left): 3x3 64->64 @56 351 -> 402 / 170 -> 193,
    # batch 1 275 -> 348 / 187 -> 204, 3x3/2 64->128 @56 326 -> 367, 3x3
    # 128->128 @28 357 -> 410 / 196 -> 218, 128->64 @28 297 -> 373, 192->192
    # @28 373 -> 424, 16->64 @112 270 -> 305, 7x7/2 3->64 @224 184 -> 252 /
    # 115 -> 127, 1x1 256->64 @56 272 -> 428 / 170 -> 179, 512->128 @28 353
    # -> 431; also float64 (3x3 64->64 @56 158 -> 185) and AVX2 (141 ->
    # 202).  With fewer pixels the patches-left product lost: 3x3 512->512
    # @7 359 -> 238, batch 1 190 -> 55, 256->256 @14 batch 1 326 -> 184, 1x1
    # 2048->512 @7 356 -> 239 (one tile's k-major reads of patch rows that
    # far apart, from a chunk past L2, stall); near the edge the two tied
    # within a few % (3x3 256->256 @14, 1x1 128->512 @28).  With twice as
    # many output channels as patch columns it lost too: 1x1/2 256->512 @56
    # 416 -> 400, batch 1 416 -> 338, 64->128 320 -> 272, 512->1024 @28 432
    # -> 376 (VGG's 3x3 3->64, 27 patch columns, won 105 -> 123 but stays
    # with dy on the left there).  The AVX2 build (6-row tiles, where 64
    # patch columns are 11 tiles, AVX-512's 5 1/3 of 12: perhaps why) keeps
    # the patches on the left up to four times as many output channels as
    # patch columns where the threads split chunks of pixels: Zen 3, 2
    # threads, one process alternating, best ms dy-left -> patches-left,
    # 1x1 64->256 @56 b8 10.6-11.4 -> 8.6-9.3 (medians 13.4-17.3 ->
    # 10.3-10.5; float64 25.7-34.9 -> 16.8-19.4, and at b1, whose float64
    # chunks are split, 3.2-4.9 -> 2.2-2.4), 64->128 @56 b8 5.3-5.6 ->
    # 3.8-4.3, 128->512 @28 b8 9.2-11.2 -> 7.6-8.2, 512->1024 @28 b8 48-50
    # -> 45-47, VGG 3x3 3->64 @224 b1 3.8-4.3 -> 2.7-3.8; 1x1/2 256->512
    # @56 b8 and 256->1024 @14 b8 within 3 %.  Not with the columns split
    # (1x1 64->256 @56 b1: 0.98 -> 1.12).
    if VBYTES == 32 and split_chunks:
        return M >= 2 * K and OC <= 4 * K
    return M >= 2 * K and OC < 2 * K


cdef inline bint patches_are_image(const ConvGeom* g, ImageStrides xs) noexcept nogil:
    # A 1x1, stride-1, unpadded convolution of an image whose pixels are
    # evenly spaced: patch row m is pixel m, read in place.
    return (g.KH == 1 and g.KW == 1 and g.SH == 1 and g.SW == 1 and g.PT == 0 and g.PL == 0
            and g.OH == g.H and g.OW == g.W and xs.h == g.W * xs.w and xs.n == g.H * xs.h)


cdef inline const real* chunk_patches(const ConvGeom* g, const real* x, ImageStrides xs,
                                      Py_ssize_t m0, Py_ssize_t m1, bint in_place,
                                      real* buf, Py_ssize_t ld) noexcept nogil:
    # Patch rows m0..m1: the image itself (patches_are_image; rows xs.w
    # apart), or built into buf (rows ld apart).
    if in_place:
        return x + m0 * xs.w
    im2col_rows(g, x, xs, m0, m1, buf, ld)
    return buf


cdef inline void few_outputs_run(Py_ssize_t rows, Py_ssize_t OC, Py_ssize_t ncols,
                                 const real* dy, Py_ssize_t rsdy, const real* p,
                                 Py_ssize_t ldp, real* acc, Py_ssize_t ldacc) noexcept nogil:
    # acc[oc, 0:ncols] += sum over rows of dy[m, oc] * p[m, 0:ncols].
    if rows <= 0:
        return
    if real is float:
        fc_few_outputs_grad_weight_f32(rows, OC, ncols, dy, rsdy, p, ldp, acc, ldacc, 0)
    else:
        fc_few_outputs_grad_weight_f64(rows, OC, ncols, dy, rsdy, p, ldp, acc, ldacc, 0)


cdef inline bint few_outputs_window(const ConvGeom* g, ImageStrides xs) noexcept nogil:
    # Whether a kernel row's taps are adjacent pixels: KW*C values in a row.
    return g.DW == 1 and xs.w == g.C


cdef inline bint few_outputs_applies(const ConvGeom* g, ImageStrides xs, Py_ssize_t OC,
                                     real dtype_tag) noexcept nogil:
    # grad_weight_few_outputs for products (a kernel row's window, or a
    # tap's C channels) at least a vector wide: a 3x3 3->8 layer, 9-value
    # windows, ran 0.55 -> 0.87 ms that way (its columns one at a time).
    # Each call adds its tiles into the accumulator once per output row, so
    # more output channels need wider rows to pay.  Zen 4, 2 threads,
    # float32 3x3 unless said, alternating processes, best ms GEMM -> here:
    # 64->24 @56 b8 5.56 -> 3.37, 64->32 5.34 -> 4.44, 64->48 9.74 ->
    # 6.77, 64->64 9.46 -> 8.87 but b1 1.21 -> 1.37; 256->48 @28 b1 1.07 ->
    # 1.13, 512->40 @14 b2 0.98 -> 1.11, 512->32 @7 b1 0.14 -> 0.35; with
    # at most 16: 512->16 @7 b1 0.084 -> 0.106, 256->16 @14 b1 0.14 ->
    # 0.11, 512->8 @7 b8 0.40 -> 0.21.
    cdef Py_ssize_t width = g.C * (g.KW if few_outputs_window(g, xs) else 1)
    if width * <Py_ssize_t>sizeof(real) < VBYTES:
        return False
    return OC <= FEW_OUTPUTS_MAX_OC or (OC <= FEW_OUTPUTS_WIDE_MAX_OC
                                        and g.OW >= FEW_OUTPUTS_WIDE_MIN_OW)


cdef void few_outputs_output_row(const ConvGeom* g, const real* x, ImageStrides xs,
                                 const real* dy, Py_ssize_t rsdy, Py_ssize_t OC,
                                 Py_ssize_t n, Py_ssize_t oh, real* acc) noexcept nogil:
    # Output row (n, oh)'s share of acc (OC x K, rows K apart), kernel row
    # by kernel row over the image: its pixels whose taps of that kernel row
    # all lie in the image at once (ow0..ow1) as one product, whose patch
    # rows are windows of the image row (KW*C values where the taps are
    # adjacent pixels, ldp one output pixel's step apart), or per tap;
    # the pixels at the borders tap by tap.
    cdef Py_ssize_t K = patch_cols(g), C = g.C
    cdef Py_ssize_t kh, kw, ih, iw, ow, b
    cdef const real* dyr = dy + (n * g.OH + oh) * g.OW * rsdy
    cdef const real* xr
    cdef bint window = few_outputs_window(g, xs)
    cdef Py_ssize_t ow0 = min(g.OW, cdiv(g.PL, g.SW))
    cdef Py_ssize_t ow1 = max(ow0, min(g.OW, floor_div(g.W - 1 + g.PL - (g.KW - 1) * g.DW,
                                                      g.SW) + 1))
    for kh in range(g.KH):
        ih = oh * g.SH - g.PT + kh * g.DH
        if ih < 0 or ih >= g.H:
            continue
        xr = x + n * xs.n + ih * xs.h
        if window:
            few_outputs_run(ow1 - ow0, OC, g.KW * C, dyr + ow0 * rsdy, rsdy,
                            xr + (ow0 * g.SW - g.PL) * xs.w, g.SW * xs.w, acc + kh * g.KW * C, K)
        else:
            for kw in range(g.KW):
                few_outputs_run(ow1 - ow0, OC, C, dyr + ow0 * rsdy, rsdy,
                                xr + (ow0 * g.SW - g.PL + kw * g.DW) * xs.w, g.SW * xs.w,
                                acc + (kh * g.KW + kw) * C, K)
        for b in range(ow0 + g.OW - ow1):
            ow = b if b < ow0 else ow1 + b - ow0
            for kw in range(g.KW):
                iw = ow * g.SW - g.PL + kw * g.DW
                if 0 <= iw < g.W:
                    few_outputs_run(1, OC, C, dyr + ow * rsdy, rsdy, xr + iw * xs.w, xs.w,
                                    acc + (kh * g.KW + kw) * C, K)


cdef void sum_accumulators(const real* accs, Py_ssize_t n_acc, Py_ssize_t OC, Py_ssize_t K,
                           real* dw, Py_ssize_t rsdw, int nt) noexcept nogil:
    # dw (OC x K, rows rsdw apart) = the n_acc OC x K accumulators at accs
    # summed, in their order (so the result depends on the thread count
    # only, not on the schedule).
    cdef Py_ssize_t oc, i, t
    cdef const real* acc
    for oc in prange(OC, num_threads=nt, schedule="static"):
        for i in range(K):
            dw[oc * rsdw + i] = accs[oc * K + i]
        for t in range(1, n_acc):
            acc = accs + t * OC * K + oc * K
            for i in range(K):
                dw[oc * rsdw + i] += acc[i]


cdef int grad_weight_few_outputs(const ConvGeom* g, const real* x, ImageStrides xs,
                                 const real* dy, Py_ssize_t rsdy, Py_ssize_t OC,
                                 real* dw, Py_ssize_t rsdw, int max_threads) noexcept nogil:
    # conv_grad_weight_nogil for layers with few output channels
    # (few_outputs_applies): few_outputs_kernel.h's tiles, reading the image
    # where it lies (no patch rows: built for 3 output channels, they took
    # 55 % of the time).
    # Threads split the output rows, each into an OC x K accumulator of its
    # own, summed at the end in thread order.
    cdef Py_ssize_t K = patch_cols(g), rows = g.N * g.OH
    cdef int nt = threads_for(2.0 * rows * g.OW * OC * K, max_threads)
    nt = <int>max(1, min(nt, rows))
    cdef real* accs = <real*>aligned_malloc(nt * OC * K * sizeof(real))
    if accs == NULL:
        return -1
    memset(accs, 0, nt * OC * K * sizeof(real))
    cdef Py_ssize_t t, r
    for t in prange(nt, num_threads=nt, schedule="static"):
        for r in range(share_start(t, rows, nt), share_start(t + 1, rows, nt)):
            few_outputs_output_row(g, x, xs, dy, rsdy, OC, r // g.OH, r % g.OH,
                                   accs + t * OC * K)
    sum_accumulators(accs, nt, OC, K, dw, rsdw, nt)
    aligned_free(accs)
    return 0


cdef int conv_grad_weight_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                                const real* dy, Py_ssize_t rsdy, Py_ssize_t OC,
                                real* dw, Py_ssize_t rsdw,
                                int max_threads) noexcept nogil:
    # dw[oc, k] = sum_m dy[m, oc] * patches[m, k], chunk by chunk of patch
    # rows.  Threads split the chunks, each into its own OC x K accumulator
    # (K x OC with the patches on the left, grad_weight_patches_left),
    # summed at the end; when chunks are too few to share (small images,
    # batch 1), threads split the columns of dw instead and each walks every
    # chunk.  A 1x1 layer's patch rows are the image's pixels, read (or
    # packed) straight from it (patches_are_image).
    if few_outputs_applies(g, xs, OC, <real>0):
        return grad_weight_few_outputs(g, x, xs, dy, rsdy, OC, dw, rsdw, max_threads)
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t KC = GRAD_W_KC_F32 if real is float else D_KC
    cdef Py_ssize_t M = g.N * g.OH * g.OW, K = patch_cols(g)
    cdef int nt = threads_for(2.0 * M * OC * K, max_threads)
    cdef bint in_place = patches_are_image(g, xs)
    # Chunks of about chunk_bytes of patch rows, or, read in place, of dy's
    # rows where those are wider (a 1x1 32->256 layer's 128-byte pixels
    # made chunks of 4096 pixels, too few to split at batch 8).
    cdef Py_ssize_t R = chunk_rows(<real>0, max(K, OC) if in_place else K, M, GRAD_W_MIN_ROWS)
    cdef Py_ssize_t ld = patch_ld(<real>0, K)
    cdef Py_ssize_t n_chunks = cdiv(M, R)
    cdef bint split_chunks = n_chunks >= 4 * nt
    if split_chunks and n_chunks % nt:
        # Equal chunks, a multiple of the threads (5 chunks on 2 threads
        # is a 3:2 split).
        R = cdiv(M, cdiv(n_chunks, nt) * nt)
        n_chunks = cdiv(M, R)
    cdef bint left = grad_weight_patches_left(M, K, OC, split_chunks)
    if in_place and not left and OC > K and not (split_chunks
                                                 and b_in_place_ok(K, xs.w, <real>0)):
        # A 1x1 layer with more output channels than input channels: one
        # GEMM, dy^T @ image, which splits the output channels between the
        # threads, unless chunks of pixels are enough to share and the
        # image's rows, read in place, are narrow enough (b_in_place_ok):
        # then each thread streams whole rows of dy and of the image from
        # its own chunks into an accumulator of its own.  Zen 5, 2 threads,
        # one process alternating, best/median GFLOPS GEMM vs chunks:
        # 64->256 @56 b8 393/348 vs 480/392, b32 298/294 vs 392/388,
        # 64->128 b8 349/334 vs 484/464; b1 475/464 vs 411/404 (6 chunks
        # of 512 pixels, not split).  Wider images, whose rows the chunks
        # pack, lost to the GEMM (before rows were read in place: 128->512
        # @28 b8 424 vs 357, 512->2048 @7 b1 355 vs 286).
        return gemm_nogil(OC, K, M, 1, dy, 1, rsdy, x, xs.w, 1, 0, dw, rsdw, 1, NULL,
                          ACT_NONE, max_threads)
    # acc: OC x K, or K x OC with the patches on the left.  With the
    # threads splitting dw's columns and dy on the left, dw itself, the
    # first chunk stored over it: a separate accumulator (malloc'd per
    # call) cost a memset and a copy, two more passes over an OC x K that a
    # small image's shallow product leaves memory-bound, and its time
    # swung 2.5x from process to process.  Zen 4, 2 threads, the weight
    # gradient alone, processes alternating, best ms, accumulator -> dw:
    # b1 3x3 512->512 @7 1.85-4.67 -> 1.34, 1x1 2048->512 @7 0.81 -> 0.61,
    # 3x3/2 256->512 @14 0.84-2.21 -> 0.69, 1x1/2 1024->2048 @14 1.72-4.65
    # -> 1.33; b8 512->512 @7 10.1-13.0 -> 9.5-9.9, 2048->512 4.1-5.9 ->
    # 4.4; but 1x1/2 1024->2048 @14 b8 8.7-8.8 -> 9.1-9.4 (dw's pages first
    # touched inside the product).
    cdef bint into_dw = not split_chunks and not left
    cdef Py_ssize_t acc_ld = rsdw if into_dw else (OC if left else K)
    cdef Py_ssize_t bpack_size = min(KC, R) * cdiv(OC if left else K, NR) * NR
    cdef Py_ssize_t n_acc = 0 if into_dw else (nt if split_chunks else 1)
    cdef real* bufs = <real*>aligned_malloc(nt * R * ld * sizeof(real))
    cdef real* bpacks = <real*>aligned_malloc(nt * bpack_size * sizeof(real))
    cdef real* own_accs = NULL if into_dw else <real*>aligned_malloc(
        n_acc * OC * K * sizeof(real))
    cdef real* accs = dw if into_dw else own_accs
    if bufs == NULL or bpacks == NULL or accs == NULL:
        aligned_free(bufs)
        aligned_free(bpacks)
        aligned_free(own_accs)
        return -1
    if own_accs != NULL:
        memset(own_accs, 0, n_acc * OC * K * sizeof(real))
    cdef Py_ssize_t t, chunk, m0, m1, tid, j0, j1, i, oc, step
    cdef real* acc
    cdef const real* patches
    cdef Py_ssize_t ldp = xs.w if in_place else ld
    if split_chunks:
        # Static: each thread always sums the same chunks in the same order,
        # so the result does not change from run to run.
        for chunk in prange(n_chunks, num_threads=nt, schedule="static"):
            tid = threadid()
            m0 = chunk * R
            m1 = min(M, m0 + R)
            patches = chunk_patches(g, x, xs, m0, m1, in_place, bufs + tid * R * ld, ld)
            grad_weight_chunk(m1 - m0, OC, 0, K, dy + m0 * rsdy, rsdy, patches, ldp, left,
                              bpacks + tid * bpack_size, accs + tid * OC * K, acc_ld, False,
                              in_place)
    else:
        for t in prange(nt, num_threads=nt, schedule="static"):
            # Whole micro-tiles of the patch columns per thread: MR rows of
            # the result, or NR panels of its columns.
            step = MR if left else NR
            j0 = t * cdiv(K, step) // nt * step
            j1 = min(K, (t + 1) * cdiv(K, step) // nt * step)
            if j1 > j0:
                for chunk in range(n_chunks):
                    m0 = chunk * R
                    m1 = min(M, m0 + R)
                    patches = chunk_patches(g, x, xs, m0, m1, in_place, bufs + t * R * ld, ld)
                    grad_weight_chunk(m1 - m0, OC, j0, j1, dy + m0 * rsdy, rsdy, patches, ldp,
                                      left, bpacks + t * bpack_size, accs, acc_ld,
                                      into_dw and chunk == 0, in_place)
    cdef Py_ssize_t TB = 64 // sizeof(real), ib, jb
    if left:
        # The accumulators summed into the first one, in thread order, row
        # by contiguous row; then it is transposed into dw through L1
        # blocks (a strided walk down its columns, one value at a time,
        # took 2.4 % of 3x3/2 64->128 @56 b8).
        if n_acc > 1:
            for i in prange(K, num_threads=nt, schedule="static"):
                for t in range(1, n_acc):
                    acc = accs + t * OC * K + i * OC
                    for oc in range(OC):
                        accs[i * OC + oc] += acc[oc]
        for ib in prange(cdiv(K, TB), num_threads=nt, schedule="static"):
            for jb in range(cdiv(OC, TB)):
                if real is float:
                    fc_transpose_block_f32(ib * TB, min(K, ib * TB + TB), jb * TB,
                                           min(OC, jb * TB + TB), accs, OC, dw, rsdw)
                else:
                    fc_transpose_block_f64(ib * TB, min(K, ib * TB + TB), jb * TB,
                                           min(OC, jb * TB + TB), accs, OC, dw, rsdw)
    elif not into_dw:
        sum_accumulators(accs, n_acc, OC, K, dw, rsdw, nt)
    aligned_free(bufs)
    aligned_free(bpacks)
    aligned_free(own_accs)
    return 0


cdef inline Py_ssize_t floor_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    # b > 0; C division truncates toward zero.
    return a // b if a >= 0 else -((-a + b - 1) // b)


cdef inline Py_ssize_t gcd(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    while b:
        a, b = b, a % b
    return a


cdef struct RowRange:
    Py_ssize_t lo, hi


cdef inline RowRange band_patch_rows(const ConvGeom* g, Py_ssize_t n, Py_ssize_t ih0,
                                     Py_ssize_t ih1) noexcept nogil:
    # The patch rows of image n with a tap in input rows ih0..ih1: output
    # rows oh with oh*SH - PT + kh*DH in [ih0, ih1) for some kh.  (Returned
    # by value: a prange body must assign its private variables itself.)
    cdef Py_ssize_t oh_lo = max(0, -floor_div(-(ih0 + g.PT - (g.KH - 1) * g.DH), g.SH))
    cdef Py_ssize_t oh_hi = min(g.OH, floor_div(ih1 - 1 + g.PT, g.SH) + 1)
    cdef RowRange r
    r.lo = (n * g.OH + oh_lo) * g.OW
    r.hi = (n * g.OH + max(oh_lo, oh_hi)) * g.OW
    return r


cdef inline Py_ssize_t bands_per_image(const ConvGeom* g, int nt) noexcept nogil:
    # Enough input-row bands that N * bands tasks divide evenly among the
    # threads.
    return max(1, min(g.H, nt // gcd(g.N, nt)))


cdef int conv_grad_input_nogil(const ConvGeom* g, const real* dy, Py_ssize_t rsdy,
                               Py_ssize_t OC, const real* w, Py_ssize_t rsw,
                               real* dx, ImageStrides xs, bint overwrite,
                               int max_threads) noexcept nogil:
    # dx += col2im(dy @ w); dx must hold zeros (or what to add to), or, with
    # overwrite (windows_disjoint layers), anything: every pixel is then
    # written once, by its one tap or with zero.  Each
    # task owns a band of input rows of one image and computes, chunk by
    # chunk, the patch rows whose taps reach its band, adding only into it:
    # no two threads ever write the same element.  Bands of one image
    # recompute the (KH-1)*DH/SH patch rows they share.
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t M = g.N * g.OH * g.OW, K = patch_cols(g)
    cdef int nt = threads_for(2.0 * M * OC * K, max_threads)
    cdef Py_ssize_t kc_blk, nc_blk
    block_sizes(<real>0, OC, K, &kc_blk, &nc_blk)
    cdef KBlock* blocks = <KBlock*>malloc(cdiv(OC, kc_blk) * sizeof(KBlock))
    if blocks == NULL:
        return -1
    cdef Py_ssize_t n_kb = uniform_k_blocks(OC, kc_blk, blocks)
    cdef real* bpack = pack_b_blocks(blocks, n_kb, K, w, rsw, 1, nc_blk, nt)
    cdef Py_ssize_t R = chunk_rows(<real>0, K, M, MR)
    cdef Py_ssize_t ld = patch_ld(<real>0, K)
    cdef real* bufs = <real*>aligned_malloc(nt * R * ld * sizeof(real))
    if bpack == NULL or bufs == NULL:
        aligned_free(bpack)
        aligned_free(bufs)
        free(blocks)
        return -1
    cdef Py_ssize_t bands = bands_per_image(g, nt)
    cdef Py_ssize_t task, n, ih0, ih1, m0, m1
    cdef RowRange rows
    cdef real* buf
    for task in prange(g.N * bands, num_threads=nt, schedule="dynamic"):
        n = task // bands
        ih0 = (task % bands) * g.H // bands
        ih1 = (task % bands + 1) * g.H // bands
        rows = band_patch_rows(g, n, ih0, ih1)
        buf = bufs + threadid() * R * ld
        m0 = rows.lo
        while m0 < rows.hi:
            m1 = min(rows.hi, m0 + R)
            multiply_chunk(m1 - m0, blocks, n_kb, K, dy + m0 * rsdy, rsdy, 1, bpack,
                           nc_blk, 0, 1, buf, ld, 0, NULL, True)
            col2im_rows_add(g, buf, ld, m0, m1, ih0, ih1, dx, xs, overwrite)
            m0 = m1
        if overwrite:
            zero_unread_pixels(g, n, ih0, ih1, dx, xs)
    aligned_free(bpack)
    aligned_free(bufs)
    free(blocks)
    return 0


cdef check_pixel_rows(const ConvGeom* g, Py_ssize_t rows, Py_ssize_t cols,
                      Py_ssize_t expected_cols, str name):
    # A matrix with one row per output pixel that does not match the
    # geometry would be read or written out of bounds.
    if rows != g.N * g.OH * g.OW or cols != expected_cols:
        raise ValueError(f"{name} must be ({g.N * g.OH * g.OW}, {expected_cols}) for this "
                         f"convolution; got ({rows}, {cols})")


cdef ConvGeom make_geom(Py_ssize_t N, Py_ssize_t H, Py_ssize_t W, Py_ssize_t C,
                       kernel, stride, dilation, pad_before, out_hw) except *:
    cdef ConvGeom g
    g.N, g.H, g.W, g.C = N, H, W, C
    g.KH, g.KW = kernel
    g.SH, g.SW = stride
    g.DH, g.DW = dilation
    g.PT, g.PL = pad_before
    g.OH, g.OW = out_hw
    return g


cdef inline ImageStrides image_strides(Py_ssize_t sn, Py_ssize_t sh, Py_ssize_t sw,
                                       Py_ssize_t item) noexcept:
    cdef ImageStrides s
    s.n = sn // item
    s.h = sh // item
    s.w = sw // item
    return s


cdef void im2col_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                       real* cols, int max_threads) noexcept nogil:
    # The whole patch matrix (for fastconv.im2col; the convolutions never
    # build it).  Memory-bound: one thread per ~64K elements at most.
    cdef Py_ssize_t M = g.N * g.OH * g.OW, K = patch_cols(g)
    cdef int nt = max(1, min(max_threads, <int>(M * K // COPY_ELEMENTS_PER_THREAD)))
    cdef Py_ssize_t rows = max(1, COPY_ELEMENTS_PER_THREAD // K)
    cdef Py_ssize_t chunk, m0
    for chunk in prange(cdiv(M, rows), num_threads=nt, schedule="static"):
        m0 = chunk * rows
        im2col_rows(g, x, xs, m0, min(M, m0 + rows), cols + m0 * K, K)


cdef void col2im_nogil(const ConvGeom* g, const real* cols, real* dx, ImageStrides xs,
                       int max_threads) noexcept nogil:
    # dx += the adjoint of im2col_nogil; tasks own bands of input rows.
    cdef Py_ssize_t M = g.N * g.OH * g.OW, K = patch_cols(g)
    cdef int nt = max(1, min(max_threads, <int>(M * K // COPY_ELEMENTS_PER_THREAD)))
    cdef Py_ssize_t bands = bands_per_image(g, nt)
    cdef Py_ssize_t task, n, ih0, ih1
    cdef RowRange rows
    for task in prange(g.N * bands, num_threads=nt, schedule="dynamic"):
        n = task // bands
        ih0 = (task % bands) * g.H // bands
        ih1 = (task % bands + 1) * g.H // bands
        rows = band_patch_rows(g, n, ih0, ih1)
        col2im_rows_add(g, cols + rows.lo * K, K, rows.lo, rows.hi, ih0, ih1, dx, xs, False)


# The Python entry points.  The facade (fastconv/conv.py) guarantees
# non-empty operands, channels contiguous in images, unit column stride of
# the 2-D operands, and (for grad_input) a zeroed dx; the layout checks are
# repeated here because a violation would read the wrong elements silently.

cdef check_unit_stride(Py_ssize_t extent, Py_ssize_t stride, Py_ssize_t item, str what):
    if extent > 1 and stride != item:
        raise ValueError(f"{what} must have unit stride along its last axis")


cdef Py_ssize_t conv_weight_layout(real dtype_tag, Py_ssize_t KH, Py_ssize_t KW, Py_ssize_t C,
                                   Py_ssize_t OC, KBlock** blocks, Py_ssize_t* nc_blk) except -1:
    # The k-blocks (malloc'ed into *blocks, the caller frees) and block
    # width of the forward's packed weights; returns the number of k-blocks.
    cdef Py_ssize_t KC = conv_kc(<real>0)
    cdef ConvGeom g
    g.KH, g.KW, g.C = KH, KW, C
    blocks[0] = <KBlock*>malloc(KH * KW * cdiv(C, KC) * sizeof(KBlock))
    if blocks[0] == NULL:
        raise MemoryError()
    cdef Py_ssize_t n_kb = conv_k_blocks(<real>0, &g, blocks[0])
    nc_blk[0] = conv_nc_blk(<real>0, KH * KW * C, OC, max_block_depth(blocks[0], n_kb))
    return n_kb


class PackedWeights:
    """Weights packed by pack_conv_weights ("implicit") or
    pack_winograd_weights ("winograd"): the packed values and what they
    were packed from, so that a convolution can refuse a mismatch."""
    __slots__ = ("data", "isa", "shape", "kernel", "algorithm")

    def __init__(self, data, isa, shape, kernel, algorithm):
        self.data, self.isa, self.shape, self.kernel = data, isa, shape, kernel
        self.algorithm = algorithm


cdef const real* checked_packed(packed, real dtype_tag, str algorithm, shape,
                                kernel) except? NULL:
    # packed.data's address, after checking it was packed for this call;
    # NULL when packed is None.
    if packed is None:
        return NULL
    if (packed.isa != ISA or packed.algorithm != algorithm or packed.shape != shape
            or packed.kernel != kernel):
        raise ValueError(f"packed weights are {packed.algorithm} {packed.shape} {packed.kernel} "
                         f"for {packed.isa}; this call is {algorithm} {shape} {kernel} for {ISA}")
    cdef const real[::1] data = packed.data      # (a dtype mismatch raises here)
    return &data[0]


def pack_conv_weights(const real[:, ::1] w, kernel, int num_threads):
    """w (OC, KH*KW*C) packed as conv2d_forward's B operand for this ISA
    build, to pass back as conv2d_forward(..., packed=)."""
    cdef Py_ssize_t KH = kernel[0], KW = kernel[1]
    cdef Py_ssize_t OC = w.shape[0], C = w.shape[1] // (KH * KW)
    if C * KH * KW != w.shape[1] or C == 0 or OC == 0:
        raise ValueError(f"w must be (OC, {KH}*{KW}*C) with OC, C >= 1; got {tuple(w.shape)[:2]}")
    cdef KBlock* blocks = NULL
    cdef Py_ssize_t nc_blk
    cdef Py_ssize_t n_kb = conv_weight_layout(<real>0, KH, KW, C, OC, &blocks, &nc_blk)
    packed = np.empty(packed_b_size(blocks, n_kb, OC, nc_blk),
                      np.float32 if real is float else np.float64)
    cdef real[::1] dst = packed
    with nogil:
        pack_b_blocks_into(blocks, n_kb, OC, &w[0, 0], 1, w.strides[0] // sizeof(real),
                           nc_blk, num_threads, &dst[0])
    free(blocks)
    return PackedWeights(packed, ISA, (OC, KH * KW * C), (KH, KW), "implicit")


def conv2d_forward(const real[:, :, :, :] x, const real[:, :] w, bias, real[:, :] y,
                   kernel, stride, dilation, pad_before, out_hw, int num_threads,
                   int activation=ACT_NONE, packed=None, bint accumulate=False):
    """y = act(patches(x) @ w.T (+ bias) (+ y when accumulate: a residual
    the caller stored there)): x NHWC, w (OC, KH*KW*C),
    y (N*OH*OW, OC), bias None or a contiguous (OC,) array, activation
    ACT_NONE, ACT_RELU or ACT_RELU6, packed None or pack_conv_weights(w)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(y.shape[1], y.strides[1], sizeof(real), "y")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, y.shape[0], y.shape[1], w.shape[0], "y")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef const real[::1] bias_view
    cdef const real* bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        bias_ptr = &bias_view[0]
    cdef const real* packed_ptr = checked_packed(packed, <real>0, "implicit",
                                                 (w.shape[0], w.shape[1]), (g.KH, g.KW))
    cdef int status
    with nogil:
        status = conv_forward_nogil(&g, &x[0, 0, 0, 0], xs, &w[0, 0], w.strides[0] // item,
                                    w.shape[0], bias_ptr, activation, &y[0, 0],
                                    y.strides[0] // item, packed_ptr, num_threads, accumulate)
    if status != 0:
        raise MemoryError("conv2d: could not allocate the packed weights and chunk buffers")


def conv2d_forward_view(const real[:, :, :, :] x, const real[:, :] w, real[:, :, :, :] y,
                        kernel, dilation, pad_before, taps, int num_threads):
    """y[...] = the stride-1 convolution of x (NHWC) into y, an NHWC view
    (N, OH, OW, OC) with any pixel strides and contiguous channels (such as
    dx[:, p::2, q::2]), whose KH*KW taps are taps of w: tap t, input
    channel c, output channel o weighs w[c, taps[t]*OC + o].  w (C, T*OC)
    is thus a layer's weight matrix (OC', T*C') read as its transposed
    convolution's, C = OC', OC = C', with no copy: one phase of a strided
    layer's input gradient (see conv._phase_data_grad)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(y.shape[3], y.strides[3], sizeof(real), "y")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, (1, 1), dilation, pad_before, (y.shape[1], y.shape[2]))
    cdef Py_ssize_t OC = y.shape[3], T = g.KH * g.KW, t
    if (y.shape[0] != g.N or w.shape[0] != g.C or OC == 0 or w.shape[1] % OC
            or len(taps) != T or any(not 0 <= tap < w.shape[1] // OC for tap in taps)):
        raise ValueError(f"y must be ({g.N}, OH, OW, OC) and w ({g.C}, T*OC) with "
                         f"{T} taps below T; got y {tuple(y.shape)[:4]}, "
                         f"w {tuple(w.shape)[:2]}, taps {list(taps)}")
    if 0 in (g.N, g.OH, g.OW):
        return
    if 0 in (g.H, g.W, g.C):        # nothing to read: every tap is padding
        y[...] = 0
        return
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef ImageStrides ys = image_strides(y.strides[0], y.strides[1], y.strides[2], item)
    cdef Py_ssize_t* tap_src = <Py_ssize_t*>malloc(T * sizeof(Py_ssize_t))
    if tap_src == NULL:
        raise MemoryError("conv2d: could not allocate the tap table")
    for t in range(T):
        tap_src[t] = taps[t] * OC
    cdef int status
    with nogil:
        status = conv_forward_nogil(&g, &x[0, 0, 0, 0], xs, &w[0, 0], w.strides[0] // item,
                                    OC, NULL, ACT_NONE, &y[0, 0, 0, 0], ys.w, NULL,
                                    num_threads, False, &ys, tap_src)
    free(tap_src)
    if status != 0:
        raise MemoryError("conv2d: could not allocate the packed weights and chunk buffers")


def conv2d_grad_weight(const real[:, :, :, :] x, const real[:, :] dy, real[:, :] dw,
                       kernel, stride, dilation, pad_before, out_hw, int num_threads):
    """dw = dy.T @ patches(x): dy (N*OH*OW, OC), dw (OC, KH*KW*C), overwritten."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(dy.shape[1], dy.strides[1], sizeof(real), "dy")
    check_unit_stride(dw.shape[1], dw.strides[1], sizeof(real), "dw")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, dy.shape[0], dy.shape[1], dw.shape[0], "dy")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef int status
    with nogil:
        status = conv_grad_weight_nogil(&g, &x[0, 0, 0, 0], xs, &dy[0, 0], dy.strides[0] // item,
                                        dy.shape[1], &dw[0, 0], dw.strides[0] // item,
                                        num_threads)
    if status != 0:
        raise MemoryError("conv2d_backward: could not allocate the weight-gradient workspace")


def conv2d_grad_input(const real[:, :] dy, const real[:, :] w, real[:, :, :, :] dx,
                      kernel, stride, dilation, pad_before, out_hw, int num_threads,
                      bint overwrite=False):
    """dx += col2im(dy @ w): dy (N*OH*OW, OC), w (OC, KH*KW*C), dx NHWC.
    overwrite: dx = col2im(dy @ w), whatever dx held (only for layers whose
    windows do not overlap: stride >= the dilated kernel extent)."""
    check_unit_stride(dy.shape[1], dy.strides[1], sizeof(real), "dy")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(dx.shape[3], dx.strides[3], sizeof(real), "dx")
    cdef ConvGeom g = make_geom(dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3],
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, dy.shape[0], dy.shape[1], w.shape[0], "dy")
    if overwrite and not windows_disjoint(&g):
        raise ValueError("conv2d_grad_input: overwrite needs windows that do not overlap "
                         f"(stride {stride} below the dilated kernel {kernel}, {dilation})")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(dx.strides[0], dx.strides[1], dx.strides[2], item)
    cdef int status
    with nogil:
        status = conv_grad_input_nogil(&g, &dy[0, 0], dy.strides[0] // item, dy.shape[1],
                                       &w[0, 0], w.strides[0] // item, &dx[0, 0, 0, 0], xs,
                                       overwrite, num_threads)
    if status != 0:
        raise MemoryError("conv2d_backward: could not allocate the input-gradient workspace")


def im2col(const real[:, :, :, :] x, real[:, ::1] cols,
           kernel, stride, dilation, pad_before, out_hw, int num_threads):
    """cols[...] = the (N*OH*OW, KH*KW*C) patch matrix of x."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, cols.shape[0], cols.shape[1], g.KH * g.KW * g.C, "cols")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    with nogil:
        im2col_nogil(&g, &x[0, 0, 0, 0], xs, &cols[0, 0], num_threads)


def col2im(const real[:, ::1] cols, real[:, :, :, :] dx,
           kernel, stride, dilation, pad_before, out_hw, int num_threads):
    """dx += the adjoint of im2col applied to cols."""
    check_unit_stride(dx.shape[3], dx.strides[3], sizeof(real), "dx")
    cdef ConvGeom g = make_geom(dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3],
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, cols.shape[0], cols.shape[1], g.KH * g.KW * g.C, "cols")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(dx.strides[0], dx.strides[1], dx.strides[2], item)
    with nogil:
        col2im_nogil(&g, &cols[0, 0], &dx[0, 0, 0, 0], xs, num_threads)
