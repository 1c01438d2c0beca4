"""Argument checking and shape arithmetic for the convolutions (pure Python).

Every error names the offending argument: ValueError for bad values and
shapes, TypeError for bad types and dtypes.
"""
import numbers
import operator

import numpy as np

LAYOUTS = ("NHWC", "NCHW")
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_PADDING_FORMS = "an int, (ph, pw) or ((top, bottom), (left, right))"


def choice(value, name, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def _int(value, name, what):
    if type(value) is int:          # the common case, without the ABC check
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}; got {value!r}")
    return operator.index(value)


def _is_pair(value):
    return isinstance(value, (tuple, list)) or (isinstance(value, np.ndarray) and value.ndim == 1)


def int_pair(value, name, what="an int or a pair of ints"):
    """An int or a 2-sequence of ints as an (h, w) tuple."""
    if type(value) is int:          # the common case, first
        return (value, value)
    if _is_pair(value):
        if len(value) != 2:
            raise ValueError(f"{name} must be {what}; got {value!r}")
        return (_int(value[0], name, what), _int(value[1], name, what))
    v = _int(value, name, what)
    return (v, v)


def positive_pair(value, name):
    pair = int_pair(value, name)
    if min(pair) < 1:
        raise ValueError(f"{name} must be positive; got {value!r}")
    return pair


def positive_int(value, name):
    v = _int(value, name, "an int")
    if v < 1:
        raise ValueError(f"{name} must be positive; got {value!r}")
    return v


def shape4(shape, name):
    """An (N, H, W, C) tuple of non-negative ints."""
    what = "a sequence of 4 non-negative ints (N, H, W, C)"
    if not _is_pair(shape) or len(shape) != 4:
        raise ValueError(f"{name} must be {what}; got {shape!r}")
    shape = tuple(_int(s, name, what) for s in shape)
    if min(shape) < 0:
        raise ValueError(f"{name} must be {what}; got {shape!r}")
    return shape


def output_mask(mask):
    """(want grad_input, want grad_weight, want grad_bias)."""
    if not _is_pair(mask) or len(mask) != 3:
        raise ValueError(f"output_mask must be a sequence of 3 booleans; got {mask!r}")
    return tuple(bool(m) for m in mask)


#: numpy's native float dtypes, which are singletons (tested by identity).
FLOAT32, FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)


def float_array(x, name, ndim):
    """x as a float32/float64 ndarray of ndim dimensions, copied only when
    its strides are not whole elements or it is misaligned (the kernels
    index in elements)."""
    if type(x) is not np.ndarray:
        x = np.asarray(x)
    if not kernel_float(x.dtype):
        raise TypeError(f"{name} must be float32 or float64; got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {x.shape}")
    if not x.flags.aligned or not element_strides(x):
        x = np.ascontiguousarray(x)
    return x


def kernel_float(dtype):
    """Whether the kernels read dtype: native float32 or float64 (a
    byte-swapped float32 is neither).  Identity first: it spares the common
    case dtype.__eq__."""
    return dtype is FLOAT32 or dtype is FLOAT64 or dtype in (FLOAT32, FLOAT64)


def dtype_name(dtype):
    """dtype.name, without its cost for the kernels' two floats (numpy
    computes .name in Python: ~4 us, a quarter of a small conv2d call)."""
    if dtype is FLOAT32:
        return "float32"
    if dtype is FLOAT64:
        return "float64"
    return dtype.name


def element_strides(x):
    """Whether every stride of ndarray x is a whole number of elements, as
    the kernels index (numpy lets a length-1 axis's stride be anything, even
    in a C-contiguous array).  A plain loop: the generator this replaced
    cost ~0.7 us of a 35 us depthwise call."""
    item = x.itemsize
    for s in x.strides:
        if s % item:
            return False
    return True


def same_dtype(array, name, dtype):
    if array.dtype != dtype:
        raise TypeError(f"{name} has dtype {array.dtype} but x has dtype {dtype}; "
                        "they must match")


