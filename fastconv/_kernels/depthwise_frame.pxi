# Depthwise convolution (groups == C, OC = C * multiplier), included by the
# per-ISA modules after conv_frame.pxi.
#
# A depthwise layer is KH*KW multiply-adds per output element and no
# reduction over channels, so as a GEMM it is a product with K = KH*KW and N =
# multiplier: far too thin to use the micro-kernel.  Here the channel axis,
# contiguous in NHWC, is the vector axis: each tap is an element-wise FMA of a
# pixel's channels with that tap's weights, and the compiler vectorises the
# channel loop.  Weights come in as (KH, KW, OC) so a tap's weights are
# contiguous too.
#
# Threads split output rows (forward), input rows (grad input: every task
# writes only its own rows) and output rows again for grad weight, each
# thread then summing into its own KH*KW*OC partial.

cdef extern from "depthwise_kernel.h":
    void fc_depthwise_taps_f32(Py_ssize_t C, Py_ssize_t ntaps, const float* const* a,
                               const float* const* b, const float* bias, float* y) noexcept nogil
    void fc_depthwise_taps_f64(Py_ssize_t C, Py_ssize_t ntaps, const double* const* a,
                               const double* const* b, const double* bias, double* y) noexcept nogil
    void fc_depthwise3x3_row_f32(const float* const* rows, Py_ssize_t xsw, Py_ssize_t W,
                                 Py_ssize_t C, Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW,
                                 Py_ssize_t PL, Py_ssize_t lo, Py_ssize_t hi, const float* w,
                                 const float* bias, float* y, int act,
                                 int stream, Py_ssize_t head) noexcept nogil
    void fc_depthwise3x3_row_f64(const double* const* rows, Py_ssize_t xsw, Py_ssize_t W,
                                 Py_ssize_t C, Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW,
                                 Py_ssize_t PL, Py_ssize_t lo, Py_ssize_t hi, const double* w,
                                 const double* bias, double* y, int act,
                                 int stream, Py_ssize_t head) noexcept nogil
    void fc_depthwise3x3_grad_weight_rows_f32(const float* const* block_rows, Py_ssize_t nrows,
                                              Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C,
                                              Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW,
                                              Py_ssize_t PL, Py_ssize_t lo, Py_ssize_t hi,
                                              const float* dy, Py_ssize_t dyw, Py_ssize_t dyr,
                                              float* dw, Py_ssize_t dwt) noexcept nogil
    void fc_depthwise3x3_grad_weight_rows_f64(const double* const* block_rows, Py_ssize_t nrows,
                                              Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C,
                                              Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW,
                                              Py_ssize_t PL, Py_ssize_t lo, Py_ssize_t hi,
                                              const double* dy, Py_ssize_t dyw, Py_ssize_t dyr,
                                              double* dw, Py_ssize_t dwt) noexcept nogil
    bint FC_DW3_CAN_STREAM

cdef enum:
    # Taps per kernel the pointer lists hold on the stack; larger kernels (or
    # channel multipliers) take the generic loops.
    MAX_DEPTHWISE_TAPS = 64
    # threads_for weighs flops at GEMM speed; a depthwise flop costs about
    # this many of them (one FMA per loaded value, memory-bound: 14x14x576
    # b1 ran at 1/5 of the GEMM's single-core rate), so 2 MFLOP layers also
    # get both threads.
    DEPTHWISE_FLOP_COST = 4
    # The 3x3 weight gradient's tasks: rows of an image adding up to about
    # this many output pixels (at most DW_GRADW_MAX_ROWS rows), by this
    # many channels.  A row a task before: Zen 3, in one process
    # alternating, best ms, 576 @14 batch 8 0.37 -> 0.28 (2 threads), 0.59
    # -> 0.53 (1 thread); 32 @112 batch 8, memory-bound, a tie (128 pixels
    # measured alike).
    DW_GRADW_PIXELS = 256
    DW_GRADW_MAX_ROWS = 32
    DW_GRADW_CHANNELS = 64
    # The 3x3 row kernel's output streams past this many times the GEMM's
    # stream threshold (see depthwise_forward_nogil).
    DEPTHWISE_STREAM_FACTOR = 8


