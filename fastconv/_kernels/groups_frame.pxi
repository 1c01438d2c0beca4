# Grouped convolutions with their groups in parallel, included after
# conv_frame.pxi and winograd_frame.pxi by the per-ISA modules.
#
# A grouped convolution is `groups` independent convolutions on channel
# slices of x, row blocks of w and column blocks of y.  With at least as
# many groups as threads, each thread takes whole groups (each run with one
# thread inside): one parallel region for the layer instead of `groups`
# small ones, each of which would be too little work to split (ResNeXt's
# 32 groups of 4 channels ran on one core that way; those now take the
# narrow-group kernels at the end of this file).

cdef int group_threads(int groups, int num_threads) noexcept nogil:
    return max(1, min(groups, num_threads))


def conv2d_forward_groups(const real[:, :, :, :] x, const real[:, :] w, bias, real[:, :] y,
                          int groups, kernel, stride, dilation, pad_before, out_hw,
                          int num_threads, int activation=ACT_NONE, bint winograd=False,
                          packed=None, bint flipped=False):
    """conv2d_forward (winograd: conv2d_winograd) of each group, groups in
    parallel: x NHWC with C = groups*Cg, w (OC, KH*KW*Cg), y (N*OH*OW, OC),
    bias None or (OC,), packed None or a list of each group's packed
    weights for the algorithm.  flipped (Winograd only): w is (C, 3*3*OCg),
    as conv2d_winograd(flipped=True) takes it."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(y.shape[1], y.strides[1], sizeof(real), "y")
    cdef Py_ssize_t Cg = x.shape[3] // groups, OCg = y.shape[1] // groups
    # Rows of w per group: its output channels, or (flipped) its inputs.
    cdef Py_ssize_t wrows = Cg if flipped else OCg
    if flipped and (not winograd or packed is not None):
        raise ValueError("flipped needs winograd and no packed weights")
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], Cg,
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, y.shape[0], y.shape[1], OCg * groups, "y")
    if winograd and (g.KH, g.KW, g.SH, g.SW) != (3, 3, 1, 1):
        raise ValueError("winograd needs a 3x3 kernel, stride 1")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef const real[::1] bias_view
    cdef const real* bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        bias_ptr = &bias_view[0]
    algorithm = "winograd" if winograd else "implicit"
    packs = [None] * groups if packed is None else list(packed)
    if len(packs) != groups:
        raise ValueError(f"packed must hold {groups} groups' weights")
    cdef const real** packed_ptrs = <const real**>malloc(groups * sizeof(real*))
    cdef int* status = <int*>malloc(groups * sizeof(int))
    if packed_ptrs == NULL or status == NULL:
        free(packed_ptrs)
        free(status)
        raise MemoryError()
    cdef int gi
    try:
        for gi in range(groups):
            packed_ptrs[gi] = checked_packed(packs[gi], <real>0, algorithm, (wrows, w.shape[1]),
                                             (g.KH, g.KW))
    except BaseException:
        free(packed_ptrs)
        free(status)
        raise
    cdef const real* xp = &x[0, 0, 0, 0]
    cdef const real* wp = &w[0, 0]
    cdef real* yp = &y[0, 0]
    cdef Py_ssize_t rsw = w.strides[0] // item, rsy = y.strides[0] // item
    with nogil:
        for gi in prange(groups, num_threads=group_threads(groups, num_threads),
                         schedule="dynamic"):
            if winograd:
                status[gi] = winograd_forward_nogil(
                    &g, xp + gi * Cg, xs, wp + gi * wrows * rsw, rsw, OCg,
                    NULL if bias_ptr == NULL else bias_ptr + gi * OCg, activation,
                    yp + gi * OCg, rsy, packed_ptrs[gi], 1, flipped)
            else:
                status[gi] = conv_forward_nogil(
                    &g, xp + gi * Cg, xs, wp + gi * OCg * rsw, rsw, OCg,
                    NULL if bias_ptr == NULL else bias_ptr + gi * OCg, activation,
                    yp + gi * OCg, rsy, packed_ptrs[gi], 1)
    failed = any(status[gi] != 0 for gi in range(groups))
    free(packed_ptrs)
    free(status)
    if failed:
        raise MemoryError("conv2d: could not allocate a group's workspace")


def conv2d_grad_input_groups(const real[:, :] dy, const real[:, :] w, real[:, :, :, :] dx,
                             int groups, kernel, stride, dilation, pad_before, out_hw,
                             int num_threads):
    """conv2d_grad_input of each group, groups in parallel: dy (N*OH*OW, OC),
    w (OC, KH*KW*Cg), dx NHWC (zeroed) with C = groups*Cg."""
    check_unit_stride(dy.shape[1], dy.strides[1], sizeof(real), "dy")
    check_unit_stride(w.shape[1], w.strides[1], sizeof(real), "w")
    check_unit_stride(dx.shape[3], dx.strides[3], sizeof(real), "dx")
    cdef Py_ssize_t Cg = dx.shape[3] // groups, OCg = w.shape[0] // groups
    cdef ConvGeom g = make_geom(dx.shape[0], dx.shape[1], dx.shape[2], Cg,
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, dy.shape[0], dy.shape[1], w.shape[0], "dy")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(dx.strides[0], dx.strides[1], dx.strides[2], item)
    cdef Py_ssize_t rsdy = dy.strides[0] // item, rsw = w.strides[0] // item
    cdef const real* dyp = &dy[0, 0]
    cdef const real* wp = &w[0, 0]
    cdef real* dxp = &dx[0, 0, 0, 0]
    cdef int gi, failed = 0
    with nogil:
        for gi in prange(groups, num_threads=group_threads(groups, num_threads),
                         schedule="dynamic"):
            # (+= makes failed a reduction; a plain assignment in a prange
            # body would be lastprivate and could lose a failure.)
            failed += conv_grad_input_nogil(&g, dyp + gi * OCg, rsdy, OCg, wp + gi * OCg * rsw,
                                            rsw, dxp + gi * Cg, xs, False, 1) != 0
    if failed:
        raise MemoryError("conv2d_backward: could not allocate a group's workspace")


def conv2d_grad_weight_groups(const real[:, :, :, :] x, const real[:, :] dy, real[:, :] dw,
                              int groups, kernel, stride, dilation, pad_before, out_hw,
                              int num_threads):
    """conv2d_grad_weight of each group, groups in parallel: x NHWC with
    C = groups*Cg, dy (N*OH*OW, OC), dw (OC, KH*KW*Cg), overwritten."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    check_unit_stride(dy.shape[1], dy.strides[1], sizeof(real), "dy")
    check_unit_stride(dw.shape[1], dw.strides[1], sizeof(real), "dw")
    cdef Py_ssize_t Cg = x.shape[3] // groups, OCg = dy.shape[1] // groups
    cdef ConvGeom g = make_geom(x.shape[0], x.shape[1], x.shape[2], Cg,
                                kernel, stride, dilation, pad_before, out_hw)
    check_pixel_rows(&g, dy.shape[0], dy.shape[1], dw.shape[0], "dy")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef Py_ssize_t rsdy = dy.strides[0] // item, rsdw = dw.strides[0] // item
    cdef const real* xp = &x[0, 0, 0, 0]
    cdef const real* dyp = &dy[0, 0]
    cdef real* dwp = &dw[0, 0]
    cdef int gi, failed = 0
    with nogil:
        for gi in prange(groups, num_threads=group_threads(groups, num_threads),
                         schedule="dynamic"):
            failed += conv_grad_weight_nogil(&g, xp + gi * Cg, xs, dyp + gi * OCg, rsdy, OCg,
                                             dwp + gi * OCg * rsdw, rsdw, 1) != 0
    if failed:
        raise MemoryError("conv2d_backward: could not allocate a group's workspace")