def explicit_padding(padding):
    """int | (ph, pw) | ((top, bottom), (left, right)) -> ((top, bottom), (left, right))."""
    if isinstance(padding, str):
        raise ValueError(f"padding must be {_PADDING_FORMS}; got {padding!r}")
    if _is_pair(padding) and len(padding) == 2 and all(_is_pair(p) for p in padding):
        pads = tuple(int_pair(p, "padding", _PADDING_FORMS) for p in padding)
    else:
        ph, pw = int_pair(padding, "padding", _PADDING_FORMS)
        pads = ((ph, ph), (pw, pw))
    if min(min(p) for p in pads) < 0:
        raise ValueError(f"padding must be non-negative; got {padding!r}")
    return pads


def same_padding(size, kernel, stride, dilation):
    """TensorFlow/ONNX SAME_UPPER along one axis: ceil(size / stride)
    outputs, the odd pixel of padding after (bottom/right)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return (total // 2, total - total // 2)


def conv_padding(padding, in_hw, kernel, stride, dilation):
    """Any of conv2d's padding forms -> ((top, bottom), (left, right))."""
    if type(padding) is int and padding >= 0:
        return ((padding, padding), (padding, padding))
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0), (0, 0))
        if padding == "same":
            return tuple(same_padding(*axis) for axis in zip(in_hw, kernel, stride, dilation))
        raise ValueError(f"padding must be 'valid', 'same', {_PADDING_FORMS}; got {padding!r}")
    return explicit_padding(padding)


#: Bound on a geometry's extents (padded sizes, strides times outputs):
#: the kernels index pixels with signed 64-bit products and sums of these.
INDEX_LIMIT = 2 ** 62


def check_index_range(extent, axis):
    if extent >= INDEX_LIMIT:
        raise ValueError(f"padding, stride or dilation: along {axis} they reach pixel "
                         f"{extent}, beyond the kernels' 64-bit indices (2**62 at most)")


def conv_output_hw(in_hw, kernel, stride, pads, dilation, kernel_name):
    """(OH, OW) of a convolution; the dilated kernel must fit the padded input."""
    out = []
    for axis, size, k, s, (lo, hi), d in zip("HW", in_hw, kernel, stride, pads, dilation):
        span = (k - 1) * d + 1
        check_index_range(size + lo + hi + s + span, axis)
        if size + lo + hi < span:
            raise ValueError(f"{kernel_name}: the kernel spans {span} pixels along {axis} "
                             f"(dilation included), more than the padded input's "
                             f"{size + lo + hi}")
        out.append((size + lo + hi - span) // s + 1)
    return tuple(out)


def check_mode_padding(pads, in_hw, mode):
    """reflect/circular padding can only reach so far into the input."""
    for axis, size, (lo, hi) in zip("HW", in_hw, pads):
        if mode == "reflect" and max(lo, hi) >= size:
            raise ValueError(f"padding: reflect padding ({lo}, {hi}) along {axis} must be "
                             f"smaller than the input size {size}")
        if mode == "circular" and max(lo, hi) > size:
            raise ValueError(f"padding: circular padding ({lo}, {hi}) along {axis} must not "
                             f"exceed the input size {size}")
        if mode == "replicate" and size == 0 and lo + hi > 0:
            raise ValueError(f"padding: cannot replicate-pad an input of size 0 along {axis}")


def transpose_output_hw(in_hw, kernel, stride, pads, dilation, output_padding):
    """Output (H, W) of a transposed convolution (PyTorch's formula)."""
    for axis, op, s, d in zip("HW", output_padding, stride, dilation):
        if op < 0 or op >= max(s, d):
            raise ValueError(f"output_padding {output_padding} along {axis} must be "
                             f"non-negative and smaller than max(stride, dilation) = {max(s, d)}")
    for axis, size, k, s, (lo, hi), d in zip("HW", in_hw, kernel, stride, pads, dilation):
        # The kernels run the convolution whose data gradient this is, with
        # in_hw as its output: strides times in_hw past the padding.
        check_index_range(size * s + lo + hi + k * d, axis)
    out = tuple((size - 1) * s - lo - hi + (k - 1) * d + op + 1
                for size, k, s, (lo, hi), d, op
                in zip(in_hw, kernel, stride, pads, dilation, output_padding))
    if min(out) < 1:
        raise ValueError(f"padding {pads} is too large: the output would have shape {out}")
    return out
