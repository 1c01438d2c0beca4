# Winograd F(4x4, 3x3) and F(2x2, 3x3) convolution for 3x3, stride-1
# layers, included after gemm_frame.pxi and conv_frame.pxi by the per-ISA
# modules.  F(m x m): (m+2)^2 points (36, or 16 for F(2x2)), below as P.
#
# Per chunk of m x m output tiles (all threads on one chunk at a time):
#   1. input transform: each tile's (m+2)^2 input window -> P rows, one per
#      Winograd point, of V[point][tile][c]                 (threads: tiles)
#   2. P GEMMs M[point] = V[point] (tiles x C) @ U[point] (C x OC) on the
#      micro-kernel, U the transformed filters packed once  (threads: points)
#   3. output transform: P rows of M -> the tile's m x m pixels, + bias and
#      the activation, stored into y                        (threads: tiles)
# A chunk's V and M stay within a few MiB (workspace independent of the
# batch), and it is long enough (WINO_MIN_TILES) that streaming all P
# packed U through the cache once per chunk costs little next to its
# multiplications.  Splitting the GEMM phase by points means each thread
# reads only its own share of U: at batch 1 on a 7x7 or 14x14 image, where
# tiles are few, U is most of the traffic (hence F(2x2) there, for
# prepacked U: 16 x C x OC values instead of 36).
#
# Filters transformed per call for few tiles (winograd_fused_nogil) never
# go to memory: V of every tile first, then each thread transforms one
# panel of output channels' filters a k-block at a time into L2, multiplies
# every tile by it and finishes those channels of the output.
#
# On AVX2, per-call filters of layers with at most 49 tiles and 512 input
# channels or more take winograd_short_nogil instead: the GEMM's short-M
# kernels with the weight's rows, transformed along C, as the broadcast
# operand (no transpose of the weight).
#
# Prepacked filters for few tiles (pack_winograd_few_weights) are the
# few-tile path's column halves, H g', in the order it reads them: 18
# values per filter where U has 36, half of each transform done once.