# Narrow groups (KG = 2, 4, 8 or 16 input and output channels per group:
# ResNeXt's 4 and 8) run as one direct convolution over
# all groups at once, output channels the vector axis (grouped_kernel.h).
# Threads split output rows; the weight gradient sums into per-thread
# partials, as the depthwise one does.

cdef extern from "grouped_kernel.h":
    int fc_grouped_row_f32(const float* const* rows, Py_ssize_t KH, Py_ssize_t KW,
                           Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C, Py_ssize_t KG,
                           Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW, Py_ssize_t PL,
                           Py_ssize_t lo, Py_ssize_t hi, const float* w, const float* bias,
                           int act, float* y) noexcept nogil
    int fc_grouped_row_f64(const double* const* rows, Py_ssize_t KH, Py_ssize_t KW,
                           Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C, Py_ssize_t KG,
                           Py_ssize_t OW, Py_ssize_t SW, Py_ssize_t DW, Py_ssize_t PL,
                           Py_ssize_t lo, Py_ssize_t hi, const double* w, const double* bias,
                           int act, double* y) noexcept nogil
    int fc_grouped_grad_weight_row_f32(const float* const* rows, Py_ssize_t KH, Py_ssize_t KW,
                                       Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C,
                                       Py_ssize_t KG, Py_ssize_t OW, Py_ssize_t SW,
                                       Py_ssize_t DW, Py_ssize_t PL, const float* dy,
                                       float* dw) noexcept nogil
    int fc_grouped_grad_weight_row_f64(const double* const* rows, Py_ssize_t KH, Py_ssize_t KW,
                                       Py_ssize_t xsw, Py_ssize_t W, Py_ssize_t C,
                                       Py_ssize_t KG, Py_ssize_t OW, Py_ssize_t SW,
                                       Py_ssize_t DW, Py_ssize_t PL, const double* dy,
                                       double* dw) noexcept nogil
    bint fc_grouped_width_supported(Py_ssize_t KG) noexcept nogil


