"""im2col / col2im: against slicing-based numpy references, adjointness,
strided inputs, thread-count independence and error paths."""
import random
import zlib

import numpy as np
import pytest

import fastconv
from fastconv import col2im, im2col
from reference import explicit_pads


def output_hw(hw, kernel, stride, pads, dilation):
    return tuple((n + lo + hi - (k - 1) * d - 1) // s + 1
                 for n, k, s, (lo, hi), d in zip(hw, kernel, stride, pads, dilation))


def tap_slices(kh, kw, out_hw, stride, dilation):
    """Index of the padded image that kernel tap (kh, kw) reads at every
    output pixel."""
    (OH, OW), (sh, sw), (dh, dw) = out_hw, stride, dilation
    return (slice(None), slice(kh * dh, kh * dh + (OH - 1) * sh + 1, sh),
            slice(kw * dw, kw * dw + (OW - 1) * sw + 1, sw), slice(None))


def naive_im2col(x, kernel, stride, pads, dilation):
    N, H, W, C = x.shape
    out_hw = output_hw((H, W), kernel, stride, pads, dilation)
    xp = np.pad(x, ((0, 0), *pads, (0, 0)))
    taps = [xp[tap_slices(kh, kw, out_hw, stride, dilation)]
            for kh in range(kernel[0]) for kw in range(kernel[1])]
    return np.stack(taps, axis=3).reshape(N * out_hw[0] * out_hw[1], -1)


def naive_col2im(cols, shape, kernel, stride, pads, dilation):
    N, H, W, C = shape
    (top, bottom), (left, right) = pads
    out_hw = output_hw((H, W), kernel, stride, pads, dilation)
    taps = cols.reshape(N, *out_hw, kernel[0], kernel[1], C)
    xp = np.zeros((N, H + top + bottom, W + left + right, C), cols.dtype)
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            xp[tap_slices(kh, kw, out_hw, stride, dilation)] += taps[:, :, :, kh, kw]
    return xp[:, top:top + H, left:left + W]


def random_cases(count, seed):
    """(shape, kernel, stride, padding, dilation), all valid."""
    rng = random.Random(seed)
    forms = ("int", "pair", "sides", "valid", "same")
    cases = []
    while len(cases) < count:
        form = forms[len(cases) % len(forms)]
        shape = (rng.choice((1, 2, 3)), rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 6))
        kernel = (rng.choice((1, 2, 3, 5)), rng.choice((1, 2, 3, 5)))
        stride = (rng.randint(1, 4), rng.randint(1, 4))  # up to stride > kernel
        dilation = (rng.choice((1, 1, 2, 3)), rng.choice((1, 1, 2, 3)))
        padding = {"int": rng.randint(0, 3),
                   "pair": (rng.randint(0, 3), rng.randint(0, 3)),
                   "sides": ((rng.randint(0, 3), rng.randint(0, 3)),
                             (rng.randint(0, 3), rng.randint(0, 3))),
                   "valid": "valid", "same": "same"}[form]
        pads = explicit_pads(padding, shape[1:3], kernel, stride, dilation)
        if min(output_hw(shape[1:3], kernel, stride, pads, dilation)) < 1:
            continue
        cases.append((shape, kernel, stride, padding, dilation))
    return cases


CASES = random_cases(60, seed=20240611)


def case_id(case):
    shape, kernel, stride, padding, dilation = case
    name = f"{'x'.join(map(str, shape))}-k{kernel}-s{stride}-p{padding}-d{dilation}"
    return name.replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_im2col_and_col2im_match_naive(case):
    shape, kernel, stride, padding, dilation = case
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    x = rng.standard_normal(shape)
    pads = explicit_pads(padding, shape[1:3], kernel, stride, dilation)
    cols = im2col(x, kernel, stride, padding, dilation)
    np.testing.assert_array_equal(cols, naive_im2col(x, kernel, stride, pads, dilation))

    c = rng.standard_normal(cols.shape)
    back = col2im(c, shape, kernel, stride, padding, dilation)
    np.testing.assert_allclose(back, naive_col2im(c, shape, kernel, stride, pads, dilation),
                               rtol=1e-13, atol=1e-13)
    # Adjointness: <im2col(x), c> == <x, col2im(c)>.
    lhs, rhs = np.vdot(cols, c), np.vdot(x, back)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, np.abs(cols).sum() * np.abs(c).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_im2col_is_an_exact_copy_in_both_dtypes(dtype):
    x = np.random.default_rng(1).standard_normal((2, 9, 8, 5)).astype(dtype)
    cols = im2col(x, (3, 2), (2, 1), ((1, 2), (0, 1)), (1, 2))
    assert cols.dtype == dtype
    np.testing.assert_array_equal(
        cols, naive_im2col(x, (3, 2), (2, 1), ((1, 2), (0, 1)), (1, 2)))
    c = np.random.default_rng(2).standard_normal(cols.shape).astype(dtype)
    back = col2im(c, x.shape, (3, 2), (2, 1), ((1, 2), (0, 1)), (1, 2))
    assert back.dtype == dtype
    np.testing.assert_allclose(back, naive_col2im(c.astype(np.float64), x.shape, (3, 2), (2, 1),
                                                  ((1, 2), (0, 1)), (1, 2)), rtol=1e-6, atol=1e-6)


