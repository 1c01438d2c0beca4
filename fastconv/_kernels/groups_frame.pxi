# Grouped convolutions with their groups in parallel, included after
# conv_frame.pxi and winograd_frame.pxi by the per-ISA modules.
#
# A grouped convolution is `groups` independent convolutions on channel
# slices of x, row blocks of w and column blocks of y.  With at least as
# many groups as threads, each thread takes whole groups (each run with one
# thread inside): one parallel region for the layer instead of `groups`
# small ones, each of which would be too little work to split (ResNeXt's
# 32 groups of 4 channels ran on one core that way).

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
                                            rsw, dxp + gi * Cg, xs, 1) != 0
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