cdef enum:
    # Kernel rows the direct kernels take (their row pointers live on the stack).
    MAX_GROUPED_KERNEL_ROWS = 64


def grouped_direct_supports(Py_ssize_t width, Py_ssize_t kernel_rows):
    """Whether the narrow-group kernels are built for groups of `width`
    input and output channels (2, 4, 8 or 16) and a kernel this tall."""
    return kernel_rows <= MAX_GROUPED_KERNEL_ROWS and bool(fc_grouped_width_supported(width))


cdef void grouped_row_pointers(const ConvGeom* g, const real* x, ImageStrides xs,
                               Py_ssize_t row, const real** rows) noexcept nogil:
    # Output row `row` (= n*OH + oh): its kernel rows' input rows, NULL
    # where outside the image.
    cdef Py_ssize_t n = row // g.OH, oh = row % g.OH, kh, ih
    for kh in range(g.KH):
        ih = oh * g.SH - g.PT + kh * g.DH
        rows[kh] = x + n * xs.n + ih * xs.h if 0 <= ih < g.H else NULL


cdef inline int grouped_row(const ConvGeom* g, const real* x, ImageStrides xs,
                            Py_ssize_t KG, Py_ssize_t lo, Py_ssize_t hi, const real* w,
                            const real* bias, int act, real* y, Py_ssize_t row) noexcept nogil:
    cdef const real* rows[MAX_GROUPED_KERNEL_ROWS]
    grouped_row_pointers(g, x, xs, row, rows)
    if real is float:
        return fc_grouped_row_f32(rows, g.KH, g.KW, xs.w, g.W, g.C, KG, g.OW, g.SW, g.DW,
                                  g.PL, lo, hi, w, bias, act, y + row * g.OW * g.C)
    else:
        return fc_grouped_row_f64(rows, g.KH, g.KW, xs.w, g.W, g.C, KG, g.OW, g.SW, g.DW,
                                  g.PL, lo, hi, w, bias, act, y + row * g.OW * g.C)


cdef inline int grouped_grad_weight_row(const ConvGeom* g, const real* x, ImageStrides xs,
                                        Py_ssize_t KG, const real* dy, real* dw,
                                        Py_ssize_t row) noexcept nogil:
    cdef const real* rows[MAX_GROUPED_KERNEL_ROWS]
    grouped_row_pointers(g, x, xs, row, rows)
    if real is float:
        return fc_grouped_grad_weight_row_f32(rows, g.KH, g.KW, xs.w, g.W, g.C, KG, g.OW,
                                              g.SW, g.DW, g.PL, dy + row * g.OW * g.C, dw)
    else:
        return fc_grouped_grad_weight_row_f64(rows, g.KH, g.KW, xs.w, g.W, g.C, KG, g.OW,
                                              g.SW, g.DW, g.PL, dy + row * g.OW * g.C, dw)


cdef ConvGeom grouped_geom(x_shape, Py_ssize_t C_out, Py_ssize_t KG, kernel, stride, dilation,
                           pad_before, out_hw) except *:
    # g.C is all C channels here (the kernels see every group at once).
    if x_shape[3] != C_out:
        raise ValueError(f"the narrow-group kernels need as many output channels as input "
                         f"channels ({x_shape[3]}); got {C_out}")
    if KG < 1 or x_shape[3] % KG:
        raise ValueError(f"group width {KG} does not divide the {x_shape[3]} channels")
    if not grouped_direct_supports(KG, kernel[0]):
        raise ValueError(f"the narrow-group kernels are not built for groups of {KG} "
                         f"channels with {kernel[0]} kernel rows")
    return make_geom(x_shape[0], x_shape[1], x_shape[2], x_shape[3], kernel, stride, dilation,
                     pad_before, out_hw)