def test_strided_and_channel_major_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7, 6, 4))
    expected = naive_im2col(x, (3, 3), (1, 2), ((1, 1), (2, 0)), (1, 1))
    big = np.full((2, 14, 6, 4), np.nan)
    big[:, ::2] = x[:, :, ::-1]
    views = {
        "row-skipping, negative column stride": big[:, ::2, ::-1],
        "channel-major memory": np.ascontiguousarray(x.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1),
        "read-only": np.lib.stride_tricks.as_strided(x, writeable=False),
    }
    for name, view in views.items():
        np.testing.assert_array_equal(view, x)
        np.testing.assert_array_equal(im2col(view, 3, (1, 2), ((1, 1), (2, 0))), expected,
                                      err_msg=name)
    c = rng.standard_normal(expected.shape)
    np.testing.assert_allclose(col2im(np.asfortranarray(c), x.shape, 3, (1, 2), ((1, 1), (2, 0))),
                               naive_col2im(c, x.shape, (3, 3), (1, 2), ((1, 1), (2, 0)), (1, 1)),
                               rtol=1e-13, atol=1e-13)


def test_large_case_is_thread_count_independent():
    # Big enough that both kernels run a parallel region.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 33, 31, 16))
    args = ((3, 3), 1, 1, (2, 1))
    cols = im2col(x, *args)
    np.testing.assert_array_equal(cols, naive_im2col(x, (3, 3), (1, 1), ((1, 1), (1, 1)), (2, 1)))
    c = rng.standard_normal(cols.shape)
    back = col2im(c, x.shape, *args)
    np.testing.assert_allclose(back, naive_col2im(c, x.shape, (3, 3), (1, 1), ((1, 1), (1, 1)),
                                                  (2, 1)), rtol=1e-12, atol=1e-12)
    previous = fastconv.get_num_threads()
    fastconv.set_num_threads(1)
    try:
        # Each input element's sum runs in one fixed order on one thread.
        np.testing.assert_array_equal(col2im(c, x.shape, *args), back)
        np.testing.assert_array_equal(im2col(x, *args), cols)
    finally:
        fastconv.set_num_threads(previous)


def test_edge_shapes():
    x = np.full((1, 1, 1, 1), 2.5)
    np.testing.assert_array_equal(im2col(x, 1), [[2.5]])
    np.testing.assert_array_equal(col2im(np.array([[1.5]]), (1, 1, 1, 1), 1), [[[[1.5]]]])
    # Only padding under the kernel.
    np.testing.assert_array_equal(im2col(np.ones((1, 1, 1, 2)), 3, padding=1)[0],
                                  np.r_[np.zeros(8), 1, 1, np.zeros(8)])
    # Empty batch, empty image with padding, huge channel count.
    assert im2col(np.zeros((0, 5, 5, 3)), 3).shape == (0, 27)
    assert col2im(np.zeros((0, 27)), (0, 5, 5, 3), 3).shape == (0, 5, 5, 3)
    np.testing.assert_array_equal(im2col(np.zeros((2, 0, 3, 2)), (1, 1), padding=1),
                                  np.zeros((2 * 2 * 5, 2)))
    x = np.random.default_rng(5).standard_normal((2, 2, 3, 1024)).astype(np.float32)
    np.testing.assert_array_equal(im2col(x, 2, padding=(0, 1)),
                                  naive_im2col(x, (2, 2), (1, 1), ((0, 0), (1, 1)), (1, 1)))


@pytest.mark.parametrize("call, exc, name", [
    (lambda: im2col(np.zeros((5, 5, 3)), 3), ValueError, "x"),
    (lambda: im2col(np.zeros((1, 5, 5, 3), np.int64), 3), TypeError, "x"),
    (lambda: im2col(np.zeros((1, 5, 5, 3), np.float16), 3), TypeError, "x"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 0), ValueError, "kernel_size"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), (3, 3, 3)), ValueError, "kernel_size"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 6), ValueError, "kernel_size"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, dilation=3), ValueError, "kernel_size"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, stride=0), ValueError, "stride"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, stride=1.5), TypeError, "stride"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, dilation=(1, -1)), ValueError, "dilation"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, padding=-1), ValueError, "padding"),
    (lambda: im2col(np.zeros((1, 5, 5, 3)), 3, padding="full"), ValueError, "padding"),
    (lambda: col2im(np.zeros((9, 27)), (1, 5, 5, 3), 3, padding=1), ValueError, "cols"),
    (lambda: col2im(np.zeros(27), (1, 5, 5, 3), 3), ValueError, "cols"),
    (lambda: col2im(np.zeros((9, 27), np.int32), (1, 5, 5, 3), 3), TypeError, "cols"),
    (lambda: col2im(np.zeros((9, 27)), (5, 5, 3), 3), ValueError, "input_shape"),
    (lambda: col2im(np.zeros((9, 27)), (1, -5, 5, 3), 3), ValueError, "input_shape"),
])
def test_errors_name_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        call()