cdef extern from "winograd_kernel.h":
    # F(4x4, 3x3) (fc_wino_*) and F(2x2, 3x3) (fc_wino2_*), the same contracts.
    void fc_wino_input_f32(const float* img, Py_ssize_t sh, Py_ssize_t sw, int r0, int r1,
        int s0, int s1, Py_ssize_t C, float* v, Py_ssize_t sv) noexcept nogil
    void fc_wino_filter_f32(const float* w, Py_ssize_t ts, float* u, Py_ssize_t su) noexcept nogil
    void fc_wino_filter_nt_f32(const float* w, Py_ssize_t ts, float* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino_filter1_f32(const float* w, Py_ssize_t ts, float* u, Py_ssize_t su) noexcept nogil
    void fc_wino_output_f32(const float* m, Py_ssize_t sm, Py_ssize_t K, const float* bias,
        int act, int add, float* y, Py_ssize_t syh, Py_ssize_t syw, int rows,
        int cols) noexcept nogil
    void fc_wino_input_f64(const double* img, Py_ssize_t sh, Py_ssize_t sw, int r0, int r1,
        int s0, int s1, Py_ssize_t C, double* v, Py_ssize_t sv) noexcept nogil
    void fc_wino_filter_f64(const double* w, Py_ssize_t ts, double* u, Py_ssize_t su) noexcept nogil
    void fc_wino_filter_nt_f64(const double* w, Py_ssize_t ts, double* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino_filter1_f64(const double* w, Py_ssize_t ts, double* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino_output_f64(const double* m, Py_ssize_t sm, Py_ssize_t K, const double* bias,
        int act, int add, double* y, Py_ssize_t syh, Py_ssize_t syw, int rows,
        int cols) noexcept nogil
    void fc_wino2_input_f32(const float* img, Py_ssize_t sh, Py_ssize_t sw, int r0, int r1,
        int s0, int s1, Py_ssize_t C, float* v, Py_ssize_t sv) noexcept nogil
    void fc_wino2_filter_f32(const float* w, Py_ssize_t ts, float* u, Py_ssize_t su) noexcept nogil
    void fc_wino2_filter_nt_f32(const float* w, Py_ssize_t ts, float* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino2_filter1_f32(const float* w, Py_ssize_t ts, float* u, Py_ssize_t su) noexcept nogil
    void fc_wino2_output_f32(const float* m, Py_ssize_t sm, Py_ssize_t K, const float* bias,
        int act, int add, float* y, Py_ssize_t syh, Py_ssize_t syw, int rows,
        int cols) noexcept nogil
    void fc_wino2_input_f64(const double* img, Py_ssize_t sh, Py_ssize_t sw, int r0, int r1,
        int s0, int s1, Py_ssize_t C, double* v, Py_ssize_t sv) noexcept nogil
    void fc_wino2_filter_f64(const double* w, Py_ssize_t ts, double* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino2_filter_nt_f64(const double* w, Py_ssize_t ts, double* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino2_filter1_f64(const double* w, Py_ssize_t ts, double* u,
        Py_ssize_t su) noexcept nogil
    void fc_wino2_output_f64(const double* m, Py_ssize_t sm, Py_ssize_t K, const double* bias,
        int act, int add, double* y, Py_ssize_t syh, Py_ssize_t syw, int rows,
        int cols) noexcept nogil
    void fc_wino_taps_f32(Py_ssize_t n, const float* w, Py_ssize_t ts, Py_ssize_t tc,
        float* wl) noexcept nogil
    void fc_wino_taps_rows_f32(Py_ssize_t n, const float* w, Py_ssize_t rsw, Py_ssize_t C,
        float* wl) noexcept nogil
    void fc_wino_gcols_rows_f32(Py_ssize_t n, const float* w, Py_ssize_t rsw, Py_ssize_t C,
        float* tb, Py_ssize_t ldi) noexcept nogil
    void fc_wino_scale_vt_f32(Py_ssize_t n, int i, float* vt) noexcept nogil
    void fc_wino_scale_vt_f64(Py_ssize_t n, int i, double* vt) noexcept nogil
    void fc_wino_few_f32(int i, int taps, Py_ssize_t n, const float* src, const float* vt,
        float* m, Py_ssize_t sm, Py_ssize_t ldm, int add) noexcept nogil
    void fc_wino_taps_f64(Py_ssize_t n, const double* w, Py_ssize_t ts, Py_ssize_t tc,
        double* wl) noexcept nogil
    void fc_wino_taps_rows_f64(Py_ssize_t n, const double* w, Py_ssize_t rsw, Py_ssize_t C,
        double* wl) noexcept nogil
    void fc_wino_gcols_rows_f64(Py_ssize_t n, const double* w, Py_ssize_t rsw, Py_ssize_t C,
        double* tb, Py_ssize_t ldi) noexcept nogil
    void fc_wino_few_f64(int i, int taps, Py_ssize_t n, const double* src,
        const double* vt, double* m, Py_ssize_t sm, Py_ssize_t ldm, int add) noexcept nogil
    enum:
        WINO_FEW_TILES "FC_WINO_FEW_TILES"

cdef enum:
    # Fewest tiles per chunk: U (points x C x OC) is streamed once per chunk.
    WINO_MIN_TILES = 48
    # Per-thread chunks (see winograd_forward_nogil): V + M of a chunk
    # within half an L2, for filters of at most 4 MiB, which each thread
    # then streams whole per chunk (256x256 channels, 9.4 MiB, measured
    # better with shared chunks).
    WINO_OWN_CHUNK_BYTES = 512 * 1024
    WINO_OWN_MAX_U_BYTES = 4 * 1024 * 1024
    # Most tiles for winograd_few_nogil (see wino_few_max_tiles).
    WINO_FEW_MAX_TILES = 8
    # Layers of fewer than SHORT_M_MIN_K input channels (float32) take the
    # short-M path from this many channels, up to this many tiles (see
    # wino_short_max_tiles).
    WINO_SHORT_MID_C = 256
    WINO_SHORT_MID_MAX_TILES = 16
    # A task's transformed filters in winograd_fused_nogil (P x kc x NR):
    # within an L2 with the V rows and M tiles they multiply.
    WINO_FUSED_PANEL_BYTES = 640 * 1024
    # How far ahead wino_transpose_filters asks for each weight row's lines.
    WINO_TRANSPOSE_PREFETCH_LINES = 16

# Bytes of V and M per chunk: a budget a test can shrink to force many chunks.
cdef Py_ssize_t wino_chunk_bytes = 2 * 1024 * 1024
# Transformed filters larger than this (half the L3 of the machines we
# measure) are written with non-temporal stores: they would leave the caches
# before the GEMMs read them, so a normal store's read for ownership is
# wasted traffic.  A variable so that tests can drive that path.
cdef Py_ssize_t wino_stream_bytes = 16 * 1024 * 1024


# Filters transformed per call are transformed a panel at a time next to
# the GEMMs that use them (winograd_fused_nogil) for layers of at most
# wino_fused_max_tiles tiles whose U has at least wino_fused_min_values
# values.  Measured, 2 threads, GFLOPS best/median, fused vs packed up
# front: 512->512 @7 batch 1 (4 tiles) 249/220 vs 88/79, 256->256 @14 b1
# (16) 415/377 vs 369/160, 128->128 @28 b1 (49) 345/314 vs 249/232,
# 512->512 @7 b8 (32) 387/367 vs 364/340; at 256->256 @14 b8 (128 tiles)
# 451/416 vs 500/456, and with 64 channels (U of 147456 values) the two
# were within the noise.  Variables, so that tests can drive both paths.
cdef Py_ssize_t wino_fused_max_tiles = 64
cdef Py_ssize_t wino_fused_min_values = 256 * 1024


def set_winograd_fused(Py_ssize_t max_tiles, Py_ssize_t min_filter_values):
    """Set when per-call filters take the fused path: layers of at most
    max_tiles tiles (0: never) whose points x C x OC transformed filter
    values number at least min_filter_values (tests only: not thread-safe);
    returns the previous pair."""
    global wino_fused_max_tiles, wino_fused_min_values
    previous = (wino_fused_max_tiles, wino_fused_min_values)
    wino_fused_max_tiles = max(0, max_tiles)
    wino_fused_min_values = max(0, min_filter_values)
    return previous


# Per-call filters for at most wino_few_max_tiles tiles (a 7x7 image at
# batch 1 or 2) take winograd_few_nogil, which never stores U, where the
# fused path applies and vectors have 32 registers (AVX-512: its 24
# accumulators and the six points of a row).  Zen 5, 2 threads, in one
# process alternating, best/median GFLOPS fused -> few: 4 tiles: 512->512
# @7 b1 385/363 -> 458/444, 256->256 @7 386 -> 445 median (another run),
# 512->256 @7 339 -> 403, 256->512 @8 456 -> 573, 128->128 @7 224 -> 255,
# 512->512 @5 195 -> 234, the input gradient of 512 @7 b1 0.70 -> 0.53 ms;
# 8 tiles (two groups of 4, b2): 512->512 @7 577 -> 619, 256->256 541 ->
# 593, 128->128 310 -> 364; but 9 tiles (256->512 @9 b1, 3 groups) 441 ->
# 366, 12 (512 @7 b3) 656 -> 675, 16 (256 @14 b1) 758 -> 753, 32 (512 @7
# b8) 966 -> 843, 49 (128 @28 b1) 1187 -> 945: U stored once serves more
# tiles than a row of points made per group of 4 costs.  A variable, so
# that tests can drive the fused path with few tiles.
cdef Py_ssize_t wino_few_max_tiles = WINO_FEW_MAX_TILES


def set_winograd_few_tiles(Py_ssize_t max_tiles):
    """Set the most tiles for which per-call filters take the few-tile path
    (0: never) (tests only: not thread-safe); returns the previous value."""
    global wino_few_max_tiles
    previous = wino_few_max_tiles
    wino_few_max_tiles = max(0, max_tiles)
    return previous


# Per-call forward filters take winograd_short_nogil for at most
# wino_short_max_tiles tiles (and at most SHORT_M_MAX_ROWS), at least a
# vector of them, and at least SHORT_M_MIN_K input channels, where the
# build has short-M kernels and 16 vector registers (AVX2; AVX-512 has its
# few-tile path).  Zen 3, 2 threads, best ms, the fused path (F(4x4)) ->
# this one: 512->512 @7 b1 1.39-1.50 -> 1.09-1.26 by F(2x2) (16 tiles; 1.72-1.89
# by F(4x4), 4 tiles a half-empty vector), b8 5.7-5.8 -> 5.2-5.3 (F(4x4),
# 32 tiles); but with 256 channels (256->256 @14 b1, F(4x4) 16 tiles:
# 0.79-0.97 -> 1.14; F(2x2) 49 tiles 0.83-1.03 -> 1.09) or 128 (@28 b1
# 0.72-0.75 -> 0.93-0.95) slower: each task streams every point's packed
# V^T (590 KiB at 256 @14) from L3 for half as many products.  (Measured
# before the point stride's extra line, which halved the filter
# transform's share at 256 @14; after it that layer tied, 0.94-1.04 vs
# 1.00-1.05 ms.)  Measured again in session 38, float32 layers of 256 to
# 511 channels won at up to WINO_SHORT_MID_MAX_TILES tiles and take it
# there: in one process alternating (Zen 3, 2 threads, best / median ms,
# fused -> short-M, 8 runs of 10-14 rounds) 256->256 @14 b1 1.04-1.20 /
# 1.17-1.42 -> 0.92-1.28 / 1.03-1.48: best times 6-12 % faster in 6 runs,
# 6-7 % slower in 2, medians faster in 7; 256->256 @7 b1 (F(2x2), 16
# tiles) tied with the fused F(4x4), 0.51-0.52 ms; but b2 (32 tiles)
# 1.62-2.04 -> 1.75-2.13 and b3 (48) 2.39 -> 2.80 lost.
cdef Py_ssize_t wino_short_max_tiles = SHORT_M_MAX_ROWS if VBYTES == 32 else 0


cdef inline bint wino_short_applies(Py_ssize_t tiles, Py_ssize_t C,
                                    real dtype_tag) noexcept nogil:
    if not (VBYTES // <Py_ssize_t>sizeof(real) <= tiles <= wino_short_max_tiles
            and tiles <= short_m_rows(<real>0)):
        return False
    if real is float and C >= WINO_SHORT_MID_C and tiles <= WINO_SHORT_MID_MAX_TILES:
        return True
    return C >= SHORT_M_MIN_K


def winograd_short_applies(Py_ssize_t tiles, Py_ssize_t C, dtype):
    """Whether per-call filters of a forward conv with this many tiles and
    input channels take the short-M path (winograd_short_nogil)."""
    if dtype == "float32":
        return wino_short_applies(tiles, C, <float>0)
    return wino_short_applies(tiles, C, <double>0)


def set_winograd_short_tiles(Py_ssize_t max_tiles):
    """Set the most tiles for which per-call filters take the short-M path
    (tests only: not thread-safe); returns the previous value."""
    global wino_short_max_tiles
    previous = wino_short_max_tiles
    wino_short_max_tiles = max(0, max_tiles)
    return previous


def set_winograd_stream_bytes(Py_ssize_t nbytes):
    """Set the size above which transformed filters are streamed (tests
    only: not thread-safe); returns the previous value."""
    global wino_stream_bytes
    previous = wino_stream_bytes
    wino_stream_bytes = max(0, nbytes)
    return previous


def set_winograd_chunk_bytes(Py_ssize_t nbytes):
    """Set the Winograd V+M chunk budget (tests only: not thread-safe);
    returns the previous value."""
    global wino_chunk_bytes
    previous = wino_chunk_bytes
    wino_chunk_bytes = max(1, nbytes)
    return previous


cdef inline Py_ssize_t wino_points(int tile) noexcept nogil:
    # Winograd points of F(tile x tile, 3x3): its window is tile + 2 wide.
    return (tile + 2) * (tile + 2)


cdef inline Py_ssize_t wino_point_stride(real dtype_tag, Py_ssize_t values) noexcept nogil:
    # Values from one point's block of V or M to the next: a line more
    # where the blocks would be an even number of lines apart.  A tile's
    # transform stores (or reads) one vector of each of the 36 points in
    # turn; blocks a multiple of 4 KiB apart put them all in one L1 set, 36
    # lines for 8 ways (256->256 @14 b1, 16 tiles of 1 KiB rows: the input
    # transform took 11.5 % of the call).
    if (values * <Py_ssize_t>sizeof(real)) % 128 == 0:
        return values + 64 // <Py_ssize_t>sizeof(real)
    return values


cdef inline bint wino_few_fits(Py_ssize_t OC, real dtype_tag) noexcept nogil:
    # winograd_few_nogil's shape: 32 vector registers (its 24 accumulators
    # and a row of six points) and whole vectors of output channels.
    return VBYTES == 64 and OC % (VBYTES // sizeof(real)) == 0


cdef struct WinoLayout:
    # How U is packed: the GEMM k-blocks over C, the block width over OC,
    # and the size of one point's packed matrix.
    Py_ssize_t n_kb, nc_blk, point_size


cdef KBlock* wino_layout(real dtype_tag, Py_ssize_t C, Py_ssize_t OC,
                         WinoLayout* lay) noexcept nogil:
    # The k-blocks (malloc'ed, the caller frees; NULL when out of memory).
    cdef Py_ssize_t kc_blk
    block_sizes(<real>0, C, OC, &kc_blk, &lay.nc_blk)
    cdef KBlock* blocks = <KBlock*>malloc(cdiv(C, kc_blk) * sizeof(KBlock))
    if blocks != NULL:
        lay.n_kb = uniform_k_blocks(C, kc_blk, blocks)
        lay.point_size = packed_b_size(blocks, lay.n_kb, OC, lay.nc_blk)
    return blocks


cdef inline void wino_filter(int tile, bint vector, bint stream, const real* w, Py_ssize_t ts,
                             real* u, Py_ssize_t su) noexcept nogil:
    # The filter transform of F(tile x tile, 3x3): VL filters (vector,
    # streamed or not) or one.
    if real is float:
        if tile == 2:
            if not vector:
                fc_wino2_filter1_f32(w, ts, u, su)
            elif stream:
                fc_wino2_filter_nt_f32(w, ts, u, su)
            else:
                fc_wino2_filter_f32(w, ts, u, su)
        elif not vector:
            fc_wino_filter1_f32(w, ts, u, su)
        elif stream:
            fc_wino_filter_nt_f32(w, ts, u, su)
        else:
            fc_wino_filter_f32(w, ts, u, su)
    else:
        if tile == 2:
            if not vector:
                fc_wino2_filter1_f64(w, ts, u, su)
            elif stream:
                fc_wino2_filter_nt_f64(w, ts, u, su)
            else:
                fc_wino2_filter_f64(w, ts, u, su)
        elif not vector:
            fc_wino_filter1_f64(w, ts, u, su)
        elif stream:
            fc_wino_filter_nt_f64(w, ts, u, su)
        else:
            fc_wino_filter_f64(w, ts, u, su)


cdef void wino_transpose_filters(const real* w, Py_ssize_t rsw, Py_ssize_t C,
                                 Py_ssize_t oc0, Py_ssize_t oc_end, Py_ssize_t kc0,
                                 Py_ssize_t kcb, real* wloc) noexcept nogil:
    # wloc[(t*kcb + c - kc0)*NR + oc - oc0] = w[oc, t*C + c] for the output
    # channels oc0..oc_end (at most NR) and input channels kc0..kc0+kcb of
    # the conv's (OC x 9*C) weight, OHWI rows rsw apart: (tap, c, oc), the
    # layout wino_filter_block vectorises over output channels.  TB rows at
    # a time, one line of each per block.  With every channel (kcb == C) a
    # row is one run, read straight through, and each block asks for the
    # lines WINO_TRANSPOSE_PREFETCH_LINES ahead: the TB row streams were
    # more than the hardware prefetcher followed, and the transpose waited
    # on each block's loads (perf: 27 % of 512->512 @7 batch 1 per call, 1
    # thread, three quarters of it on the row loads; 101 -> 115 GFLOPS).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t TB = 64 // sizeof(real)
    cdef Py_ssize_t t, i0, j0, ib, jblk, ahead
    for ib in range(cdiv(oc_end - oc0, TB)):
        i0 = ib * TB
        for t in range(9):
            for jblk in range(cdiv(kcb, TB)):
                j0 = jblk * TB
                ahead = t * C + kc0 + j0 + WINO_TRANSPOSE_PREFETCH_LINES * TB
                if kcb == C and ahead < 9 * C:
                    fc_prefetch_rows(w + (oc0 + i0) * rsw + ahead, min(TB, oc_end - oc0 - i0),
                                     rsw * sizeof(real), 64)
                if real is float:
                    fc_transpose_block_f32(i0, min(oc_end - oc0, i0 + TB), j0, min(kcb, j0 + TB),
                                           w + oc0 * rsw + t * C + kc0, rsw,
                                           wloc + t * kcb * NR, NR)
                else:
                    fc_transpose_block_f64(i0, min(oc_end - oc0, i0 + TB), j0, min(kcb, j0 + TB),
                                           w + oc0 * rsw + t * C + kc0, rsw,
                                           wloc + t * kcb * NR, NR)


cdef void wino_filter_block(const real* src, Py_ssize_t src_c, Py_ssize_t src_t,
                            Py_ssize_t width, Py_ssize_t kcb, int tile, bint stream,
                            real* dst, Py_ssize_t ldd, Py_ssize_t su) noexcept nogil:
    # U = G g G^T of kcb rows of width filters: tap t of filter (c, oc) at
    # src + c*src_c + oc + t*src_t, point p of its U at dst + p*su + c*ldd +
    # oc (ldd = NR: rows of a packed B panel).  The transform runs on
    # vectors along oc, contiguous in the source (wino_transpose_filters'
    # tile, the flipped weight of an input gradient, or the OHWI rows that
    # winograd_short_nogil transforms along C); streamed, the vector steps'
    # stores must be vector-aligned (VL divides ldd).
    cdef Py_ssize_t VL = VBYTES // sizeof(real)
    cdef Py_ssize_t c, oc
    for c in range(kcb):
        oc = 0
        while oc < width:
            if oc + VL <= width:
                wino_filter(tile, True, stream, src + c * src_c + oc, src_t, dst + c * ldd + oc,
                            su)
                oc = oc + VL
            else:
                wino_filter(tile, False, False, src + c * src_c + oc, src_t,
                            dst + c * ldd + oc, su)
                oc = oc + 1


cdef int wino_pack_filters(const real* w, Py_ssize_t rsw, Py_ssize_t OC, Py_ssize_t C,
                           bint flipped, const KBlock* blocks, const WinoLayout* lay, int nt,
                           int tile, real* dst) noexcept nogil:
    # The filters of a conv with C input and OC output channels -> U,
    # written straight into the packed layout of the GEMM's B operand (C x
    # OC) of each point, point p at dst + p*point_size.  w: the conv's (OC x
    # 9*C) weight, OHWI rows rsw apart, transposed a task's tile at a time
    # (transposing the whole weight to memory first wrote and read back 9.4
    # MB per call at 512->512: 11-14 % of a per-call 512->512 @7 batch-8
    # layer); or, flipped, the (C x 9*OC) weight of the convolution whose
    # input gradient this conv is (g[oc, t, c] = w[c, 8 - t, oc]), whose
    # output channels are contiguous already.  Returns -1 when out of memory.
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t kc_max = max_block_depth(blocks, lay.n_kb)
    cdef Py_ssize_t tile_size = 9 * kc_max * NR
    cdef real* tiles = NULL
    if not flipped:
        tiles = <real*>aligned_malloc(nt * tile_size * sizeof(real))
        if tiles == NULL:
            return -1
    if OC % NR:
        # The columns past OC of the last panels multiply into discarded
        # accumulators; zeros keep NaN and subnormals out of them.
        memset(dst, 0, wino_points(tile) * lay.point_size * sizeof(real))
    # One task per (NR panel, k-block): its rows of each point's packed
    # matrix are written in order, 36 sequential streams.  Walking c
    # outermost instead scattered every store over 36 x (OC/NR) panels,
    # each a write-allocate miss (half of a per-call 256x256 layer).
    cdef Py_ssize_t n_panels = cdiv(OC, NR), task, jp, kb, oc0, oc_end, kc0, kcb, jb
    cdef real* wloc
    cdef real* dst_task
    # Streaming stores need vector-aligned addresses: those of the vector
    # steps are when dst is (panel rows are NR values, oc % NR is a multiple
    # of VL, points point_size apart); a workspace block always is, a NumPy
    # array (PackedConv2d's filters) not necessarily.
    cdef bint stream = (wino_points(tile) * lay.point_size * <Py_ssize_t>sizeof(real)
                        > wino_stream_bytes
                        and (<size_t>dst) % VBYTES == 0
                        and (lay.point_size * <Py_ssize_t>sizeof(real)) % VBYTES == 0)
    for task in prange(n_panels * lay.n_kb, num_threads=nt, schedule="static"):
        jp = task // lay.n_kb
        kb = task % lay.n_kb
        oc0 = jp * NR
        jb = oc0 // lay.nc_blk
        oc_end = min(OC, oc0 + NR)
        kc0 = blocks[kb].k0
        kcb = blocks[kb].kc
        dst_task = (dst + (jb * lay.n_kb + kb) * kc_max * lay.nc_blk
                    + (oc0 - jb * lay.nc_blk) * kcb)
        if flipped:
            # g[oc, t, c] = w[c, 8 - t, oc]: taps read backwards.
            wino_filter_block(w + 8 * OC + kc0 * rsw + oc0, rsw, -OC, oc_end - oc0, kcb, tile,
                              stream, dst_task, NR, lay.point_size)
        else:
            wloc = tiles + threadid() * tile_size
            wino_transpose_filters(w, rsw, C, oc0, oc_end, kc0, kcb, wloc)
            wino_filter_block(wloc, NR, kcb * NR, oc_end - oc0, kcb, tile, stream, dst_task,
                              NR, lay.point_size)
        if stream:
            fc_store_fence()
    aligned_free(tiles)
    return 0


cdef inline Py_ssize_t wino_chunk_tiles(real dtype_tag, Py_ssize_t ldv, Py_ssize_t ldm,
                                        Py_ssize_t tiles, Py_ssize_t points) noexcept nogil:
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t per_tile = points * (ldv + ldm) * <Py_ssize_t>sizeof(real)
    cdef Py_ssize_t n = wino_chunk_bytes // per_tile
    if wino_chunk_bytes >= CHUNK_BYTES_FLOOR:
        n = max(n, WINO_MIN_TILES)
    n = max(MR, n // MR * MR)
    return min(n, tiles)


cdef struct WinoTiling:
    # m x m output tiles (m = 4 or 2).  A dilated layer's outputs o = a +
    # d*i of residue a form an undilated convolution of the input sub-grid
    # of step d (taps d apart): tiles are cut per residue ("phase"), the
    # window read and the tile written d pixels apart.  per_h x per_w tiles
    # per phase, DH x DW phases per image; a phase with fewer outputs
    # leaves its last tiles partly or wholly empty.
    Py_ssize_t per_h, per_w, tiles_h, tiles_w
    int m


cdef inline WinoTiling wino_tiling(const ConvGeom* g, int tile) noexcept nogil:
    cdef WinoTiling t
    t.m = tile
    t.per_h = cdiv(cdiv(g.OH, g.DH), tile)
    t.per_w = cdiv(cdiv(g.OW, g.DW), tile)
    t.tiles_h = g.DH * t.per_h
    t.tiles_w = g.DW * t.per_w
    return t


cdef inline void wino_tile_origin(const ConvGeom* g, const WinoTiling* tl, Py_ssize_t tile,
                                  Py_ssize_t* n, Py_ssize_t* oh, Py_ssize_t* ow) noexcept nogil:
    # Image and first output pixel of a tile; its pixels are d apart.
    n[0] = tile // (tl.tiles_h * tl.tiles_w)
    cdef Py_ssize_t r = tile - n[0] * tl.tiles_h * tl.tiles_w
    cdef Py_ssize_t th = r // tl.tiles_w, tw = r % tl.tiles_w
    oh[0] = th // tl.per_h + g.DH * tl.m * (th % tl.per_h)
    ow[0] = tw // tl.per_w + g.DW * tl.m * (tw % tl.per_w)


cdef inline int window_span(Py_ssize_t i0, Py_ssize_t d, Py_ssize_t size, int window,
                            int* lo) noexcept nogil:
    # Window positions r (input index i0 + d*r, r < window) inside
    # [0, size): lo[0] .. the returned end (empty when end <= lo[0]).
    lo[0] = <int>(cdiv(-i0, d) if i0 < 0 else 0)
    if i0 >= size:
        return 0
    return <int>min(window, (size - 1 - i0) // d + 1)


cdef void wino_input_tile(const ConvGeom* g, const real* x, ImageStrides xs,
                          const WinoTiling* tl, Py_ssize_t tile,
                          real* v, Py_ssize_t sv) noexcept nogil:
    cdef Py_ssize_t n, oh, ow
    wino_tile_origin(g, tl, tile, &n, &oh, &ow)
    cdef Py_ssize_t ih0 = oh - g.PT, iw0 = ow - g.PL
    # The window rows r0..r1 and columns s0..s1 inside the image; img is
    # its first pixel there (no pointer outside the image is formed).
    cdef int r0, s0
    cdef int r1 = window_span(ih0, g.DH, g.H, tl.m + 2, &r0)
    cdef int s1 = window_span(iw0, g.DW, g.W, tl.m + 2, &s0)
    cdef const real* img = x + n * xs.n
    if r1 <= r0 or s1 <= s0:
        r0 = r1 = s0 = s1 = 0        # a window wholly in the padding
    else:
        img = img + (ih0 + g.DH * r0) * xs.h + (iw0 + g.DW * s0) * xs.w
    if real is float:
        if tl.m == 2:
            fc_wino2_input_f32(img, xs.h * g.DH, xs.w * g.DW, r0, r1, s0, s1, g.C, v, sv)
        else:
            fc_wino_input_f32(img, xs.h * g.DH, xs.w * g.DW, r0, r1, s0, s1, g.C, v, sv)
    else:
        if tl.m == 2:
            fc_wino2_input_f64(img, xs.h * g.DH, xs.w * g.DW, r0, r1, s0, s1, g.C, v, sv)
        else:
            fc_wino_input_f64(img, xs.h * g.DH, xs.w * g.DW, r0, r1, s0, s1, g.C, v, sv)


cdef void wino_output_tile(const ConvGeom* g, const real* m, Py_ssize_t sm, Py_ssize_t OC,
                           const real* bias, int act, bint add, const WinoTiling* tl,
                           Py_ssize_t tile, real* y, Py_ssize_t rsy) noexcept nogil:
    cdef Py_ssize_t n, oh, ow
    wino_tile_origin(g, tl, tile, &n, &oh, &ow)
    if oh >= g.OH or ow >= g.OW:
        return                       # past the last output of a short phase
    cdef int rows = <int>min(tl.m, cdiv(g.OH - oh, g.DH))
    cdef int cols = <int>min(tl.m, cdiv(g.OW - ow, g.DW))
    cdef real* dst = y + ((n * g.OH + oh) * g.OW + ow) * rsy
    cdef Py_ssize_t syh = g.OW * rsy * g.DH, syw = rsy * g.DW
    if real is float:
        if tl.m == 2:
            fc_wino2_output_f32(m, sm, OC, bias, act, add, dst, syh, syw, rows, cols)
        else:
            fc_wino_output_f32(m, sm, OC, bias, act, add, dst, syh, syw, rows, cols)
    else:
        if tl.m == 2:
            fc_wino2_output_f64(m, sm, OC, bias, act, add, dst, syh, syw, rows, cols)
        else:
            fc_wino_output_f64(m, sm, OC, bias, act, add, dst, syh, syw, rows, cols)


cdef int winograd_fused_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                              const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                              const real* bias, int act, real* y, Py_ssize_t rsy, int nt,
                              bint flipped, bint accumulate, int tile, const WinoTiling* tl,
                              Py_ssize_t tiles) noexcept nogil:
    # winograd_forward_nogil for filters transformed in this call and few
    # tiles (see wino_fused_max_tiles): V of every tile first; then each
    # task, one NR panel of output channels, transforms its filters a
    # k-block at a time into a buffer of its own (P x kc x NR, in L2),
    # multiplies every tile's V by them at once, and finishes its channels
    # of every tile.  U never goes to memory: packed up front, 36 x C x OC
    # values were written out and read back per call (38 MB at 512->512),
    # for GEMMs whose few rows use each value only a few times.
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t points = wino_points(tile)
    cdef Py_ssize_t kc_blk = max(16, WINO_FUSED_PANEL_BYTES
                                 // (points * NR * <Py_ssize_t>sizeof(real)) // 16 * 16)
    cdef KBlock* blocks = <KBlock*>malloc(cdiv(g.C, kc_blk) * sizeof(KBlock))
    if blocks == NULL:
        return -1
    cdef Py_ssize_t n_kb = uniform_k_blocks(g.C, kc_blk, blocks)
    cdef Py_ssize_t kc_max = max_block_depth(blocks, n_kb)
    cdef Py_ssize_t ldv = patch_ld(<real>0, g.C), ldm = patch_ld(<real>0, OC)
    cdef Py_ssize_t sv = wino_point_stride(<real>0, tiles * ldv)
    cdef Py_ssize_t sm = wino_point_stride(<real>0, tiles * ldm)
    # Points' panels an odd number of lines apart: panels of whole pages
    # (128 x 32 floats) put the 36 points' stores of one filter vector in
    # one L1 set (the filter transform took 36 % of 512->512 @7 batch 1,
    # 1 thread; 62 -> 101 GFLOPS with the extra line).
    cdef Py_ssize_t point_stride = wino_point_stride(<real>0, kc_max * NR)
    cdef Py_ssize_t panel_size = points * point_stride, wtile_size = 9 * g.C * NR
    cdef real* v = <real*>aligned_malloc(points * sv * sizeof(real))
    cdef real* m = <real*>aligned_malloc(points * sm * sizeof(real))
    cdef real* panels = <real*>aligned_malloc(nt * panel_size * sizeof(real))
    cdef real* wtiles = NULL
    if not flipped:
        wtiles = <real*>aligned_malloc(nt * wtile_size * sizeof(real))
    if v == NULL or m == NULL or panels == NULL or (wtiles == NULL and not flipped):
        aligned_free(v)
        aligned_free(m)
        aligned_free(panels)
        aligned_free(wtiles)
        free(blocks)
        return -1
    cdef Py_ssize_t t, jp, kb, p, oc0, width, kc0, kcb
    cdef real* up
    cdef real* wloc
    for t in prange(tiles, num_threads=nt, schedule="static"):
        wino_input_tile(g, x, xs, tl, t, v + t * ldv, sv)
    for jp in prange(cdiv(OC, NR), num_threads=nt, schedule="static"):
        oc0 = jp * NR
        width = min(NR, OC - oc0)
        up = panels + threadid() * panel_size
        wloc = NULL if flipped else wtiles + threadid() * wtile_size
        if not flipped:
            # The panel's weights for every k-block at once: each row one
            # run, which wino_transpose_filters prefetches ahead in.
            wino_transpose_filters(w, rsw, g.C, oc0, oc0 + width, 0, g.C, wloc)
        if width < NR:
            # Columns past OC multiply into discarded accumulators: zeros
            # (no k-block writes them) keep NaN and subnormals out of them,
            # whatever this thread's previous, full panel left there.
            memset(up, 0, panel_size * sizeof(real))
        for kb in range(n_kb):
            kc0 = blocks[kb].k0
            kcb = blocks[kb].kc
            if flipped:
                wino_filter_block(w + 8 * OC + kc0 * rsw + oc0, rsw, -OC, width, kcb, tile,
                                  False, up, NR, point_stride)
            else:
                wino_filter_block(wloc + kc0 * NR, NR, g.C * NR, width, kcb, tile, False, up,
                                  NR, point_stride)
            for p in range(points):
                macro_kernel(tiles, width, kcb, 0, 1, v + p * sv + kc0, ldv, 1,
                             up + p * point_stride, m + p * sm + oc0, ldm, 1, 1, 0, kb == 0,
                             NULL, ACT_NONE, 0)
        for t in range(tiles):
            wino_output_tile(g, m + t * ldm + oc0, sm, width,
                             NULL if bias == NULL else bias + oc0, act, accumulate, tl, t,
                             y + oc0, rsy)
    aligned_free(v)
    aligned_free(m)
    aligned_free(panels)
    aligned_free(wtiles)
    free(blocks)
    return 0


cdef int winograd_few_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                            const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                            const real* bias, int act, real* y, Py_ssize_t rsy, int nt,
                            bint flipped, bint accumulate, const WinoTiling* tl,
                            Py_ssize_t tiles, const real* halves=NULL) noexcept nogil:
    # F(4x4) with filters transformed in this call, for few tiles (see
    # fc_wino_few), in groups of Q = WINO_FEW_TILES (the last padded with
    # zero tiles); halves: NULL, or the column halves packed by
    # wino_pack_column_halves, read in place of w's transform.  V of every
    # tile first, group by group (group, point, tile, c), then regrouped per
    # group and row i of points as vt[c][j][q] (C x 6Q) and scaled to S V S
    # (for the filters' factored transform, FC_WINO_FEW_H); then each task,
    # one NR panel of output channels, takes a vector of output channels and
    # a k-block at a time: their filters' scaled taps into wl (per thread;
    # or the packed halves), then each group's rows of points into M
    # (point, tile, OC).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t VL = VBYTES // sizeof(real)
    cdef Py_ssize_t TB = 64 // sizeof(real)
    cdef Py_ssize_t Q = WINO_FEW_TILES, C = g.C
    cdef Py_ssize_t groups = cdiv(tiles, Q)
    cdef Py_ssize_t kc_blk = 128
    cdef KBlock* blocks = <KBlock*>malloc(cdiv(C, kc_blk) * sizeof(KBlock))
    if blocks == NULL:
        return -1
    # Per call, the blocks after the first start on a cache line of every
    # weight row where the rows keep one alignment (see
    # fc_wino_taps_rows; numpy puts arrays 16 bytes apart, and a 16-byte
    # offset made the whole 512->512 @7 batch 1 call ~10 % slower).
    cdef Py_ssize_t lead = 0
    if halves == NULL and not flipped and C % TB == 0 and rsw % TB == 0:
        lead = <Py_ssize_t>((<size_t>w) // sizeof(real) % TB)
    cdef Py_ssize_t n_kb = uniform_k_blocks(C, kc_blk, blocks, lead)
    cdef Py_ssize_t kc_max = max_block_depth(blocks, n_kb)
    cdef Py_ssize_t ldv = patch_ld(<real>0, C), ldm = patch_ld(<real>0, OC)
    cdef Py_ssize_t sv = Q * ldv, sg = 36 * sv, sm = groups * Q * ldm
    cdef Py_ssize_t wl_size = kc_max * 9 * VL, svt = 6 * Q * C
    cdef real* v = <real*>aligned_malloc(groups * sg * sizeof(real))
    cdef real* vt = <real*>aligned_malloc(groups * 6 * svt * sizeof(real))
    cdef real* m = <real*>aligned_malloc(36 * sm * sizeof(real))
    cdef real* wls = <real*>aligned_malloc((1 if halves != NULL else nt * wl_size) * sizeof(real))
    if v == NULL or vt == NULL or m == NULL or wls == NULL:
        aligned_free(v)
        aligned_free(vt)
        aligned_free(m)
        aligned_free(wls)
        free(blocks)
        return -1
    cdef Py_ssize_t t, p, i, gi, r0, c0, jp, kb, oc0, ov, width, kc0, kcb, srow
    cdef Py_ssize_t n_cb = cdiv(C, TB)
    cdef real* wl
    cdef const real* src
    cdef const real* vrow
    if tiles < groups * Q:
        for p in range(36):
            memset(v + (groups - 1) * sg + p * sv + (tiles % Q) * ldv, 0,
                   (groups * Q - tiles) * ldv * sizeof(real))
    for t in prange(tiles, num_threads=nt, schedule="static"):
        wino_input_tile(g, x, xs, tl, t, v + t // Q * sg + t % Q * ldv, sv)
    # A group's row i: 6 x Q rows of V, ldv apart -> C x 6Q, through full
    # blocks of TB rows (the last block overlapping the one before).
    for gi in prange(groups * 6, num_threads=nt, schedule="static"):
        vrow = v + gi // 6 * sg + gi % 6 * 6 * sv
        for p in range(cdiv(6 * Q, TB) * n_cb):
            r0 = min(p // n_cb * TB, 6 * Q - TB)
            c0 = p % n_cb * TB
            if real is float:
                fc_transpose_block_f32(r0, r0 + TB, c0, min(C, c0 + TB), vrow, ldv,
                                       vt + gi * svt, 6 * Q)
            else:
                fc_transpose_block_f64(r0, r0 + TB, c0, min(C, c0 + TB), vrow, ldv,
                                       vt + gi * svt, 6 * Q)
        if real is float:
            fc_wino_scale_vt_f32(C, gi % 6, vt + gi * svt)
        else:
            fc_wino_scale_vt_f64(C, gi % 6, vt + gi * svt)
    for jp in prange(cdiv(OC, NR), num_threads=nt, schedule="static"):
        oc0 = jp * NR
        width = min(NR, OC - oc0)
        ov = 0
        while ov < width:
            for kb in range(n_kb):
                kc0 = blocks[kb].k0
                kcb = blocks[kb].kc
                if halves != NULL:
                    # Row i of this block's column halves at src + i*srow.
                    src = halves + (oc0 + ov) * 18 * C + kc0 * 3 * VL
                    srow = 3 * VL * C
                else:
                    wl = wls + threadid() * wl_size
                    if flipped:
                        if real is float:
                            fc_wino_taps_f32(kcb, w + 8 * OC + kc0 * rsw + oc0 + ov, -OC, rsw, wl)
                        else:
                            fc_wino_taps_f64(kcb, w + 8 * OC + kc0 * rsw + oc0 + ov, -OC, rsw, wl)
                    elif real is float:
                        fc_wino_taps_rows_f32(kcb, w + (oc0 + ov) * rsw + kc0, rsw, C, wl)
                    else:
                        fc_wino_taps_rows_f64(kcb, w + (oc0 + ov) * rsw + kc0, rsw, C, wl)
                    src = wl     # every row from the same taps
                    srow = 0
                for gi in range(groups * 6):
                    i = gi % 6
                    if real is float:
                        fc_wino_few_f32(i, halves == NULL, kcb, src + i * srow,
                                        vt + gi * svt + kc0 * 6 * Q,
                                        m + 6 * i * sm + gi // 6 * Q * ldm + oc0 + ov, sm, ldm,
                                        kb > 0)
                    else:
                        fc_wino_few_f64(i, halves == NULL, kcb, src + i * srow,
                                        vt + gi * svt + kc0 * 6 * Q,
                                        m + 6 * i * sm + gi // 6 * Q * ldm + oc0 + ov, sm, ldm,
                                        kb > 0)
            ov = ov + VL
        for t in range(tiles):
            wino_output_tile(g, m + t * ldm + oc0, sm, width,
                             NULL if bias == NULL else bias + oc0, act, accumulate, tl, t,
                             y + oc0, rsy)
    aligned_free(v)
    aligned_free(vt)
    aligned_free(m)
    aligned_free(wls)
    free(blocks)
    return 0


cdef int winograd_short_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                              const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                              const real* bias, int act, real* y, Py_ssize_t rsy, int nt,
                              bint accumulate, int tile, const WinoTiling* tl,
                              Py_ssize_t tiles) noexcept nogil:
    # winograd_forward_nogil for filters transformed in this call and at
    # most SHORT_M_MAX_ROWS tiles, by the GEMM's short-M kernels with the
    # roles of the fused path swapped: M[p]^T (OC x tiles) = U[p]^T (OC x
    # C) @ V[p]^T.  The weight's rows (OHWI: each tap's C values
    # contiguous) are transformed along C, vectors of input channels, so a
    # filter row of U[p]^T comes out contiguous, which is how the short-M
    # kernels read their broadcast operand: no transpose of the weight (the
    # fused path's were 22 % of 512->512 @7 batch 1 on Zen 3, its filter
    # transforms another 26 %). V of every tile first, then each point's
    # V^T packed for the kernels; then each task, short MR output channels,
    # transforms their filters into a buffer of its own (P x MR x C, in L2)
    # and multiplies every point; then the output transform, a panel of
    # output channels a task.
    cdef Py_ssize_t smr = S_SHORT_MR if real is float else D_SHORT_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t TB = 64 // sizeof(real)
    cdef Py_ssize_t points = wino_points(tile), C = g.C
    cdef Py_ssize_t ldv = patch_ld(<real>0, C), ldm = patch_ld(<real>0, OC)
    cdef Py_ssize_t sv = wino_point_stride(<real>0, tiles * ldv)
    cdef Py_ssize_t sm = wino_point_stride(<real>0, tiles * ldm)
    cdef Py_ssize_t sat = short_m_packed_size(tiles, C, <real>0)
    cdef Py_ssize_t ldu = patch_ld(<real>0, C)
    # Points' blocks an odd number of lines apart: at 256 channels a block
    # is 6 KiB, and F(4x4)'s 36 point stores of one filter vector fell in
    # two L1 sets (the transform's perf share at 256->256 @14 b1 29 -> 14 %;
    # as in winograd_fused_nogil).
    cdef Py_ssize_t su = wino_point_stride(<real>0, smr * ldu), ub_size = points * su
    cdef Py_ssize_t pf_bytes = cdiv(cdiv(9 * C * <Py_ssize_t>sizeof(real), points), 64) * 64
    cdef real* v = <real*>aligned_malloc(points * sv * sizeof(real))
    cdef real* m = <real*>aligned_malloc(points * sm * sizeof(real))
    cdef real* at = <real*>aligned_malloc(points * sat * sizeof(real))
    cdef real* ubs = <real*>aligned_malloc(nt * ub_size * sizeof(real))
    if v == NULL or m == NULL or at == NULL or ubs == NULL:
        aligned_free(v)
        aligned_free(m)
        aligned_free(at)
        aligned_free(ubs)
        return -1
    cdef Py_ssize_t t, p, jp, oc0, width
    cdef real* ub
    for t in prange(tiles, num_threads=nt, schedule="static"):
        wino_input_tile(g, x, xs, tl, t, v + t * ldv, sv)
    for p in prange(points, num_threads=nt, schedule="static"):
        short_m_pack(tiles, C, v + p * sv, ldv, at + p * sat, 0, cdiv(C, TB))
    for jp in prange(cdiv(OC, smr), num_threads=nt, schedule="static"):
        oc0 = jp * smr
        width = min(smr, OC - oc0)
        ub = ubs + threadid() * ub_size
        # The task's weight rows, transformed along C (tap t of row r at
        # t*C): row r of each point's U^T at ub + p*su + r*ldu.
        wino_filter_block(w + oc0 * rsw, rsw, C, C, width, tile, False, ub, ldu, su)
        for p in range(points):
            # The next task's weight rows into L2, a share before each
            # point's products: the transform waited on them (its perf
            # share of 512->512 @7 b1 24 -> 18 %).
            if oc0 + smr < OC and p * pf_bytes < 9 * C * <Py_ssize_t>sizeof(real):
                fc_prefetch_rows(<const char*>(w + (oc0 + smr) * rsw) + p * pf_bytes,
                                 min(smr, OC - oc0 - smr), rsw * sizeof(real),
                                 min(pf_bytes, 9 * C * <Py_ssize_t>sizeof(real) - p * pf_bytes))
            short_m_multiply(tiles, C, at + p * sat, v + p * sv + (tiles - 1) * ldv,
                             ub + p * su, ldu, width, 1, 0, m + p * sm + oc0, ldm, 1, NULL,
                             ACT_NONE)
    for jp in prange(cdiv(OC, NR), num_threads=nt, schedule="static"):
        oc0 = jp * NR
        width = min(NR, OC - oc0)
        for t in range(tiles):
            wino_output_tile(g, m + t * ldm + oc0, sm, width,
                             NULL if bias == NULL else bias + oc0, act, accumulate, tl, t,
                             y + oc0, rsy)
    aligned_free(v)
    aligned_free(m)
    aligned_free(at)
    aligned_free(ubs)
    return 0


cdef int winograd_forward_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                                const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                                const real* bias, int act, real* y, Py_ssize_t rsy,
                                const real* prepacked, int max_threads,
                                bint flipped=False, bint accumulate=False,
                                int tile=4, bint prepacked_few=False) noexcept nogil:
    # y (N*OH*OW x OC, rows rsy apart) = act(conv3x3(x, w) + bias (+ y
    # when accumulate)): the same contract as conv_forward_nogil for KH =
    # KW = 3, stride 1, dilation 1.  prepacked: NULL or
    # pack_winograd_weights' U (for the same tile), or with prepacked_few
    # (tile 4) pack_winograd_few_weights' column halves.  tile: 4 for F(4x4, 3x3),
    # 2 for F(2x2, 3x3) (by winograd_thin_nogil for few input channels, per
    # call filters).  flipped:
    # w is the (C x 9*OC) weight of the convolution whose input gradient
    # this is (see wino_pack_filters).
    cdef WinoTiling tl = wino_tiling(g, tile)
    cdef Py_ssize_t tiles = g.N * tl.tiles_h * tl.tiles_w
    cdef Py_ssize_t points = wino_points(tile)
    cdef int nt = threads_for(2.0 * points * tiles * g.C * OC, max_threads)
    if tile == 2 and prepacked == NULL and wino_thin_applies(g):
        return winograd_thin_nogil(g, x, xs, w, rsw, OC, bias, act, y, rsy, nt, flipped,
                                   accumulate)
    if prepacked_few:
        return winograd_few_nogil(g, x, xs, w, rsw, OC, bias, act, y, rsy, nt, False,
                                  accumulate, &tl, tiles, prepacked)
    if prepacked == NULL and not flipped and wino_short_applies(tiles, g.C, <real>0):
        return winograd_short_nogil(g, x, xs, w, rsw, OC, bias, act, y, rsy, nt, accumulate,
                                    tile, &tl, tiles)
    if (prepacked == NULL and tile == 4 and tiles <= min(wino_few_max_tiles, wino_fused_max_tiles)
            and wino_few_fits(OC, <real>0) and points * g.C * OC >= wino_fused_min_values):
        return winograd_few_nogil(g, x, xs, w, rsw, OC, bias, act, y, rsy, nt, flipped,
                                  accumulate, &tl, tiles)
    if (prepacked == NULL and tiles <= wino_fused_max_tiles
            and points * g.C * OC >= wino_fused_min_values):
        return winograd_fused_nogil(g, x, xs, w, rsw, OC, bias, act, y, rsy, nt, flipped,
                                    accumulate, tile, &tl, tiles)
    cdef WinoLayout lay
    cdef KBlock* blocks = wino_layout(<real>0, g.C, OC, &lay)
    if blocks == NULL:
        return -1
    cdef real* upack = <real*>prepacked
    if prepacked == NULL:
        upack = <real*>aligned_malloc(points * lay.point_size * sizeof(real))
        if upack == NULL or wino_pack_filters(w, rsw, OC, g.C, flipped, blocks, &lay, nt,
                                              tile, upack) != 0:
            aligned_free(upack)
            free(blocks)
            return -1
    cdef Py_ssize_t ldv = patch_ld(<real>0, g.C), ldm = patch_ld(<real>0, OC)
    cdef Py_ssize_t per_tile = points * (ldv + ldm) * <Py_ssize_t>sizeof(real)
    # Small filters (U <= 4 MiB: up to 128x128 channels): each thread takes
    # whole chunks of its own, sized to stay in its L2, and transforms,
    # multiplies and writes back its tiles alone.  Shared chunks (threads
    # split a chunk's tiles, then its points) move half of V and M between
    # the cores' caches, and their V stores -- 36 streams per tile -- miss
    # L2: the input transform took a third of 64->64 @56.  Large filters
    # keep shared chunks: there each thread streams only its points' U.
    cdef Py_ssize_t chunk = min(min(wino_chunk_bytes, WINO_OWN_CHUNK_BYTES) // per_tile, tiles)
    chunk = max(1, chunk)
    cdef Py_ssize_t n_own = cdiv(cdiv(tiles, chunk), nt) * nt
    cdef bint own_chunks = (nt > 1 and n_own <= tiles and
                            points * lay.point_size * <Py_ssize_t>sizeof(real)
                            <= WINO_OWN_MAX_U_BYTES)
    cdef int n_bufs = nt if own_chunks else 1
    if own_chunks:
        chunk = cdiv(tiles, n_own)       # equal chunks, a multiple of the threads
    else:
        chunk = wino_chunk_tiles(<real>0, ldv, ldm, tiles, points)
    cdef Py_ssize_t sv = wino_point_stride(<real>0, chunk * ldv)
    cdef Py_ssize_t sm = wino_point_stride(<real>0, chunk * ldm)
    cdef real* v = <real*>aligned_malloc(n_bufs * points * sv * sizeof(real))
    cdef real* m = <real*>aligned_malloc(n_bufs * points * sm * sizeof(real))
    if v == NULL or m == NULL:
        aligned_free(v)
        aligned_free(m)
        if prepacked == NULL:
            aligned_free(upack)
        free(blocks)
        return -1
    cdef Py_ssize_t ci, t0, tc, t, p
    cdef real* vt
    cdef real* mt
    if own_chunks:
        for ci in prange(cdiv(tiles, chunk), num_threads=nt, schedule="static"):
            vt = v + threadid() * points * sv
            mt = m + threadid() * points * sm
            t0 = ci * chunk
            tc = min(chunk, tiles - t0)
            for t in range(tc):
                wino_input_tile(g, x, xs, &tl, t0 + t, vt + t * ldv, sv)
            for p in range(points):
                multiply_chunk(tc, blocks, lay.n_kb, OC, vt + p * sv, ldv, 1,
                               upack + p * lay.point_size, lay.nc_blk, 0, 1,
                               mt + p * sm, ldm, 0, NULL)
            for t in range(tc):
                wino_output_tile(g, mt + t * ldm, sm, OC, bias, act, accumulate, &tl, t0 + t, y,
                                 rsy)
    else:
        for ci in range(cdiv(tiles, chunk)):
            t0 = ci * chunk
            tc = min(chunk, tiles - t0)
            for t in prange(tc, num_threads=nt, schedule="static"):
                wino_input_tile(g, x, xs, &tl, t0 + t, v + t * ldv, sv)
            for p in prange(points, num_threads=nt, schedule="static"):
                multiply_chunk(tc, blocks, lay.n_kb, OC, v + p * sv, ldv, 1,
                               upack + p * lay.point_size, lay.nc_blk, 0, 1,
                               m + p * sm, ldm, 0, NULL)
            for t in prange(tc, num_threads=nt, schedule="static"):
                wino_output_tile(g, m + t * ldm, sm, OC, bias, act, accumulate, &tl, t0 + t, y,
                                 rsy)
    aligned_free(v)
    aligned_free(m)
    if prepacked == NULL:
        aligned_free(upack)
    free(blocks)
    return 0


cdef void wino_pack_column_halves(const real* w, Py_ssize_t rsw, Py_ssize_t OC, Py_ssize_t C,
                                  int nt, real* halves) noexcept nogil:
    # The column halves H g' of w (OC x 9*C, OHWI rows; see fc_wino_few) as
    # winograd_few_nogil reads them: per vector of VL output channels q, row
    # i (of six), input channel c and column s, the VL values at halves +
    # ((q*6 + i)*C + c)*3*VL + s*VL.
    cdef Py_ssize_t VL = VBYTES // sizeof(real), q
    for q in prange(OC // VL, num_threads=nt, schedule="static"):
        if real is float:
            fc_wino_gcols_rows_f32(C, w + q * VL * rsw, rsw, C, halves + q * 18 * C * VL,
                                   3 * VL * C)
        else:
            fc_wino_gcols_rows_f64(C, w + q * VL * rsw, rsw, C, halves + q * 18 * C * VL,
                                   3 * VL * C)


def winograd_few_applies(Py_ssize_t OC, dtype):
    """Whether the few-tile path runs for OC output channels in this build
    (AVX-512, OC a multiple of a vector): per call for layers of at most
    WINO_FEW_MAX_TILES tiles, and from pack_winograd_few_weights' filters."""
    if dtype == "float32":
        return wino_few_fits(OC, <float>0)
    return wino_few_fits(OC, <double>0)


def pack_winograd_few_weights(const real[:, ::1] w, int num_threads):
    """w (OC, 3*3*C) as the few-tile path's column halves (H g', 18 x C
    x OC values: half of each filter's transform, U has 36) for this ISA
    build, to pass back as conv2d_winograd(..., packed=, tile=4).  The call
    then runs winograd_few_nogil whatever its tiles, the path for few of
    them (a 7x7 image at batch 1).  AVX-512 builds, OC a multiple of a
    vector (winograd_few_applies)."""
    cdef Py_ssize_t OC = w.shape[0], C = w.shape[1] // 9
    if C * 9 != w.shape[1] or C == 0 or OC == 0:
        raise ValueError(f"w must be (OC, 3*3*C) with OC, C >= 1; got {tuple(w.shape)[:2]}")
    if not wino_few_fits(OC, <real>0):
        raise ValueError(f"few-tile Winograd filters need an AVX-512 build and output channels "
                         f"in whole vectors of {VBYTES // sizeof(real)}; this is {ISA} with "
                         f"{OC}")
    packed = np.empty(18 * C * OC, np.float32 if real is float else np.float64)
    cdef real[::1] dst = packed
    with nogil:
        wino_pack_column_halves(&w[0, 0], w.strides[0] // sizeof(real), OC, C, num_threads,
                                &dst[0])
    return PackedWeights(packed, ISA, (OC, 9 * C), (3, 3), WINO_FEW_TAG)


def pack_winograd_weights(const real[:, ::1] w, int num_threads, int tile=4):
    """w (OC, 3*3*C) as Winograd-domain filters of F(tile x tile, 3x3)
    (tile 4 or 2) packed for this ISA build, to pass back as
    conv2d_winograd(..., packed=, tile=)."""
    check_winograd_tile(tile)
    cdef Py_ssize_t OC = w.shape[0], C = w.shape[1] // 9
    if C * 9 != w.shape[1] or C == 0 or OC == 0:
        raise ValueError(f"w must be (OC, 3*3*C) with OC, C >= 1; got {tuple(w.shape)[:2]}")
    cdef WinoLayout lay
    cdef KBlock* blocks = wino_layout(<real>0, C, OC, &lay)
    if blocks == NULL:
        raise MemoryError()
    packed = np.empty(wino_points(tile) * lay.point_size,
                      np.float32 if real is float else np.float64)
    cdef real[::1] dst = packed
    cdef int status
    with nogil:
        status = wino_pack_filters(&w[0, 0], w.strides[0] // sizeof(real), OC, C, False,
                                   blocks, &lay, num_threads, tile, &dst[0])
    free(blocks)
    if status != 0:
        raise MemoryError(f"conv2d: could not allocate {wino_points(tile) * OC * C * sizeof(real)} "
                          f"bytes for the Winograd filter transform")
    return PackedWeights(packed, ISA, (OC, 9 * C), (3, 3), wino_packed_tag(tile))


cdef check_winograd_tile(int tile):
    if tile != 2 and tile != 4:
        raise ValueError(f"tile must be 4 (F(4x4, 3x3)) or 2 (F(2x2, 3x3)); got {tile}")


cdef str wino_packed_tag(int tile):
    # What PackedWeights records: filters of one variant fit no other.
    return "winograd" if tile == 4 else "winograd2"


# What PackedWeights records for pack_winograd_few_weights' column halves.
WINO_FEW_TAG = "winograd-few"


def conv2d_winograd(const real[:, :, :, :] x, const real[:, :] w, bias, real[:, :] y,
                    pad_before, out_hw, int num_threads, int activation=ACT_NONE,
                    packed=None, bint flipped=False, dilation=(1, 1), bint accumulate=False,
                    int tile=4):
    """y = act(conv3x3(x, w) (+ bias) (+ y when accumulate: a residual the
    caller stored there)) by Winograd F(tile x tile, 3x3) (4 or 2), stride 1,
    any dilation (see WinoTiling): x NHWC, w (OC, 3*3*C), y (N*OH*OW, OC);
    packed None, pack_winograd_weights(w, tile=tile) or, for tile 4,
    pack_winograd_few_weights(w) (the few-tile path then runs, whatever the
    tiles).  tile 2 with at most winograd_thin_max_channels() input
    channels, undilated and without packed filters runs the thin path
    (winograd_thin_frame.pxi).  flipped: w is (C, 3*3*OC),
    the weight of the convolution whose input gradient this one is, used
    with its taps reversed and channels swapped (no packed weights then)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(y.shape[1], y.strides[1], sizeof(real), "y")
    cdef Py_ssize_t OC = w.shape[1] // 9 if flipped else w.shape[0]
    if flipped and (w.shape[0] != x.shape[3] or w.shape[1] != 9 * y.shape[1]
                    or packed is not None):
        raise ValueError(f"flipped: w must be ({x.shape[3]}, 3*3*{y.shape[1]}) and nothing "
                         f"packed; got {tuple(w.shape)[:2]}")
    if not flipped and w.shape[1] != 9 * x.shape[3]:
        raise ValueError(f"w must be (OC, 3*3*{x.shape[3]}); got {tuple(w.shape)[:2]}")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                (3, 3), (1, 1), dilation, pad_before, out_hw)
    check_pixel_rows(&g, y.shape[0], y.shape[1], OC, "y")
    if g.DH < 1 or g.DW < 1:
        raise ValueError(f"dilation must be positive; got {dilation}")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef const real* bias_ptr = NULL
    cdef const real[::1] bias_view
    if bias is not None:
        bias_view = bias
        bias_ptr = &bias_view[0]
    check_winograd_tile(tile)
    cdef bint few = getattr(packed, "algorithm", None) == WINO_FEW_TAG
    if few and tile != 4:
        raise ValueError(f"few-tile packed filters are F(4x4, 3x3)'s: tile must be 4; got {tile}")
    cdef const real* packed_ptr = checked_packed(packed, <real>0,
                                                 WINO_FEW_TAG if few else wino_packed_tag(tile),
                                                 (w.shape[0], w.shape[1]), (3, 3))
    cdef int status
    with nogil:
        status = winograd_forward_nogil(&g, &x[0, 0, 0, 0], xs, &w[0, 0],
                                        w.strides[0] // item, OC, bias_ptr, activation,
                                        &y[0, 0], y.strides[0] // item, packed_ptr, num_threads,
                                        flipped, accumulate, tile, few)
    if status != 0:
        raise MemoryError("conv2d: could not allocate the Winograd filters and chunk buffers")