def grouped_direct_forward(const real[:, :, :, :] x, const real[:, :, :, ::1] w, bias,
                           real[:, :, :, ::1] y, kernel, stride, dilation, pad_before,
                           int num_threads, int activation=ACT_NONE):
    """y (N, OH, OW, C) = the grouped convolution of NHWC x (C channels in
    groups of KG) with w (KH, KW, KG, C) (see grouped_kernel.h), + bias
    (None or a contiguous (C,) array), then the activation."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef Py_ssize_t KG = w.shape[2]
    if (w.shape[0], w.shape[1], w.shape[3]) != (kernel[0], kernel[1], x.shape[3]):
        raise ValueError("w must be (KH, KW, group width, C)")
    cdef ConvGeom g = grouped_geom(x.shape, y.shape[3], KG, kernel, stride, dilation,
                                   pad_before, (y.shape[1], y.shape[2]))
    if y.shape[0] != g.N:
        raise ValueError("y must have x's batch size")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef const real[::1] bias_view
    cdef const real* bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        if bias_view.shape[0] != g.C:
            raise ValueError(f"bias must be ({g.C},)")
        bias_ptr = &bias_view[0]
    cdef RowRange inner = columns_with_taps_inside(&g)
    cdef Py_ssize_t lo = inner.lo, hi = inner.hi
    cdef int nt = threads_for(2.0 * g.N * g.OH * g.OW * g.C * g.KH * g.KW * KG, num_threads)
    cdef const real* xp = &x[0, 0, 0, 0]
    cdef const real* wp = &w[0, 0, 0, 0]
    cdef real* yp = &y[0, 0, 0, 0]
    cdef Py_ssize_t row
    with nogil:
        for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
            grouped_row(&g, xp, xs, KG, lo, hi, wp, bias_ptr, activation, yp, row)


def grouped_direct_grad_weight(const real[:, :, :, :] x, const real[:, :, :, ::1] dy,
                               real[:, :, :, ::1] dw, kernel, stride, dilation, pad_before,
                               int num_threads):
    """dw (KH, KW, KG, C) = the weight gradient of grouped_direct_forward
    for output gradient dy (N, OH, OW, C)."""
    check_unit_stride(x.shape[3], x.strides[3], sizeof(real), "x")
    cdef Py_ssize_t KG = dw.shape[2]
    if (dw.shape[0], dw.shape[1], dw.shape[3]) != (kernel[0], kernel[1], x.shape[3]):
        raise ValueError("dw must be (KH, KW, group width, C)")
    cdef ConvGeom g = grouped_geom(x.shape, dy.shape[3], KG, kernel, stride, dilation,
                                   pad_before, (dy.shape[1], dy.shape[2]))
    if dy.shape[0] != g.N:
        raise ValueError("dy must have x's batch size")
    cdef Py_ssize_t item = sizeof(real)
    cdef ImageStrides xs = image_strides(x.strides[0], x.strides[1], x.strides[2], item)
    cdef Py_ssize_t taps = g.KH * g.KW * KG * g.C
    cdef int nt = threads_for(2.0 * g.N * g.OH * g.OW * taps, num_threads)
    cdef real* partials = <real*>aligned_malloc(nt * taps * sizeof(real))
    if partials == NULL:
        raise MemoryError("grouped grad weight: could not allocate per-thread partials")
    cdef const real* xp = &x[0, 0, 0, 0]
    cdef const real* dyp = &dy[0, 0, 0, 0]
    cdef real* dwp = &dw[0, 0, 0, 0]
    cdef Py_ssize_t row, i, t
    with nogil:
        memset(partials, 0, nt * taps * sizeof(real))
        for row in prange(g.N * g.OH, num_threads=nt, schedule="static"):
            grouped_grad_weight_row(&g, xp, xs, KG, dyp, partials + threadid() * taps, row)
        for i in range(taps):
            dwp[i] = partials[i]
        for t in range(1, nt):
            for i in range(taps):
                dwp[i] += partials[t * taps + i]
    aligned_free(partials)
