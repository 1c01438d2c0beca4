# Max pooling of NHWC images and its input gradient, included after
# conv_frame.pxi by the per-ISA modules (for fastconv.nn.MaxPool2d).  The
# forward is memory-bound: one pass over the input, vectorised over
# channels, threads over output rows.  The numpy version it replaces (a max
# over KH*KW strided views of a -inf-padded copy) took 1.27 ms for
# ResNet-18's 3x3/2 pool at batch 1, most of it copies.

from libc.stdint cimport uint16_t
from libc.math cimport INFINITY

cdef extern from *:
    """
    #include "micro_kernel.h"       /* FC_VBYTES, FC_UNROLL */

    /* y[c] = the max over ntaps input pixels taps[t][c], c < n, and -inf
       (the padding): ties keep the earlier tap, a NaN wins (the last one, as
       numpy's maximum propagates it); winner[c], when winner is not NULL, =
       the winning tap's ids[t], or where no tap beats -inf the first tap's,
       ids[0], as torch's max pool picks the first tap inside the image (0
       without taps).  Four vectors of channels (and their winners) stay in
       registers across the taps, as in the depthwise kernel: a pass per tap
       that reloaded and stored y each time, a chain through memory, held
       ResNet-18's 3x3/2 pool at batch 1 (112x112x64) to 120 us standalone.
       In C for restrict and vectors: Cython's loop on two real* it could not
       prove apart stayed scalar.  Inlined at call sites that pass NULL, the
       winner code folds away. */
    #define FC_DEFINE_MAX_TAPS(SUFFIX, T, IT)                                  \
        typedef T fc_poolvec_##SUFFIX __attribute__((vector_size(FC_VBYTES))); \
        typedef IT fc_poolmask_##SUFFIX __attribute__((vector_size(FC_VBYTES)));\
        static inline fc_poolmask_##SUFFIX fc_max_vec_##SUFFIX(               \
            fc_poolvec_##SUFFIX *cur, fc_poolvec_##SUFFIX v)                  \
        {                                                                     \
            fc_poolmask_##SUFFIX take = (v > *cur) | (v != v);                \
            *cur = (fc_poolvec_##SUFFIX)(((fc_poolmask_##SUFFIX)v & take)     \
                                         | ((fc_poolmask_##SUFFIX)*cur & ~take)); \
            return take;                                                      \
        }                                                                     \
        static inline void fc_store_winners_##SUFFIX(uint16_t *w,             \
                                                     fc_poolmask_##SUFFIX idx) \
        {                                                                     \
            FC_UNROLL for (int l = 0; l < FC_VBYTES / (int)sizeof(T); l++)    \
                w[l] = (uint16_t)idx[l];                                      \
        }                                                                     \
        static inline void fc_max_taps_##SUFFIX(T *restrict y,                \
                                                uint16_t *restrict winner,    \
                                                const T *const *taps,         \
                                                const int *ids,               \
                                                ptrdiff_t ntaps, ptrdiff_t n) \
        {                                                                     \
            typedef fc_poolvec_##SUFFIX vec;                                  \
            typedef fc_poolmask_##SUFFIX mask;                                \
            enum { VL = FC_VBYTES / sizeof(T) };                              \
            const T neg_inf = -(T)INFINITY;                                   \
            const int first = ntaps > 0 ? ids[0] : 0;                         \
            ptrdiff_t c = 0;                                                  \
            for (; c + 4 * VL <= n; c += 4 * VL) {                            \
                vec acc[4], v;                                                \
                mask idx[4];                                                  \
                FC_UNROLL for (int u = 0; u < 4; u++) {                       \
                    acc[u] = neg_inf - (vec){0};                              \
                    idx[u] = (IT)first - (mask){0};                           \
                }                                                             \
                for (ptrdiff_t t = 0; t < ntaps; t++)                         \
                    FC_UNROLL for (int u = 0; u < 4; u++) {                   \
                        memcpy(&v, taps[t] + c + u * VL, FC_VBYTES);          \
                        mask take = fc_max_vec_##SUFFIX(&acc[u], v);          \
                        if (winner)                                           \
                            idx[u] = (idx[u] & ~take) | ((IT)ids[t] & take);  \
                    }                                                         \
                FC_UNROLL for (int u = 0; u < 4; u++) {                       \
                    memcpy(y + c + u * VL, &acc[u], FC_VBYTES);               \
                    if (winner)                                               \
                        fc_store_winners_##SUFFIX(winner + c + u * VL, idx[u]); \
                }                                                             \
            }                                                                 \
            for (; c + VL <= n; c += VL) {                                    \
                vec acc = neg_inf - (vec){0}, v;                              \
                mask idx = (IT)first - (mask){0};                             \
                for (ptrdiff_t t = 0; t < ntaps; t++) {                       \
                    memcpy(&v, taps[t] + c, FC_VBYTES);                       \
                    mask take = fc_max_vec_##SUFFIX(&acc, v);                 \
                    if (winner)                                               \
                        idx = (idx & ~take) | ((IT)ids[t] & take);            \
                }                                                             \
                memcpy(y + c, &acc, FC_VBYTES);                               \
                if (winner)                                                   \
                    fc_store_winners_##SUFFIX(winner + c, idx);               \
            }                                                                 \
            for (; c < n; c++) {                                              \
                T cur = neg_inf;                                              \
                int id = first;                                               \
                for (ptrdiff_t t = 0; t < ntaps; t++) {                       \
                    T v = taps[t][c];                                         \
                    if (v > cur || v != v) {                                  \
                        cur = v;                                              \
                        id = ids[t];                                          \
                    }                                                         \
                }                                                             \
                y[c] = cur;                                                   \
                if (winner)                                                   \
                    winner[c] = (uint16_t)id;                                 \
            }                                                                 \
        }
    FC_DEFINE_MAX_TAPS(f32, float, int32_t)
    FC_DEFINE_MAX_TAPS(f64, double, int64_t)
    """
    void fc_max_taps_f32(float* y, uint16_t* winner, const float* const* taps,
                         const int* ids, Py_ssize_t ntaps, Py_ssize_t n) noexcept nogil
    void fc_max_taps_f64(double* y, uint16_t* winner, const double* const* taps,
                         const int* ids, Py_ssize_t ntaps, Py_ssize_t n) noexcept nogil


