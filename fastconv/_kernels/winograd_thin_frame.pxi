# Winograd F(2x2, 3x3) for thin layers (at most WINO_THIN_MAX_C input
# channels, stride 1, dilation 1), included after winograd_frame.pxi, whose
# winograd_forward_nogil hands it F(2x2) calls with such a geometry.  The
# kernels and why they look as they do: winograd_thin_kernel.h.
#
# Threads take bands of two output rows (the static schedule gives each an
# equal run of them); each transforms its band's input a chunk of tiles at
# a time into its own V (16 KiB), then runs every vector of output channels
# over the chunk.  The filters are transformed once per call, shared.

cdef extern from "winograd_thin_kernel.h":
    enum:
        WINO_THIN_MAX_C "FC_WINO_THIN_MAX_C"
        WINO_THIN_ROW_BYTES "FC_WINO_THIN_ROW_BYTES"
    Py_ssize_t fc_wino_thin_chunk_tiles(Py_ssize_t C, size_t item) noexcept nogil
    Py_ssize_t fc_wino_thin_window_ld(Py_ssize_t C, Py_ssize_t nt) noexcept nogil
    void fc_wino_thin_filter_f32(const float* w, Py_ssize_t rsw, Py_ssize_t C, Py_ssize_t OC,
                                 int flipped, float* u) noexcept nogil
    void fc_wino_thin_filter_f64(const double* w, Py_ssize_t rsw, Py_ssize_t C, Py_ssize_t OC,
                                 int flipped, double* u) noexcept nogil
    void fc_wino_thin_window_f32(const float* x, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t H,
                                 Py_ssize_t W, Py_ssize_t C, Py_ssize_t ih0, Py_ssize_t iw0,
                                 Py_ssize_t nt, float* d, float* t, float* v) noexcept nogil
    void fc_wino_thin_window_f64(const double* x, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t H,
                                 Py_ssize_t W, Py_ssize_t C, Py_ssize_t ih0, Py_ssize_t iw0,
                                 Py_ssize_t nt, double* d, double* t, double* v) noexcept nogil
    void fc_wino_thin_tiles_f32(Py_ssize_t C, Py_ssize_t nt, const float* v, const float* u,
                                float* y, Py_ssize_t syw, Py_ssize_t syh, const float* bias,
                                int act, int flags, int rows, int cols, int lanes) noexcept nogil
    void fc_wino_thin_tiles_f64(Py_ssize_t C, Py_ssize_t nt, const double* v, const double* u,
                                double* y, Py_ssize_t syw, Py_ssize_t syh, const double* bias,
                                int act, int flags, int rows, int cols, int lanes) noexcept nogil


cdef inline bint wino_thin_applies(const ConvGeom* g) noexcept nogil:
    return 1 <= g.C <= WINO_THIN_MAX_C and g.DH == 1 and g.DW == 1


def winograd_thin_max_channels():
    """Most input channels of the thin Winograd path (winograd_thin_kernel.h):
    conv2d_winograd(tile=2) of a 3x3 stride-1 undilated layer with this few
    takes it, without packed filters."""
    return WINO_THIN_MAX_C


cdef int winograd_thin_nogil(const ConvGeom* g, const real* x, ImageStrides xs,
                             const real* w, Py_ssize_t rsw, Py_ssize_t OC,
                             const real* bias, int act, real* y, Py_ssize_t rsy, int nt,
                             bint flipped, bint accumulate) noexcept nogil:
    # winograd_forward_nogil's contract for tile 2, wino_thin_applies(g),
    # filters transformed here (flipped: from the weight of the convolution
    # whose input gradient this is).
    cdef Py_ssize_t VL = VBYTES // sizeof(real), C = g.C
    cdef Py_ssize_t nvec = cdiv(OC, VL), u_size = 16 * C * nvec * VL
    cdef Py_ssize_t chunk = fc_wino_thin_chunk_tiles(C, sizeof(real))
    cdef Py_ssize_t ld = fc_wino_thin_window_ld(C, chunk)
    cdef Py_ssize_t ldw = cdiv(ld, VL) * VL
    # per thread: d and t (4 rows of ld each), then V's 16 rows
    cdef Py_ssize_t per_thread = 8 * ldw + 16 * (WINO_THIN_ROW_BYTES // sizeof(real))
    cdef real* u = <real*>aligned_malloc((u_size + nvec * VL) * sizeof(real))
    cdef real* ws = <real*>aligned_malloc(nt * per_thread * sizeof(real))
    if u == NULL or ws == NULL:
        aligned_free(u)
        aligned_free(ws)
        return -1
    if real is float:
        fc_wino_thin_filter_f32(w, rsw, C, OC, flipped, u)
    else:
        fc_wino_thin_filter_f64(w, rsw, C, OC, flipped, u)
    # The bias padded to whole vectors (zeros without one), after U: the
    # kernels add a whole vector of it unconditionally.
    cdef real* bias_pad = u + u_size
    cdef Py_ssize_t i
    for i in range(nvec * VL):
        bias_pad[i] = bias[i] if bias != NULL and i < OC else 0
    cdef int flags = OUT_ADD if accumulate else 0
    if (OC % VL == 0 and (<size_t>y) % VBYTES == 0
            and can_stream(g.N * g.OH * g.OW, OC, 1, <real>accumulate, rsy, 1)):
        flags = OUT_STREAM
    cdef Py_ssize_t bands_h = cdiv(g.OH, 2), tiles_w = cdiv(g.OW, 2)
    cdef Py_ssize_t band, n, oh0, j0, ntile, q
    cdef int rows, cols
    cdef real* d
    cdef real* vbuf
    cdef real* yb
    for band in prange(g.N * bands_h, num_threads=nt, schedule="static"):
        d = ws + threadid() * per_thread
        vbuf = d + 8 * ldw
        n = band // bands_h
        oh0 = 2 * (band % bands_h)
        rows = <int>min(2, g.OH - oh0)
        j0 = 0
        while j0 < tiles_w:
            ntile = min(chunk, tiles_w - j0)
            cols = <int>min(2, g.OW - 2 * (j0 + ntile - 1))
            if real is float:
                fc_wino_thin_window_f32(x + n * xs.n, xs.h, xs.w, g.H, g.W, C, oh0 - g.PT,
                                        2 * j0 - g.PL, ntile, d, d + 4 * ldw, vbuf)
            else:
                fc_wino_thin_window_f64(x + n * xs.n, xs.h, xs.w, g.H, g.W, C, oh0 - g.PT,
                                        2 * j0 - g.PL, ntile, d, d + 4 * ldw, vbuf)
            yb = y + ((n * g.OH + oh0) * g.OW + 2 * j0) * rsy
            for q in range(nvec):
                if real is float:
                    fc_wino_thin_tiles_f32(C, ntile, vbuf, u + q * 16 * C * VL, yb + q * VL,
                                           rsy, g.OW * rsy, bias_pad + q * VL,
                                           act, flags, rows, cols, <int>min(VL, OC - q * VL))
                else:
                    fc_wino_thin_tiles_f64(C, ntile, vbuf, u + q * 16 * C * VL, yb + q * VL,
                                           rsy, g.OW * rsy, bias_pad + q * VL,
                                           act, flags, rows, cols, <int>min(VL, OC - q * VL))
            j0 = j0 + ntile
        if flags & OUT_STREAM:
            fc_store_fence()         # this thread's streamed band, ordered
    aligned_free(u)
    aligned_free(ws)
    return 0
