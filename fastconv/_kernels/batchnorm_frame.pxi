# Batch normalisation over the channels of NHWC images, as (pixels,
# channels) rows with contiguous channels (for fastconv.nn.BatchNorm2d);
# included by the per-ISA modules after conv_frame.pxi.  In numpy a training
# step's batch norm was ten or so passes over the activations, each with a
# temporary and a call's overhead, its float64 sums through casts (with
# these passes examples/train_digits.py's epoch took a quarter less time).
# Here each reduction is one pass that sums every channel in float64
# vectors, and each element-wise map is one pass, vectorised over channels.
#
# The sums do not depend on the thread count: pixels are summed in fixed
# blocks of BN_BLOCK_PIXELS, and the blocks' partial sums added in block
# order.

cdef enum:
    BN_BLOCK_PIXELS = 256


cdef inline int bn_threads(Py_ssize_t elements, int num_threads) noexcept nogil:
    # Memory-bound passes: a thread per COPY_ELEMENTS_PER_THREAD at most.
    return max(1, min(num_threads, <int>(elements // COPY_ELEMENTS_PER_THREAD)))


cdef void sum_block(const real* a, const real* b, const double* center, Py_ssize_t p0,
                    Py_ssize_t p1, Py_ssize_t C, double* s1, double* s2) noexcept nogil:
    # Over rows p0..p1 (s1, s2 start at zero): with center, s1 = sum of
    # (a - center)^2; else s1 = sum of a and, with b, s2 = sum of a * b.
    cdef Py_ssize_t p, c
    cdef const real* row
    cdef const real* brow
    cdef double d
    for p in range(p0, p1):
        row = a + p * C
        if center != NULL:
            for c in range(C):
                d = row[c] - center[c]
                s1[c] += d * d
        elif b != NULL:
            brow = b + p * C
            for c in range(C):
                s1[c] += row[c]
                s2[c] += <double>row[c] * brow[c]
        else:
            for c in range(C):
                s1[c] += row[c]


cdef int channel_sums_nogil(const real* a, const real* b, const double* center, Py_ssize_t P,
                            Py_ssize_t C, double* s1, double* s2, int max_threads) noexcept nogil:
    # sum_block over all P rows, in fixed blocks; -1 when out of memory.
    cdef Py_ssize_t n_blocks = cdiv(P, BN_BLOCK_PIXELS), blk, c, p0
    cdef double* partial = <double*>aligned_malloc(n_blocks * 2 * C * sizeof(double))
    if partial == NULL:
        return -1
    cdef int nt = bn_threads(P * C, max_threads)
    cdef double* mine
    for blk in prange(n_blocks, num_threads=nt, schedule="static"):
        mine = partial + blk * 2 * C
        for c in range(2 * C):
            mine[c] = 0
        p0 = blk * BN_BLOCK_PIXELS
        sum_block(a, b, center, p0, min(P, p0 + BN_BLOCK_PIXELS), C, mine, mine + C)
    for c in range(C):
        s1[c] = 0
        s2[c] = 0
    for blk in range(n_blocks):
        mine = partial + blk * 2 * C
        for c in range(C):
            s1[c] += mine[c]
            s2[c] += mine[C + c]
    aligned_free(partial)
    return 0


def channel_sums(const real[:, ::1] a, b, center, double[::1] s1, double[::1] s2,
                 int num_threads):
    """Per channel (column) of a, in float64: s1 = sum of (a - center)^2
    when center (float64, (C,)) is given, else s1 = sum of a and s2 = sum
    of a * b (b: None, or a's shape and dtype); s2 = 0 without b."""
    cdef Py_ssize_t P = a.shape[0], C = a.shape[1]
    cdef const real[:, ::1] b_view
    cdef const double[::1] center_view
    cdef const real* b_ptr = NULL
    cdef const double* center_ptr = NULL
    if s1.shape[0] != C or s2.shape[0] != C:
        raise ValueError(f"s1 and s2 must have shape ({C},)")
    if b is not None:
        b_view = b
        if b_view.shape[0] != P or b_view.shape[1] != C:
            raise ValueError("b must have a's shape")
        b_ptr = &b_view[0, 0] if P * C else NULL
    if center is not None:
        center_view = center
        if center_view.shape[0] != C:
            raise ValueError(f"center must have shape ({C},)")
        center_ptr = &center_view[0] if C else NULL
    if P * C == 0:
        s1[:] = 0
        s2[:] = 0
        return
    cdef int status
    with nogil:
        status = channel_sums_nogil(&a[0, 0], b_ptr, center_ptr, P, C, &s1[0], &s2[0],
                                    num_threads)
    if status != 0:
        raise MemoryError("channel_sums: out of memory for the partial sums")


def batchnorm_normalize(const real[:, ::1] x, const double[::1] mean,
                        const double[::1] inv_std, real[:, ::1] normalized, weight, bias, y,
                        int num_threads):
    """normalized = (x - mean) * inv_std per channel, in float64 (a float32
    x - mean with the mean rounded to float32 loses digits where the mean
    is large against the spread) and, with weight and bias ((C,) arrays of
    x's dtype, or None), y = normalized * weight + bias."""
    cdef Py_ssize_t P = x.shape[0], C = x.shape[1], p, c
    cdef const real[::1] w_view, b_view
    cdef real[:, ::1] y_view
    cdef const real* w = NULL
    cdef const real* bb = NULL
    cdef real* yp = NULL
    if mean.shape[0] != C or inv_std.shape[0] != C:
        raise ValueError(f"mean and inv_std must have shape ({C},)")
    if normalized.shape[0] != P or normalized.shape[1] != C:
        raise ValueError("normalized must have x's shape")
    if weight is not None:
        w_view, b_view, y_view = weight, bias, y
        if w_view.shape[0] != C or b_view.shape[0] != C:
            raise ValueError(f"weight and bias must have shape ({C},)")
        if y_view.shape[0] != P or y_view.shape[1] != C:
            raise ValueError("y must have x's shape")
    if P * C == 0:
        return
    if weight is not None:
        w, bb, yp = &w_view[0], &b_view[0], &y_view[0, 0]
    cdef const real* xr
    cdef real* nr
    cdef real* yr
    cdef int nt = bn_threads(P * C, num_threads)
    with nogil:
        for p in prange(P, num_threads=nt, schedule="static"):
            xr = &x[p, 0]
            nr = &normalized[p, 0]
            for c in range(C):
                nr[c] = <real>((xr[c] - mean[c]) * inv_std[c])
            if yp != NULL:
                yr = yp + p * C
                for c in range(C):
                    yr[c] = nr[c] * w[c] + bb[c]


def batchnorm_input_grad(const real[:, ::1] grad, const real[:, ::1] normalized,
                         const real[::1] grad_mean, const real[::1] projection,
                         const real[::1] scale, real[:, ::1] out, int num_threads):
    """out = (grad - grad_mean - normalized * projection) * scale, per
    channel: the input gradient of a batch-statistics batch norm (grad_mean
    the per-channel mean of grad, projection that of grad * normalized,
    scale weight * inv_std)."""
    cdef Py_ssize_t P = grad.shape[0], C = grad.shape[1], p, c
    if (normalized.shape[0] != P or normalized.shape[1] != C or out.shape[0] != P
            or out.shape[1] != C):
        raise ValueError("normalized and out must have grad's shape")
    if grad_mean.shape[0] != C or projection.shape[0] != C or scale.shape[0] != C:
        raise ValueError(f"grad_mean, projection and scale must have shape ({C},)")
    if P * C == 0:
        return
    cdef const real* gr
    cdef const real* nr
    cdef real* outr
    cdef int nt = bn_threads(P * C, num_threads)
    with nogil:
        for p in prange(P, num_threads=nt, schedule="static"):
            gr = &grad[p, 0]
            nr = &normalized[p, 0]
            outr = &out[p, 0]
            for c in range(C):
                outr[c] = (gr[c] - grad_mean[c] - nr[c] * projection[c]) * scale[c]