cdef void max_pool_row(const ConvGeom* g, const real* x, ImageStrides xs, Py_ssize_t n,
                       Py_ssize_t oh, real* y, uint16_t* winner, const real** taps,
                       int* ids) noexcept nogil:
    # Output row (n, oh): every pixel's max over its taps inside the image
    # (fc_max_taps; the padding is -inf), and, when winner is not NULL, the
    # winning tap's index.  taps and ids: room for KH*KW entries, the
    # calling thread's own.
    cdef Py_ssize_t ow, kh, kw, ih, iw, ntaps, at
    for ow in range(g.OW):
        ntaps = 0
        for kh in range(g.KH):
            ih = oh * g.SH - g.PT + kh * g.DH
            if ih < 0 or ih >= g.H:
                continue
            for kw in range(g.KW):
                iw = ow * g.SW - g.PL + kw * g.DW
                if 0 <= iw < g.W:
                    taps[ntaps] = x + n * xs.n + ih * xs.h + iw * xs.w
                    ids[ntaps] = kh * g.KW + kw
                    ntaps += 1
        at = ((n * g.OH + oh) * g.OW + ow) * g.C
        # Two calls, so that the inference one inlines without the winners.
        if winner == NULL:
            if real is float:
                fc_max_taps_f32(y + at, NULL, taps, ids, ntaps, g.C)
            else:
                fc_max_taps_f64(y + at, NULL, taps, ids, ntaps, g.C)
        elif real is float:
            fc_max_taps_f32(y + at, winner + at, taps, ids, ntaps, g.C)
        else:
            fc_max_taps_f64(y + at, winner + at, taps, ids, ntaps, g.C)


