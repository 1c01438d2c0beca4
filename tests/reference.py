"""Reference computations the tests share, written independently of
fastconv's own argument handling."""
import math

import numpy as np


def explicit_pads(padding, hw, kernel, stride, dilation):
    """((top, bottom), (left, right)) for every padding form, computed
    independently of fastconv._args ("same" is SAME_UPPER)."""
    if padding == "valid":
        return ((0, 0), (0, 0))
    if padding == "same":
        pads = []
        for n, k, s, d in zip(hw, kernel, stride, dilation):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    if isinstance(padding[0], int):
        return ((padding[0],) * 2, (padding[1],) * 2)
    return tuple(tuple(p) for p in padding)


def at_line_offset(a, offset):
    """A copy of a whose data starts offset bytes past a 64-byte line."""
    buf = np.empty(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


#: The builds whose GEMM has short-M kernels (fastconv/_kernels/
#: short_m_kernel.h), per dtype: what the tests expect them to take.
SHORT_M_BUILDS = {"float32": ("avx512", "avx2"), "float64": ("avx512",)}
#: Vector bytes of each build (a narrow-output GEMM takes one vector of
#: output channels).
VECTOR_BYTES = {"avx512": 64, "avx2": 32, "baseline": 16}


def has_short_m(isa, dtype):
    """Whether build isa runs short products of dtype by short-M kernels."""
    return isa in SHORT_M_BUILDS[np.dtype(dtype).name]
