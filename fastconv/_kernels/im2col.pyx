# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""im2col / col2im on NHWC images: the data movement around the GEMM in
fastconv's convolutions.

Patch row (n, oh, ow) holds, in (kh, kw, c) order, the pixels
x[n, oh*sh - pad_top + kh*dh, ow*sw - pad_left + kw*dw, :]; taps outside the
image read as zero (im2col) or are dropped (col2im).  The patch grid (OH, OW)
is passed in rather than derived from the bottom/right padding, so that a
transposed convolution whose output_padding exceeds its padding can ask for
fewer patch rows than the padded image holds.

Images may have any pixel strides (in bytes, negative too) but contiguous
channels: every tap is one run of C values, copied as a block.  (A
[:, :, :, ::1] memoryview would demand a C-contiguous image, ruling out the
channel-slice views that grouped convolutions pass.)  Patch matrices are
C-contiguous.
"""
from cython.parallel cimport prange
from libc.string cimport memcpy, memset

ctypedef fused real:
    float
    double

# These are memory-bound copies: below this many elements per thread, waking
# the OpenMP team costs more than the extra bandwidth brings.
cdef enum:
    MIN_ELEMENTS_PER_THREAD = 65536


cdef inline int team_size(Py_ssize_t elements, int max_threads) noexcept nogil:
    cdef Py_ssize_t nt = elements // MIN_ELEMENTS_PER_THREAD
    if nt > max_threads:
        nt = max_threads
    return <int>nt if nt > 1 else 1


def im2col_into(const real[:, :, :, :] x, real[:, ::1] cols,
                kernel, stride, dilation, pad_before, out_hw, int num_threads):
    """cols[...] = the (N*OH*OW, KH*KW*C) patch matrix of x."""
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef Py_ssize_t KH = kernel[0], KW = kernel[1]
    cdef Py_ssize_t SH = stride[0], SW = stride[1]
    cdef Py_ssize_t DH = dilation[0], DW = dilation[1]
    cdef Py_ssize_t PT = pad_before[0], PL = pad_before[1]
    cdef Py_ssize_t OH = out_hw[0], OW = out_hw[1]
    if cols.shape[0] != N * OH * OW or cols.shape[1] != KH * KW * C:
        raise ValueError(f"im2col_into: cols has shape {(cols.shape[0], cols.shape[1])}, "
                         f"expected {(N * OH * OW, KH * KW * C)}")
    if cols.shape[0] == 0 or cols.shape[1] == 0:
        return
    if C > 1 and x.strides[3] != sizeof(real):
        raise ValueError("im2col_into: the channels of x must be contiguous")
    if N * H * W == 0:
        # Every tap is padding (and x has no element to take an address of).
        cols[:, :] = 0
        return

    cdef const char* xbase = <const char*>&x[0, 0, 0, 0]
    cdef Py_ssize_t sN = x.strides[0], sH = x.strides[1], sW = x.strides[2]
    cdef real* cbase = &cols[0, 0]
    cdef Py_ssize_t ld = cols.shape[1]
    cdef size_t run = C * sizeof(real)
    cdef int nt = team_size(cols.shape[0] * cols.shape[1], num_threads)
    cdef Py_ssize_t nrow, n, oh, ow, kh, kw, ih, iw
    cdef real* dst
    cdef const char* xrow

    # One task per (image, output row): tasks write disjoint rows of cols.
    for nrow in prange(N * OH, nogil=True, num_threads=nt, schedule="static"):
        n = nrow // OH
        oh = nrow - n * OH
        for ow in range(OW):
            dst = cbase + (nrow * OW + ow) * ld
            for kh in range(KH):
                ih = oh * SH - PT + kh * DH
                if ih < 0 or ih >= H:
                    memset(dst, 0, KW * run)
                    dst = dst + KW * C
                    continue
                xrow = xbase + n * sN + ih * sH
                for kw in range(KW):
                    iw = ow * SW - PL + kw * DW
                    if iw < 0 or iw >= W:
                        memset(dst, 0, run)
                    else:
                        memcpy(dst, xrow + iw * sW, run)
                    dst = dst + C


def col2im_into(const real[:, ::1] cols, real[:, :, :, :] out,
                kernel, stride, dilation, pad_before, out_hw, int num_threads):
    """out += the adjoint of im2col applied to cols (taps that land in the
    padding are dropped; overlapping taps are summed)."""
    cdef Py_ssize_t N = out.shape[0], H = out.shape[1], W = out.shape[2], C = out.shape[3]
    cdef Py_ssize_t KH = kernel[0], KW = kernel[1]
    cdef Py_ssize_t SH = stride[0], SW = stride[1]
    cdef Py_ssize_t DH = dilation[0], DW = dilation[1]
    cdef Py_ssize_t PT = pad_before[0], PL = pad_before[1]
    cdef Py_ssize_t OH = out_hw[0], OW = out_hw[1]
    if cols.shape[0] != N * OH * OW or cols.shape[1] != KH * KW * C:
        raise ValueError(f"col2im_into: cols has shape {(cols.shape[0], cols.shape[1])}, "
                         f"expected {(N * OH * OW, KH * KW * C)}")
    if cols.shape[0] == 0 or cols.shape[1] == 0 or N * H * W == 0:
        return
    if C > 1 and out.strides[3] != sizeof(real):
        raise ValueError("col2im_into: the channels of out must be contiguous")

    cdef const real* cbase = &cols[0, 0]
    cdef Py_ssize_t ld = cols.shape[1]
    cdef char* obase = <char*>&out[0, 0, 0, 0]
    cdef Py_ssize_t sN = out.strides[0], sH = out.strides[1], sW = out.strides[2]
    cdef int nt = team_size(cols.shape[0] * cols.shape[1], num_threads)
    cdef Py_ssize_t nrow, n, ih, kh, t, oh, ow, kw, iw, c
    cdef const real* src
    cdef real* dst
    cdef char* orow

    # One task per (image, input row), gathering every tap that lands in it:
    # no two threads ever accumulate into the same element.
    for nrow in prange(N * H, nogil=True, num_threads=nt, schedule="static"):
        n = nrow // H
        ih = nrow - n * H
        orow = obase + n * sN + ih * sH
        for kh in range(KH):
            t = ih + PT - kh * DH
            if t < 0:
                break  # t only decreases with kh
            if t % SH != 0:
                continue
            oh = t // SH
            if oh >= OH:
                continue
            for ow in range(OW):
                src = cbase + ((n * OH + oh) * OW + ow) * ld + kh * KW * C
                for kw in range(KW):
                    iw = ow * SW - PL + kw * DW
                    if iw >= W:
                        break
                    if iw >= 0:
                        dst = <real*>(orow + iw * sW)
                        for c in range(C):
                            dst[c] += src[kw * C + c]