cdef inline void depthwise_taps(Py_ssize_t C, Py_ssize_t ntaps, const real** a,
                                const real** b, const real* bias, real* y) noexcept nogil:
    if real is float:
        fc_depthwise_taps_f32(C, ntaps, a, b, bias, y)
    else:
        fc_depthwise_taps_f64(C, ntaps, a, b, bias, y)


cdef inline void depthwise_tap_row(const real* x, Py_ssize_t xsw, const real* w,
                                   real* y, Py_ssize_t ow0, Py_ssize_t ow1,
                                   Py_ssize_t iw0, Py_ssize_t SW, Py_ssize_t C,
                                   Py_ssize_t mult) noexcept nogil:
    # y[ow, :] += x[iw0 + ow*SW, channel of oc] * w[oc] for ow in ow0..ow1.
    cdef Py_ssize_t ow, c, j, OC = C * mult
    cdef const real* xp
    cdef real* yp
    cdef real xv
    for ow in range(ow0, ow1):
        xp = x + (iw0 + ow * SW) * xsw
        yp = y + ow * OC
        if mult == 1:
            for c in range(C):
                yp[c] += xp[c] * w[c]
        else:
            for c in range(C):
                xv = xp[c]
                for j in range(mult):
                    yp[c * mult + j] += xv * w[c * mult + j]


cdef inline RowRange valid_outputs(Py_ssize_t size, Py_ssize_t out_size, Py_ssize_t start,
                                   Py_ssize_t step) noexcept nogil:
    # The outputs o in [0, out_size) whose input start + o*step is in
    # [0, size).  (By value: prange bodies must assign their privates.)
    cdef RowRange r
    r.lo = 0 if start >= 0 else (-start + step - 1) // step
    if start + (out_size - 1) * step < size:
        r.hi = out_size
    elif start >= size:
        r.hi = 0
    else:
        r.hi = (size - 1 - start) // step + 1
    r.hi = min(max(r.hi, r.lo), out_size)
    r.lo = min(r.lo, r.hi)
    return r


cdef void depthwise_forward_row(const ConvGeom* g, const real* x, ImageStrides xs,
                                const real* w, const real* bias, real* y,
                                Py_ssize_t row) noexcept nogil:
    # Output row `row` (= n*OH + oh) with multiplier 1: per pixel, the list of
    # its taps inside the image (padding taps add nothing), then one pass.
    cdef const real* xp[MAX_DEPTHWISE_TAPS]
    cdef const real* wp[MAX_DEPTHWISE_TAPS]
    cdef Py_ssize_t n = row // g.OH, oh = row % g.OH
    cdef Py_ssize_t ow, kh, kw, ih, iw, ntaps
    for ow in range(g.OW):
        ntaps = 0
        for kh in range(g.KH):
            ih = oh * g.SH - g.PT + kh * g.DH
            if 0 <= ih < g.H:
                for kw in range(g.KW):
                    iw = ow * g.SW - g.PL + kw * g.DW
                    if 0 <= iw < g.W:
                        xp[ntaps] = x + n * xs.n + ih * xs.h + iw * xs.w
                        wp[ntaps] = w + (kh * g.KW + kw) * g.C
                        ntaps += 1
        depthwise_taps(g.C, ntaps, xp, wp, bias, y + (row * g.OW + ow) * g.C)


cdef struct Row3x3:
    # What the 3x3 row kernels take for output row (n, oh): its three input
    # rows (NULL outside the image) and the interior pixels [lo, hi), whose
    # first and last columns are both inside.
    const void* rows[3]
    Py_ssize_t lo, hi


cdef inline RowRange columns_with_taps_inside(const ConvGeom* g) noexcept nogil:
    # The output columns whose first and last tap columns (so every tap
    # column) lie inside the image, in any row: the row kernels skip their
    # column checks there.  (conv_frame's interior_columns also asks the
    # rows and a minimum run.)
    cdef RowRange first = valid_outputs(g.W, g.OW, -g.PL, g.SW)
    cdef RowRange last = valid_outputs(g.W, g.OW, (g.KW - 1) * g.DW - g.PL, g.SW)
    cdef RowRange r
    r.lo = max(first.lo, last.lo)
    r.hi = max(r.lo, min(first.hi, last.hi))
    return r