def max_pool2d(const real[:, :, :, :] x, real[:, :, :, ::1] y, winner, kernel, stride,
               dilation, pad_before, int num_threads):
    """y[n, oh, ow, c] = max over the taps of the window (NHWC x with
    contiguous channels, y contiguous); winner None or a contiguous uint16
    array of y's shape, set to each maximum's tap index (kh*KW + kw)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], x.shape[3],
                                kernel, stride, dilation, pad_before, (y.shape[1], y.shape[2]))
    if y.shape[0] != g.N or y.shape[3] != g.C:
        raise ValueError(f"y must have shape ({g.N}, OH, OW, {g.C}); got {tuple(y.shape)}")
    if g.KH * g.KW > 65535:
        raise ValueError("max_pool2d: at most 65535 taps (the winner index is 16-bit)")
    cdef uint16_t[:, :, :, ::1] winner_view
    cdef uint16_t* winner_ptr = NULL
    if winner is not None:
        winner_view = winner
        if (winner_view.shape[0] != y.shape[0] or winner_view.shape[1] != y.shape[1]
                or winner_view.shape[2] != y.shape[2] or winner_view.shape[3] != y.shape[3]):
            raise ValueError("winner must have y's shape")
        winner_ptr = &winner_view[0, 0, 0, 0]
    if y.shape[0] * y.shape[1] * y.shape[2] * y.shape[3] == 0 or x.shape[1] * x.shape[2] == 0:
        return
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], sizeof(real))
    cdef Py_ssize_t elements = g.N * g.OH * g.OW * g.C * g.KH * g.KW
    cdef int nt = max(1, min(num_threads, <int>(elements // COPY_ELEMENTS_PER_THREAD)))
    # Each thread's tap pointers and indices for one pixel, in cache lines
    # of its own: tables sharing a line, rewritten every pixel by both
    # threads, made the 3x3/2 pool at batch 1 twice as slow.
    cdef Py_ssize_t row, T = g.KH * g.KW
    cdef Py_ssize_t sp = cdiv(T * sizeof(real*), 64) * 64, si = cdiv(T * sizeof(int), 64) * 64
    cdef char* tables = <char*>aligned_malloc(nt * (sp + si))
    if tables == NULL:
        raise MemoryError("max_pool2d: out of memory for the tap tables")
    with nogil:
        for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
            max_pool_row(&g, &x[0, 0, 0, 0], xs, row // g.OH, row % g.OH, &y[0, 0, 0, 0],
                         winner_ptr, <const real**>(tables + threadid() * (sp + si)),
                         <int*>(tables + threadid() * (sp + si) + sp))
    aligned_free(tables)


cdef void max_pool_grad_row(const ConvGeom* g, const real* dy, const uint16_t* winner,
                            Py_ssize_t n, Py_ssize_t oh, real* dx) noexcept nogil:
    # dx += output row (n, oh)'s gradient, each value onto the input pixel
    # its window's winning tap read (none when that tap was in the padding).
    cdef Py_ssize_t ow, c, tap, ih, iw, base = (n * g.OH + oh) * g.OW * g.C
    cdef const real* dyp
    cdef const uint16_t* wp
    for ow in range(g.OW):
        dyp = dy + base + ow * g.C
        wp = winner + base + ow * g.C
        for c in range(g.C):
            tap = wp[c]
            ih = oh * g.SH - g.PT + (tap // g.KW) * g.DH
            iw = ow * g.SW - g.PL + (tap % g.KW) * g.DW
            if 0 <= ih < g.H and 0 <= iw < g.W:
                dx[((n * g.H + ih) * g.W + iw) * g.C + c] += dyp[c]


def max_pool2d_backward(const real[:, :, :, ::1] dy, const uint16_t[:, :, :, ::1] winner,
                        real[:, :, :, ::1] dx, kernel, stride, dilation, pad_before,
                        int num_threads):
    """dx += the input gradient of max_pool2d for dy: each dy value onto the
    pixel its window's winning tap (winner, from max_pool2d) read.  dy and
    winner (N, OH, OW, C), dx (N, H, W, C), all contiguous."""
    cdef ConvGeom g = make_geom(dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3],
                                kernel, stride, dilation, pad_before, (dy.shape[1], dy.shape[2]))
    if dy.shape[0] != g.N or dy.shape[3] != g.C:
        raise ValueError(f"dy must have shape ({g.N}, OH, OW, {g.C}); got {tuple(dy.shape)}")
    if (winner.shape[0] != dy.shape[0] or winner.shape[1] != dy.shape[1]
            or winner.shape[2] != dy.shape[2] or winner.shape[3] != dy.shape[3]):
        raise ValueError("winner must have dy's shape")
    if dy.shape[0] * dy.shape[1] * dy.shape[2] * dy.shape[3] == 0:
        return
    cdef Py_ssize_t elements = g.N * g.OH * g.OW * g.C
    cdef int nt = max(1, min(num_threads, <int>(elements // COPY_ELEMENTS_PER_THREAD)))
    cdef bint disjoint = windows_disjoint(&g)
    cdef Py_ssize_t task, oh
    with nogil:
        if disjoint:
            # No two windows share a pixel: output rows are independent.
            for task in prange(g.N * g.OH, num_threads=nt, schedule="static"):
                max_pool_grad_row(&g, &dy[0, 0, 0, 0], &winner[0, 0, 0, 0], task // g.OH,
                                  task % g.OH, &dx[0, 0, 0, 0])
        else:
            # Overlapping windows (3x3/2) add into shared pixels: a thread
            # per image.
            for task in prange(g.N, num_threads=nt, schedule="static"):
                for oh in range(g.OH):
                    max_pool_grad_row(&g, &dy[0, 0, 0, 0], &winner[0, 0, 0, 0], task, oh,
                                      &dx[0, 0, 0, 0])
