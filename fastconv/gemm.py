"""GEMM facade: argument checking for sgemm/dgemm/matmul; the work is one
call into the dispatched kernel build (fastconv._dispatch.kernels.gemm)."""
import math
import numbers

import numpy as np

from . import _dispatch
from ._args import FLOAT32, FLOAT64, element_strides, kernel_float
from ._kernels import _runtime
from ._threads import get_num_threads

__all__ = ["sgemm", "dgemm", "matmul"]


# From this size on, glibc maps every allocation afresh (its adaptive mmap
# threshold stops at 32 MiB), so each np.empty of an output page-faults it
# in and the kernel zeroes it: a third of a VGG16 conv1_1 at batch 8 (102 MB
# output, perf) where ONNX Runtime's arena reuses its memory.  Arrays this
# large borrow a block of the kernels' workspace cache instead, which takes
# it back when the array is gone (fastconv.release_workspace() frees it).
WORKSPACE_ARRAY_BYTES = 32 << 20


def empty_aligned(shape, dtype):
    """np.empty whose data starts on a 64-byte boundary (numpy only promises
    16): the kernels' full-vector and streaming stores need aligned rows."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= WORKSPACE_ARRAY_BYTES:
        try:
            block = _dispatch.kernels.WorkspaceBlock(nbytes)
        except MemoryError:
            pass      # numpy's attempt below raises with its message (the size)
        else:
            return np.frombuffer(block, np.uint8).view(dtype).reshape(shape)
    buf = np.empty(nbytes + 64, np.uint8)
    return np.ndarray(shape, dtype, buf, -_runtime.buffer_address(buf) % 64)


def float_matrix(x, name):
    """``x`` as an ndarray, checked to be 2-D and floating; not cast or
    copied yet (the shapes are checked first: an invalid call allocates
    nothing, however large its operands)."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got {x.ndim}-D with shape {x.shape}")
    return x


def as_float_matrix(x, name, dtype=None):
    """``x`` as a 2-D floating ndarray (cast to ``dtype`` when given).

    Views keep their strides: the packing routines read any layout.  Only a
    stride that is not a whole number of elements forces a copy.
    """
    x = float_matrix(x, name)
    if dtype is not None:
        if x.dtype is not dtype:         # np.dtype's native instances are singletons
            x = x.astype(dtype, copy=False)
    elif not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))  # the kernels read native floats
    if not kernel_float(x.dtype):
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    if not element_strides(x):
        x = np.ascontiguousarray(x)
    return x


def as_scalar(value, name):
    if type(value) is float:           # the common case, without the ABC checks
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def gemm_into(alpha, a, b, beta, out):
    """out = alpha*a@b + beta*out for checked operands (out may be any
    writeable strided view; it must not overlap a or b).  beta == 0 ignores
    what out held, NaN included."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return out
    if K == 0:
        if beta == 0:
            out[...] = 0
        else:
            out *= beta
        return out
    _dispatch.kernels.gemm(alpha, a, b, beta, out, get_num_threads())
    return out


def _gemm(dtype, alpha, a, b, beta, c, trans_a, trans_b, overwrite_c):
    alpha = as_scalar(alpha, "alpha")
    beta = as_scalar(beta, "beta")
    a = float_matrix(a, "a")
    b = float_matrix(b, "b")
    M, K = a.shape[::-1] if trans_a else a.shape
    Kb, N = b.shape[::-1] if trans_b else b.shape
    if Kb != K:
        raise ValueError(f"inner dimensions differ: op(a) is {M}x{K} but op(b) is {Kb}x{N}")
    if c is not None:
        if not isinstance(c, np.ndarray):
            raise TypeError(f"c must be a numpy array, got {type(c).__name__}")
        if c.dtype != dtype:
            raise TypeError(f"c must have dtype {np.dtype(dtype)}, got {c.dtype}")
        if c.shape != (M, N):
            raise ValueError(f"c must have shape {(M, N)}, got {c.shape}")
        if overwrite_c:
            if not c.flags.writeable:
                raise ValueError("c is read-only but overwrite_c=True")
            if not element_strides(c):
                raise ValueError("c has strides that are not whole elements; pass a copy")
    a = as_float_matrix(a, "a", dtype)
    b = as_float_matrix(b, "b", dtype)
    if trans_a:
        a = a.T
    if trans_b:
        b = b.T
    if c is None:
        out = empty_aligned((M, N), dtype)
        beta = 0.0
    elif overwrite_c:
        out = c
        # The kernel re-reads A and B after writing parts of C.
        if np.may_share_memory(out, a):
            a = a.copy()
        if np.may_share_memory(out, b):
            b = b.copy()
    else:
        out = np.array(c, dtype=dtype, order="C") if beta != 0 else empty_aligned((M, N), dtype)
    return gemm_into(alpha, a, b, beta, out)


def sgemm(alpha, a, b, beta=0.0, c=None, trans_a=False, trans_b=False, overwrite_c=False):
    """float32 ``alpha * op(a) @ op(b) + beta * c``, like scipy.linalg.blas.sgemm.

    op(x) is x, or x.T when trans_x is true.  a and b may be any 2-D floating
    arrays (other float dtypes are cast; strided and negative-stride views
    are read in place).  c, when given, must be float32 of shape (M, N); it is
    written in place when overwrite_c is true, else a new array is returned.
    beta == 0 ignores what c holds, NaN included (BLAS semantics).
    """
    return _gemm(FLOAT32, alpha, a, b, beta, c, trans_a, trans_b, overwrite_c)


def dgemm(alpha, a, b, beta=0.0, c=None, trans_a=False, trans_b=False, overwrite_c=False):
    """float64 twin of :func:`sgemm` (scipy.linalg.blas.dgemm semantics)."""
    return _gemm(FLOAT64, alpha, a, b, beta, c, trans_a, trans_b, overwrite_c)


def matmul(a, b):
    """``a @ b`` for 2-D float32/float64 arrays, like np.matmul (mixed
    float32/float64 gives float64)."""
    a = float_matrix(a, "a")
    b = float_matrix(b, "b")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {a.shape[0]}x{a.shape[1]} but b is "
                         f"{b.shape[0]}x{b.shape[1]}; inner dimensions differ")
    a = as_float_matrix(a, "a")
    b = as_float_matrix(b, "b")
    dtype = np.result_type(a.dtype, b.dtype)
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    return gemm_into(1.0, a, b, 0.0, empty_aligned((a.shape[0], b.shape[1]), dtype))