cdef inline Row3x3 row3x3(const ConvGeom* g, const real* x, ImageStrides xs,
                          Py_ssize_t row) noexcept nogil:
    cdef Row3x3 r
    cdef Py_ssize_t n = row // g.OH, oh = row % g.OH, kh, ih
    cdef RowRange inner = columns_with_taps_inside(g)
    for kh in range(3):
        ih = oh * g.SH - g.PT + kh * g.DH
        r.rows[kh] = <const void*>(x + n * xs.n + ih * xs.h) if 0 <= ih < g.H else NULL
    r.lo, r.hi = inner.lo, inner.hi
    return r


cdef void depthwise3x3_grad_weight_block(const ConvGeom* g, const real* x, ImageStrides xs,
                                         const real* dy, real* dw, Py_ssize_t row0,
                                         Py_ssize_t nrows, Py_ssize_t c0,
                                         Py_ssize_t width) noexcept nogil:
    # dw (3, 3, C) += the contribution of output rows row0 .. row0+nrows
    # (one image's) to channels c0 .. c0+width, multiplier 1.  The
    # interior columns are the same for every row.
    cdef const void* rows[3 * DW_GRADW_MAX_ROWS]
    cdef RowRange inner = columns_with_taps_inside(g)
    cdef Row3x3 r
    cdef Py_ssize_t i, kh
    for i in range(nrows):
        r = row3x3(g, x, xs, row0 + i)
        for kh in range(3):
            rows[3 * i + kh] = NULL if r.rows[kh] == NULL else <const void*>(
                <const real*>r.rows[kh] + c0)
    if real is float:
        fc_depthwise3x3_grad_weight_rows_f32(<const float**>rows, nrows, xs.w, g.W, width,
                                             g.OW, g.SW, g.DW, g.PL, inner.lo, inner.hi,
                                             dy + row0 * g.OW * g.C + c0, g.C, g.OW * g.C,
                                             dw + c0, g.C)
    else:
        fc_depthwise3x3_grad_weight_rows_f64(<const double**>rows, nrows, xs.w, g.W, width,
                                             g.OW, g.SW, g.DW, g.PL, inner.lo, inner.hi,
                                             dy + row0 * g.OW * g.C + c0, g.C, g.OW * g.C,
                                             dw + c0, g.C)


cdef void depthwise3x3_forward_row(const ConvGeom* g, const real* x, ImageStrides xs,
                                   const real* w, const real* bias, real* y,
                                   Py_ssize_t row, int act, bint stream,
                                   Py_ssize_t head) noexcept nogil:
    # Output row `row` (= n*OH + oh) of a 3x3 layer with multiplier 1, by
    # the register-blocked row kernel, activation fused; head as
    # fc_depthwise3x3_row takes it (aligned_head).
    cdef Row3x3 r = row3x3(g, x, xs, row)
    cdef const real** rows = <const real**>r.rows
    cdef Py_ssize_t lo = r.lo, hi = r.hi
    if real is float:
        fc_depthwise3x3_row_f32(rows, xs.w, g.W, g.C, g.OW, g.SW, g.DW, g.PL, lo, hi, w, bias,
                                y + row * g.OW * g.C, act, stream, head)
    else:
        fc_depthwise3x3_row_f64(rows, xs.w, g.W, g.C, g.OW, g.SW, g.DW, g.PL, lo, hi, w, bias,
                                y + row * g.OW * g.C, act, stream, head)
    if stream:
        fc_store_fence()


cdef void depthwise_grad_input_row(const ConvGeom* g, const real* dy, const real* w,
                                   real* dx, ImageStrides xs, Py_ssize_t row) noexcept nogil:
    # Input row `row` (= n*H + ih) with multiplier 1: per input pixel, the
    # output gradients of every tap that read it, then one pass (the pixel
    # is written, not accumulated: no other task touches it).
    cdef const real* dyp[MAX_DEPTHWISE_TAPS]
    cdef const real* wp[MAX_DEPTHWISE_TAPS]
    cdef Py_ssize_t n = row // g.H, ih = row % g.H
    cdef Py_ssize_t iw, kh, kw, t, u, oh, ow, ntaps
    for iw in range(g.W):
        ntaps = 0
        for kh in range(g.KH):
            t = ih + g.PT - kh * g.DH
            if t >= 0 and t % g.SH == 0 and t // g.SH < g.OH:
                oh = t // g.SH
                for kw in range(g.KW):
                    u = iw + g.PL - kw * g.DW
                    if u >= 0 and u % g.SW == 0 and u // g.SW < g.OW:
                        ow = u // g.SW
                        dyp[ntaps] = dy + ((n * g.OH + oh) * g.OW + ow) * g.C
                        wp[ntaps] = w + (kh * g.KW + kw) * g.C
                        ntaps += 1
        depthwise_taps(g.C, ntaps, dyp, wp, NULL, dx + n * xs.n + ih * xs.h + iw * xs.w)


cdef inline Py_ssize_t aligned_head(const ConvGeom* g, const real* x,
                                    ImageStrides xs) noexcept nogil:
    # The channels before the first vector-aligned one of every input
    # pixel (the same for all when the strides are whole vectors), for the
    # 3x3 row kernel; 0 where it would not pay: aligned already, or fewer
    # than 4 vectors of channels (two more vectors a pass).
    cdef Py_ssize_t VL = VBYTES // sizeof(real)
    if (g.C < 4 * VL or xs.w % VL or xs.h % VL or xs.n % VL
            or (<size_t>x) % sizeof(real)):
        return 0
    return (VL - (<size_t>x) // sizeof(real) % VL) % VL


cdef bint depthwise_forward_nogil(const ConvGeom* g, Py_ssize_t mult,
                                  const real* x, ImageStrides xs, const real* w,
                                  const real* bias, real* y, int act,
                                  int max_threads) noexcept nogil:
    # y (N, OH, OW, C*mult), contiguous.  Returns whether the activation
    # was applied (the 3x3 row kernel fuses it; the caller clamps y after
    # the other paths).
    cdef Py_ssize_t OC = g.C * mult
    cdef int nt = threads_for(2.0 * DEPTHWISE_FLOP_COST * g.N * g.OH * g.OW * OC * g.KH * g.KW, max_threads)
    cdef Py_ssize_t row, n, oh, ow, kh, kw, ih, c
    cdef RowRange cols
    cdef real* yrow
    cdef bint stream
    cdef Py_ssize_t head = 0
    if mult == 1 and g.KH == 3 and g.KW == 3:
        # A large output streams past the caches: it is written once, in
        # whole aligned lines when C fills them.  Past 8x the
        # GEMM's threshold (can_stream), 8 MiB: in a loop of calls a smaller
        # one comes back from L3 (Zen 4, 2 threads, 576 @14 batch 8, a 3.6
        # MB output: 134 us streamed, 110 stored).  Only where a pass stores
        # whole cache lines (FC_DW3_CAN_STREAM) and the channels fill whole
        # lines (no pass of a lone vector).
        stream = (FC_DW3_CAN_STREAM and g.N * g.OH * g.OW * OC * <Py_ssize_t>sizeof(real)
                  > DEPTHWISE_STREAM_FACTOR * stream_bytes
                  and (OC * <Py_ssize_t>sizeof(real)) % 64 == 0 and (<size_t>y) % 64 == 0)
        if not stream:
            # (Streamed vectors are y's, aligned; then the loads stay as
            # they fall.)
            head = aligned_head(g, x, xs)
        for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
            depthwise3x3_forward_row(g, x, xs, w, bias, y, row, act, stream, head)
            if stream and row % (g.N * g.OH) == g.N * g.OH - 1:
                fc_store_fence()
        if stream:
            for row in prange(nt, num_threads=nt, schedule="static"):
                fc_store_fence()
        return True
    if mult == 1 and g.KH * g.KW <= MAX_DEPTHWISE_TAPS:
        for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
            depthwise_forward_row(g, x, xs, w, bias, y, row)
        return False
    for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
        n = row // g.OH
        oh = row - n * g.OH
        yrow = y + row * g.OW * OC
        for ow in range(g.OW):
            for c in range(OC):
                yrow[ow * OC + c] = 0 if bias == NULL else bias[c]
        for kh in range(g.KH):
            ih = oh * g.SH - g.PT + kh * g.DH
            if 0 <= ih < g.H:
                for kw in range(g.KW):
                    cols = valid_outputs(g.W, g.OW, kw * g.DW - g.PL, g.SW)
                    depthwise_tap_row(x + n * xs.n + ih * xs.h, xs.w, w + (kh * g.KW + kw) * OC,
                                      yrow, cols.lo, cols.hi, kw * g.DW - g.PL, g.SW, g.C, mult)
    return False


cdef void depthwise_grad_input_nogil(const ConvGeom* g, Py_ssize_t mult,
                                     const real* dy, const real* w, real* dx,
                                     ImageStrides xs, int max_threads) noexcept nogil:
    # dx (zeroed by the caller) += the adjoint of the forward; dy contiguous.
    cdef Py_ssize_t OC = g.C * mult
    cdef int nt = threads_for(2.0 * DEPTHWISE_FLOP_COST * g.N * g.OH * g.OW * OC * g.KH * g.KW, max_threads)
    cdef Py_ssize_t row, n, ih, kh, kw, t, oh, ow, iw, c, j
    cdef RowRange cols
    cdef const real* dyp
    cdef const real* wp
    cdef real* dxp
    cdef real s
    if mult == 1 and g.KH * g.KW <= MAX_DEPTHWISE_TAPS:
        for row in prange(g.N * g.H, num_threads=nt, schedule="static"):
            depthwise_grad_input_row(g, dy, w, dx, xs, row)
        return
    for row in prange(g.N * g.H, num_threads=nt, schedule="static"):
        n = row // g.H
        ih = row - n * g.H
        for kh in range(g.KH):
            t = ih + g.PT - kh * g.DH
            if t >= 0 and t % g.SH == 0 and t // g.SH < g.OH:
                oh = t // g.SH
                for kw in range(g.KW):
                    wp = w + (kh * g.KW + kw) * OC
                    cols = valid_outputs(g.W, g.OW, kw * g.DW - g.PL, g.SW)
                    for ow in range(cols.lo, cols.hi):
                        iw = ow * g.SW - g.PL + kw * g.DW
                        dyp = dy + ((n * g.OH + oh) * g.OW + ow) * OC
                        dxp = dx + n * xs.n + ih * xs.h + iw * xs.w
                        if mult == 1:
                            for c in range(g.C):
                                dxp[c] += dyp[c] * wp[c]
                        else:
                            for c in range(g.C):
                                s = 0
                                for j in range(mult):
                                    s = s + dyp[c * mult + j] * wp[c * mult + j]
                                dxp[c] += s


cdef int depthwise_grad_weight_nogil(const ConvGeom* g, Py_ssize_t mult,
                                     const real* x, ImageStrides xs, const real* dy,
                                     real* dw, int max_threads) noexcept nogil:
    # dw (KH, KW, OC), overwritten; dy contiguous.
    cdef Py_ssize_t OC = g.C * mult, taps = g.KH * g.KW * OC
    cdef int nt = threads_for(2.0 * DEPTHWISE_FLOP_COST * g.N * g.OH * g.OW * OC * g.KH * g.KW, max_threads)
    cdef real* partials = <real*>aligned_malloc(nt * taps * sizeof(real))
    if partials == NULL:
        return -1
    memset(partials, 0, nt * taps * sizeof(real))
    cdef Py_ssize_t i, t, task, rb, n_rb, n_cb, blk, c0
    if mult == 1 and g.KH == 3 and g.KW == 3:
        # Tasks of an image's rows (about DW_GRADW_PIXELS pixels) by
        # DW_GRADW_CHANNELS channels: long runs for each channel vector's
        # sums, enough tasks for the threads at batch 1 too.
        rb = max(1, min(min(g.OH, DW_GRADW_MAX_ROWS), DW_GRADW_PIXELS // max(1, g.OW)))
        n_rb = cdiv(g.OH, rb)
        n_cb = cdiv(g.C, DW_GRADW_CHANNELS)
        for task in prange(g.N * n_rb * n_cb, num_threads=nt, schedule="static"):
            blk = task // n_cb
            c0 = task % n_cb * DW_GRADW_CHANNELS
            depthwise3x3_grad_weight_block(g, x, xs, dy, partials + threadid() * taps,
                                           blk // n_rb * g.OH + blk % n_rb * rb,
                                           min(rb, g.OH - blk % n_rb * rb), c0,
                                           min(DW_GRADW_CHANNELS, g.C - c0))
    else:
        depthwise_grad_weight_rows(g, mult, x, xs, dy, partials, nt)
    for i in range(taps):
        dw[i] = partials[i]
    for t in range(1, nt):
        for i in range(taps):
            dw[i] += partials[t * taps + i]
    aligned_free(partials)
    return 0


cdef void depthwise_grad_weight_rows(const ConvGeom* g, Py_ssize_t mult, const real* x,
                                     ImageStrides xs, const real* dy, real* partials,
                                     int nt) noexcept nogil:
    # The generic loops: thread t adds into partials + t * (KH*KW*OC).
    cdef Py_ssize_t OC = g.C * mult, taps = g.KH * g.KW * OC
    cdef Py_ssize_t row, n, oh, kh, kw, ih, ow, iw, c, j
    cdef RowRange cols
    cdef const real* dyp
    cdef const real* xp
    cdef real* acc
    for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
        n = row // g.OH
        oh = row - n * g.OH
        for kh in range(g.KH):
            ih = oh * g.SH - g.PT + kh * g.DH
            if 0 <= ih < g.H:
                for kw in range(g.KW):
                    acc = partials + threadid() * taps + (kh * g.KW + kw) * OC
                    cols = valid_outputs(g.W, g.OW, kw * g.DW - g.PL, g.SW)
                    for ow in range(cols.lo, cols.hi):
                        iw = ow * g.SW - g.PL + kw * g.DW
                        dyp = dy + (row * g.OW + ow) * OC
                        xp = x + n * xs.n + ih * xs.h + iw * xs.w
                        if mult == 1:
                            for c in range(g.C):
                                acc[c] += dyp[c] * xp[c]
                        else:
                            for c in range(g.C):
                                for j in range(mult):
                                    acc[c * mult + j] += dyp[c * mult + j] * xp[c]


def depthwise_forward(const real[:, :, :, :] x, const real[:, :, ::1] w, bias,
                      real[:, :, :, ::1] y, kernel, stride, dilation, pad_before,
                      int num_threads, int activation=ACT_NONE):
    """y = depthwise conv of NHWC x with w (KH, KW, OC), OC = C * multiplier,
    plus bias (None or a contiguous (OC,) array); y (N, OH, OW, OC)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, (y.shape[1], y.shape[2]))
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef const real[::1] bias_view
    cdef const real* bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        bias_ptr = &bias_view[0]
    cdef bint fused
    with nogil:
        fused = depthwise_forward_nogil(&g, y.shape[3] // x.shape[3], &x[0, 0, 0, 0], xs,
                                        &w[0, 0, 0], bias_ptr, &y[0, 0, 0, 0], activation,
                                        num_threads)
        if activation != ACT_NONE and not fused:
            clamp_tile(&y[0, 0, 0, 0], y.shape[3], 1, y.shape[0] * y.shape[1] * y.shape[2],
                       y.shape[3], activation)


def depthwise_grad_input(const real[:, :, :, ::1] dy, const real[:, :, ::1] w,
                         real[:, :, :, :] dx, kernel, stride, dilation, pad_before,
                         int num_threads):
    """dx += the input gradient of depthwise_forward for dy (N, OH, OW, OC)."""
    check_unit_stride(dx.shape[3], dx.strides[3], sizeof(real), "dx")
    cdef ConvGeom g = make_geom(dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3],
                                kernel, stride, dilation, pad_before, (dy.shape[1], dy.shape[2]))
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(dx.strides[0], dx.strides[1], dx.strides[2], item)
    with nogil:
        depthwise_grad_input_nogil(&g, dy.shape[3] // dx.shape[3], &dy[0, 0, 0, 0],
                                   &w[0, 0, 0], &dx[0, 0, 0, 0], xs, num_threads)


def depthwise_grad_weight(const real[:, :, :, :] x, const real[:, :, :, ::1] dy,
                          real[:, :, ::1] dw, kernel, stride, dilation, pad_before,
                          int num_threads):
    """dw (KH, KW, OC) = the weight gradient of depthwise_forward."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, (dy.shape[1], dy.shape[2]))
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef int status
    with nogil:
        status = depthwise_grad_weight_nogil(&g, dy.shape[3] // x.shape[3], &x[0, 0, 0, 0], xs,
                                             &dy[0, 0, 0, 0], &dw[0, 0, 0], num_threads)
    if status != 0:
        raise MemoryError("depthwise grad weight: could not allocate per-thread partials")
