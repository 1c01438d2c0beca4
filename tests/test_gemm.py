"""Tests of fastconv.sgemm / dgemm / matmul against numpy in float64.

Every result is compared elementwise with the float64 reference
``alpha*op(a)@op(b) + beta*c`` computed from the exact (already rounded to
the working dtype) operand values, with the bound

    |got - ref| <= eps(dtype) * (4*sqrt(K) + 4) * (|alpha|*|op(a)|@|op(b)| + |beta|*|c|)

(``check`` below).  test_checker_rejects_injected_bugs shows that the bound
is tight enough to catch a dropped K slice or K block, a transposed operand,
a wrong edge tile, a missing/extra beta*c or alpha, for float32 and float64.

test_checker_catches_buggy_kernels injects such bugs into the real call path
(a wrapped kernel) and checks that the assertions used everywhere fail.

Strided operands are built with NaN in the gaps between their elements, so a
kernel that reads one element too far poisons the result.
"""
import contextlib
import math
import threading
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from threadpoolctl import threadpool_limits

import fastconv
from fastconv import _dispatch
from fastconv.gemm import empty_aligned
from reference import has_short_m

AVAILABLE = _dispatch.AVAILABLE
DTYPES = (np.float32, np.float64)
GEMM = {np.float32: fastconv.sgemm, np.float64: fastconv.dgemm}
SEED = 20240611


# ---------------------------------------------------------------- helpers

def rng_for(*key):
    """A Generator seeded from SEED and the test's parameters (stable across
    runs: crc32, not the per-process salted hash())."""
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def reference(alpha, a, b, beta=0.0, c=None):
    """float64 result and elementwise error scale of alpha*a@b + beta*c."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    ref = alpha * (a64 @ b64)
    scale = abs(alpha) * (np.abs(a64) @ np.abs(b64))
    if c is not None and beta != 0:
        c64 = np.asarray(c, dtype=np.float64)
        ref = ref + beta * c64
        scale = scale + abs(beta) * np.abs(c64)
    return ref, scale


def check(got, ref, scale, K, dtype):
    """Assert got (dtype) matches the float64 reference within the K-scaled bound."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(dtype), f"dtype {got.dtype}, expected {np.dtype(dtype)}"
    assert got.shape == ref.shape, f"shape {got.shape}, expected {ref.shape}"
    tol = np.finfo(dtype).eps * (4.0 * math.sqrt(K) + 4.0) * scale
    err = np.abs(got.astype(np.float64) - ref)
    bad = ~(err <= tol)             # NaN in got counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = np.nanmax(np.where(tol > 0, err / tol, np.inf))
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} elements outside tolerance (K={K}); "
            f"first at {idx}: got {got[idx]!r}, expected {ref[idx]!r}, tol {tol[idx]:.3g}; "
            f"worst err/tol {worst:.3g}")


def check_gemm(got, alpha, opa, opb, beta, c, dtype):
    """check() for got == alpha*opa@opb + beta*c; opa/opb/c as the kernel saw them."""
    ref, scale = reference(alpha, opa, opb, beta, c)
    check(got, ref, scale, opa.shape[1], dtype)


def in_lockstep(workers, rounds, num_threads, call):
    """results[i][r] = call(i, r), from `workers` Python threads that start
    each round together (a barrier), each with fastconv's thread count set
    to num_threads (OpenMP thread limits are per thread)."""
    results = [[None] * rounds for _ in range(workers)]
    errors = []
    barrier = threading.Barrier(workers)

    def worker(i):
        try:
            fastconv.set_num_threads(num_threads)
            for r in range(rounds):
                barrier.wait(timeout=60)
                results[i][r] = call(i, r)
        except BaseException as e:           # reported in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    return results


def with_gaps(x, fill):
    """A strided view equal to x, inside a larger array holding ``fill``
    elsewhere.  Returns (view, base)."""
    m, n = x.shape
    base = np.full((2 * m + 1, 3 * n + 2), fill, dtype=x.dtype)
    view = base[1::2, 2::3][:m, :n]
    view[...] = x
    return view, base


LAYOUTS = ("C", "F", "strided", "strided_T", "neg", "neg_rows_F", "neg_strided", "pitch2k")


def layout(x, kind, fill=np.nan):
    """x (2-D) laid out as ``kind``; the values are the same as x's.
    Returns (view, base) where base is the array the view lives in."""
    if kind == "C":
        v = np.array(x, order="C")
        return v, v
    if kind == "F":                        # the transpose of a C array
        v = np.array(x, order="F")
        return v, v
    if kind == "strided":                  # both strides > 1 element
        return with_gaps(x, fill)
    if kind == "strided_T":                # row stride < column stride, neither 1
        v, base = with_gaps(x.T, fill)
        return v.T, base
    # np.array copies: np.ascontiguousarray / asfortranarray would return x
    # itself for a one-row or one-column x, and the view would alias it.
    if kind == "neg":                      # both strides negative
        base = np.array(x[::-1, ::-1], order="C")
        return base[::-1, ::-1], base
    if kind == "neg_rows_F":               # row stride -1, column stride +m
        base = np.array(x[::-1, :], order="F")
        return base[::-1, :], base
    if kind == "neg_strided":
        v, base = with_gaps(x[::-1, ::-1], fill)
        return v[::-1, ::-1], base
    if kind == "pitch2k":                  # rows a multiple of 2 KiB apart (L1 set aliasing)
        m, n = x.shape
        per = 2048 // x.itemsize
        base = np.full((m, per * (n // per + 1)), fill, dtype=x.dtype)
        v = base[:, 1:n + 1]
        v[...] = x
        return v, base
    raise ValueError(kind)


@pytest.fixture(params=AVAILABLE)
def isa(request):
    """Run the test on each kernel build this machine can run."""
    before = _dispatch.current_isa()
    with _dispatch.use_isa(request.param):
        assert _dispatch.current_isa() == request.param
        yield request.param
    assert _dispatch.current_isa() == before


@pytest.fixture(autouse=True)
def restore_threads():
    n = fastconv.get_num_threads()
    yield
    fastconv.set_num_threads(n)


def dtype_id(d):
    return np.dtype(d).name


# ------------------------------------------------- the checker is honest

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("K", [1, 7, 300, 1024])
def test_checker_rejects_injected_bugs(dtype, K):
    """The tolerance passes a correct result and fails plausible kernel bugs."""
    rng = rng_for("checker", dtype_id(dtype), K)
    M = N = 48
    a = randn(rng, (M, K), dtype)
    b = randn(rng, (K, N), dtype)
    c = randn(rng, (M, N), dtype)
    alpha, beta = 1.5, -0.75
    ref, scale = reference(alpha, a, b, beta, c)
    a64, b64, c64 = (x.astype(np.float64) for x in (a, b, c))

    check(ref.astype(dtype), ref, scale, K, dtype)     # a correct answer passes

    wrong = {
        "beta ignored": alpha * (a64 @ b64),
        "beta as 1": alpha * (a64 @ b64) + c64,
        "alpha ignored": a64 @ b64 + beta * c64,
        "last row of C from the edge tile missing": np.vstack([ref[:-1], beta * c64[-1:]]),
        "last column wrong": np.hstack([ref[:, :-1], ref[:, -2:-1]]),
        "one element off by 1%": np.where(np.arange(M * N).reshape(M, N) == 17 * N + 5,
                                          ref * 1.01 + 0.01, ref),
    }
    if K > 1:
        wrong["last K slice dropped"] = alpha * (a64[:, :-1] @ b64[:-1]) + beta * c64
        wrong["first K slice dropped"] = alpha * (a64[:, 1:] @ b64[1:]) + beta * c64
        wrong["K slice counted twice"] = ref + alpha * np.outer(a64[:, 0], b64[0])
    if K >= 300:
        keep = np.ones(K, bool)
        keep[256:] = False                             # a whole second KC block lost
        wrong["second K block dropped"] = alpha * (a64[:, keep] @ b64[keep]) + beta * c64
    if K == M:
        wrong["a transposed"] = alpha * (a64.T @ b64) + beta * c64
        wrong["b transposed"] = alpha * (a64 @ b64.T) + beta * c64
    for name, bad in wrong.items():
        with pytest.raises(AssertionError):
            check(bad.astype(dtype), ref, scale, K, dtype)
            pytest.fail(f"checker accepted: {name}")


BUGGY_KERNELS = {
    "last K slice dropped": lambda g, al, a, b, be, c, nt: g(al, a[:, :-1], b[:-1], be, c, nt),
    "only the first K block": lambda g, al, a, b, be, c, nt: g(al, a[:, :256], b[:256], be, c, nt),
    "last row (edge tile) not stored": lambda g, al, a, b, be, c, nt: g(al, a[:-1], b, be, c[:-1], nt),
    "last column not stored": lambda g, al, a, b, be, c, nt: g(al, a, b[:, :-1], be, c[:, :-1], nt),
    "b read transposed": lambda g, al, a, b, be, c, nt: g(al, a, b.T, be, c, nt),
    "beta ignored": lambda g, al, a, b, be, c, nt: g(al, a, b, 0.0, c, nt),
    "alpha ignored": lambda g, al, a, b, be, c, nt: g(1.0, a, b, be, c, nt),
}


@pytest.mark.parametrize("bug", sorted(BUGGY_KERNELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_checker_catches_buggy_kernels(isa, dtype, bug, monkeypatch):
    """A kernel with a plausible bug, called through sgemm/dgemm, fails check_gemm."""
    n = 500                                   # two K blocks, edge tiles in M and N
    rng = rng_for("buggy", isa, dtype_id(dtype), bug)
    a, b, c = randn(rng, (n, n), dtype), randn(rng, (n, n), dtype), randn(rng, (n, n), dtype)
    k = _dispatch.kernels
    good = k.gemm
    check_gemm(GEMM[dtype](1.5, a, b, 0.5, c), 1.5, a, b, 0.5, c, dtype)   # control
    monkeypatch.setattr(k, "gemm", lambda *args, **kw: BUGGY_KERNELS[bug](
        lambda *a2: good(*a2, **kw), *args))
    got = GEMM[dtype](1.5, a, b, 0.5, c)
    with pytest.raises(AssertionError):
        check_gemm(got, 1.5, a, b, 0.5, c, dtype)


# ------------------------------------------------------------ shapes

RANDOM_SHAPES = [tuple(int(v) for v in s)
                 for s in np.random.default_rng(SEED).integers(1, 301, size=(24, 3))]
NAMED_SHAPES = [
    (1, 1, 1), (2, 3, 5), (7, 11, 13), (31, 37, 41), (97, 89, 83), (127, 131, 137),
    (251, 257, 263),                                   # primes (M, N, K)
    (300, 300, 1), (1, 257, 1), (64, 1, 1),            # K = 1
    (1, 300, 200), (300, 1, 200), (1, 1, 500),         # M or N = 1
    (2000, 3, 17), (3, 2000, 17), (2000, 1, 64), (1, 2000, 64),   # tall / wide
    (5, 7, 3000), (613, 17, 400),                      # deep K / skinny
]


@pytest.mark.parametrize("shape", NAMED_SHAPES + RANDOM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_shapes(isa, dtype, shape):
    M, N, K = shape
    rng = rng_for("shapes", isa, dtype_id(dtype), *shape)
    a, b, c = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    got = GEMM[dtype](1.3, a, b, -0.6, c)
    check_gemm(got, 1.3, a, b, -0.6, c, dtype)
    check_gemm(GEMM[dtype](1.0, a, b), 1.0, a, b, 0.0, None, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_1024_square(isa, dtype):
    rng = rng_for("1024", isa, dtype_id(dtype))
    n = 1024
    a, b, c = randn(rng, (n, n), dtype), randn(rng, (n, n), dtype), randn(rng, (n, n), dtype)
    got = GEMM[dtype](0.5, a, b, 2.0, c)
    check_gemm(got, 0.5, a, b, 2.0, c, dtype)


# -------------------------------- every trans / alpha / beta / c combination

@pytest.mark.parametrize("c_mode", ["none", "copy", "overwrite"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("alpha", [1.0, -2.5, 0.0])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_trans_alpha_beta_c(isa, dtype, trans_a, trans_b, alpha, beta, c_mode):
    # 37 x 45 x 500: partial micro-tiles in M and N, two K blocks.
    M, N, K = 37, 45, 500
    rng = rng_for("combo", isa, dtype_id(dtype), trans_a, trans_b, alpha, beta, c_mode)
    a = randn(rng, (K, M) if trans_a else (M, K), dtype)
    b = randn(rng, (N, K) if trans_b else (K, N), dtype)
    opa, opb = (a.T if trans_a else a), (b.T if trans_b else b)
    f = GEMM[dtype]
    if c_mode == "none":
        got = f(alpha, a, b, beta, trans_a=trans_a, trans_b=trans_b)
        check_gemm(got, alpha, opa, opb, 0.0, None, dtype)   # no c: no c term
        return
    c = randn(rng, (M, N), dtype)
    c0 = c.copy()
    got = f(alpha, a, b, beta, c, trans_a=trans_a, trans_b=trans_b,
            overwrite_c=(c_mode == "overwrite"))
    check_gemm(got, alpha, opa, opb, beta, c0, dtype)
    if c_mode == "overwrite":
        assert got is c                                   # written in place and returned
        np.testing.assert_array_equal(c, got)
    else:
        assert not np.shares_memory(got, c)
        np.testing.assert_array_equal(c, c0)              # c untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_transposed_a_every_panel_width(isa, dtype):
    # A.T is read in place, k-major, one micro-kernel per tile height: M
    # from 2 to 30 gives every tile height of every build (MR 6, 12, 14);
    # K = 600 is two or three K blocks (KC 384 or 256), and each tile
    # prefetches its share of the next block's rows.  Each row of A.T is
    # followed by NaN, so a kernel that reads past its slice poisons C.
    N = 33
    for K in (45, 600):
        for M in range(2, 31):
            rng = rng_for("at widths", isa, dtype_id(dtype), M, K)
            base = np.full((K, M + 9), np.nan, dtype)
            base[:, :M] = randn(rng, (K, M), dtype)
            at = base[:, :M]
            b = randn(rng, (K, N), dtype)
            got = GEMM[dtype](1.0, at, b, trans_a=True)
            check_gemm(got, 1.0, at.T, b, 0.0, None, dtype)


@pytest.mark.parametrize("ld_bytes", [2048, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_transposed_a_rows_a_multiple_of_2_kib_apart(isa, dtype, ld_bytes):
    # A.T whose k rows are a multiple of 2 KiB apart (a weight gradient's
    # dy^T at 512 output channels): each slice is copied row-major before
    # its panels, not read k-major in place (macro_kernel_ld's
    # kmajor_sets).  Tiles of many heights up to each build's MR (M = 2..64
    # in equal tiles), two or three K blocks, NaN past the M columns of
    # each row.
    ld = ld_bytes // np.dtype(dtype).itemsize
    for K, N in ((45, 33), (600, 70)):
        for M in (2, 5, 6, 7, 12, 13, 14, 29, 64):
            rng = rng_for("at 2 KiB", isa, dtype_id(dtype), M, K, ld)
            base = np.full((K, ld), np.nan, dtype)
            base[:, :M] = randn(rng, (K, M), dtype)
            at = base[:, :M]
            b = randn(rng, (K, N), dtype)
            got = GEMM[dtype](1.0, at, b, trans_a=True)
            check_gemm(got, 1.0, at.T, b, 0.0, None, dtype)


@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_narrow_b_next_to_transposed_a(isa, dtype, nt):
    # Next to an A.T view, a B of whole panels at most 256 bytes a row is
    # read in place on builds whose panel rows are two lines or more
    # (AVX-512), packed on the others: N = 16, 32, 64 (whole panels, in
    # place where they fit), 48 (a partial panel) and 96 (too wide), B a
    # column slice of a wider array with NaN past its columns, K over one
    # to three K blocks (each tile prefetches its share of the next block's
    # rows, of B as well as of A), alpha and beta on C, bias and relu6.
    with _dispatch.use_isa(isa) as k:
        for N in (16, 32, 48, 64, 96):
            for M, K in ((13, 7), (37, 600), (256, 1000)):
                rng = rng_for("narrow b", isa, dtype_id(dtype), nt, N, M, K)
                at = np.full((K, M + 5), np.nan, dtype)
                at[:, :M] = randn(rng, (K, M), dtype)
                wide = np.full((K, N + 24), np.nan, dtype)
                wide[:, 8:8 + N] = randn(rng, (K, N), dtype)
                b = wide[:, 8:8 + N]
                c = randn(rng, (M, N), dtype)
                fastconv.set_num_threads(nt)
                got = GEMM[dtype](0.75, at[:, :M], b, -1.5, c, trans_a=True)
                check_gemm(got, 0.75, at[:, :M].T, b, -1.5, c, dtype)
                bias = randn(rng, (N,), dtype)
                out = empty_aligned((M, N), dtype)
                k.gemm(1.0, at[:, :M].T, b, 0.0, out, nt, bias, 2)
                a64 = at[:, :M].T.astype(np.float64)
                ref = np.clip(a64 @ b + bias, 0, 6)
                scale = np.abs(a64) @ np.abs(b) + np.abs(bias)
                bound = np.finfo(dtype).eps * (4 * math.sqrt(K) + 4) * scale
                assert np.all(np.abs(out - ref) <= bound), (N, M, K)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_broadcast_b_next_to_transposed_a(isa, dtype):
    # A B whose rows are all the same memory (row stride 0, np.broadcast_to)
    # next to an A.T view: a zero row stride is the frame's mark of a packed
    # B, and the AVX-512 build read such a B as packed panels, past its end
    # (garbage or NaN for whole-panel N, found by fuzzing); it is packed.
    with _dispatch.use_isa(isa):
        for N in (16, 32, 64, 96):
            for M, K in ((2, 2), (13, 7), (37, 600)):
                rng = rng_for("broadcast b", isa, dtype_id(dtype), N, M, K)
                at = randn(rng, (K, M), dtype)
                b = np.broadcast_to(randn(rng, (1, N), dtype), (K, N))
                got = GEMM[dtype](1.0, at, b, trans_a=True)
                check_gemm(got, 1.0, at.T, b, 0.0, None, dtype)


# ------------------------------------- strided / negative-stride operands

@pytest.mark.parametrize("b_layout", LAYOUTS)
@pytest.mark.parametrize("a_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M, N, K", [(29, 35, 270), (1, 35, 270), (29, 1, 270)],
                         ids=["gemm", "row", "column"])   # one row/column: the GEMV path
def test_operand_layouts(isa, dtype, a_layout, b_layout, M, N, K):
    rng = rng_for("layouts", isa, dtype_id(dtype), a_layout, b_layout, M, N)
    a0, b0, c0 = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    a, _ = layout(a0, a_layout)
    b, _ = layout(b0, b_layout)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)
    got = GEMM[dtype](0.75, a, b, 1.5, c0)
    check_gemm(got, 0.75, a0, b0, 1.5, c0, dtype)
    # transposed flags on transposed views: same product
    got = GEMM[dtype](0.75, a.T, b.T, 1.5, c0, trans_a=True, trans_b=True)
    check_gemm(got, 0.75, a0, b0, 1.5, c0, dtype)


@pytest.mark.parametrize("beta", [0.0, 0.75])
@pytest.mark.parametrize("c_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M, N, K", [(31, 70, 300), (1, 70, 300), (2500, 1, 300)],
                         ids=["gemm", "row", "column"])
def test_c_layouts_in_place(isa, dtype, c_layout, beta, M, N, K):
    """overwrite_c=True writes into any writeable view of c (transposed,
    sliced, negative strides) and nowhere else."""
    sentinel = -777.0
    rng = rng_for("clayout", isa, dtype_id(dtype), c_layout, beta, M, N)
    a, b, c0 = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    c, base = layout(c0, c_layout, fill=sentinel)
    outside = base == sentinel            # the gaps of the strided layouts
    assert outside.sum() == base.size - c.size
    got = GEMM[dtype](1.25, a, b, beta, c, overwrite_c=True)
    check_gemm(got, 1.25, a, b, beta, c0, dtype)
    check_gemm(c, 1.25, a, b, beta, c0, dtype)           # written in place
    assert got is c
    assert np.all(base[outside] == sentinel)              # nothing else touched

    # overwrite_c=False: same answer, c untouched
    c2, _ = layout(c0, c_layout, fill=sentinel)
    got = GEMM[dtype](1.25, a, b, beta, c2, overwrite_c=False)
    check_gemm(got, 1.25, a, b, beta, c0, dtype)
    np.testing.assert_array_equal(c2, c0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("operand", ["a", "b", "c"])
@pytest.mark.parametrize("kind", ["strided", "neg", "F", "strided_T", "neg_strided"])
def test_strided_views_are_not_copied(dtype, operand, kind):
    """Views are read (and c written) in place: no operand-sized allocation."""
    rng = rng_for("nocopy", dtype_id(dtype), operand, kind)
    big, small = 1200, 3
    if operand == "a":      # a: 1200 x 900, b: 900 x 3
        x0 = randn(rng, (big, 900), dtype)
        x, _ = layout(x0, kind)
        other = randn(rng, (900, small), dtype)
        call = lambda: GEMM[dtype](1.0, x, other)
        expect = (x0, other, None)
    elif operand == "b":    # a: 3 x 900, b: 900 x 1200
        x0 = randn(rng, (900, big), dtype)
        x, _ = layout(x0, kind)
        other = randn(rng, (small, 900), dtype)
        call = lambda: GEMM[dtype](1.0, other, x)
        expect = (other, x0, None)
    else:                   # c: 1200 x 900, written in place
        x0 = randn(rng, (big, 900), dtype)
        x, _ = layout(x0, kind)
        a = randn(rng, (big, small), dtype)
        b = randn(rng, (small, 900), dtype)
        call = lambda: GEMM[dtype](1.0, a, b, 0.5, x, overwrite_c=True)
        expect = (a, b, x0.copy())
    tracemalloc.start()
    try:
        got = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes // 8, f"peak {peak} bytes for a {x.nbytes}-byte operand: copied?"
    if operand == "c":
        assert np.shares_memory(got, x)
        check_gemm(x, 1.0, expect[0], expect[1], 0.5, expect[2], dtype)
    else:
        check_gemm(got, 1.0, expect[0], expect[1], 0.0, None, dtype)


def test_non_element_strides_are_copied_and_correct(isa):
    """A float32 field of a packed record array has a stride of 5 bytes."""
    rng = rng_for("records", isa)
    rec = np.zeros((40, 33), dtype=[("x", "<f4"), ("pad", "i1")])
    rec["x"] = rng.standard_normal((40, 33))
    a = rec["x"]
    assert a.strides[1] == 5
    b = randn(rng, (33, 21), np.float32)
    check_gemm(fastconv.sgemm(1.0, a, b), 1.0, np.array(a), b, 0.0, None, np.float32)
    check_gemm(fastconv.matmul(b.T, a.T), 1.0, b.T, np.array(a).T, 0.0, None, np.float32)


# ------------------------------------------- blocking / micro-tile edges

def _edge_shapes(tile, blocking):
    """(M, N, K) just below/above multiples of the micro-tile MR x NR and of
    every blocking size the kernel module reports (MC -> M, NC -> N, KC -> K),
    plus every row count 1..MR of a last, partial panel of A."""
    MR, NR = tile
    KC, NC = blocking["KC"], blocking["NC"]
    MC = blocking.get("MC")                 # not every kernel generation blocks M
    m0, n0, k0 = MR + 1, NR + 1, KC + 1     # awkward defaults: edge tiles, 2 K blocks
    ms = set(range(1, 2 * MR + 2)) | {3 * MR - 1, 3 * MR, 4 * MR + 1}
    if MC:
        ms |= {MC - 1, MC, MC + 1, 2 * MC + 1}
    ns = {1, NR - 1, NR, NR + 1, 2 * NR - 1, NC - 1, NC, NC + 1, 2 * NC + 1}
    ks = {1, 2, KC - 1, KC, KC + 1, 2 * KC - 1, 2 * KC, 2 * KC + 1, 3 * KC + 1}
    shapes = {(m, n0, k0) for m in ms} | {(m0, n, k0) for n in ns} | {(m0, n0, k) for k in ks}
    big_m = MC if MC else 16 * MR
    shapes |= {(big_m + 1, NC + 1, KC + 1), (big_m - 1, NC - 1, KC - 1), (big_m, NC, KC),
               (2 * MR, 2 * NR, KC), (2 * big_m + 1, 2 * NC + 1, 2 * KC + 1),
               (MR - 1, 2 * NC + 1, 2 * KC)}
    return sorted(x for x in shapes if min(x) >= 1)


def _edge_cases():
    cases = []
    for isa_name in AVAILABLE:
        with _dispatch.use_isa(isa_name) as k:
            for dtype, tile, blk in ((np.float32, k.TILE_F32, k.BLOCKING_F32),
                                     (np.float64, k.TILE_F64, k.BLOCKING_F64)):
                for s in _edge_shapes(tile, blk):
                    cases.append(pytest.param(isa_name, dtype, s,
                                              id=f"{isa_name}-{dtype_id(dtype)}-{s}"))
    return cases


@contextlib.contextmanager
def kernel_setting(setter_name, value):
    """Every ISA build's module-level tuning knob set to value for the
    block, restored after."""
    previous = {}
    for isa_name in AVAILABLE:
        with _dispatch.use_isa(isa_name) as k:
            previous[isa_name] = getattr(k, setter_name)(value)
    try:
        yield
    finally:
        for isa_name, old in previous.items():
            with _dispatch.use_isa(isa_name) as k:
                getattr(k, setter_name)(old)


@pytest.fixture(params=["pack-all", "pack-per-block", "pack-all-streamed"])
def b_packing(request):
    """gemm packs a B of up to 8 MiB whole, a larger one a KC x NC block at a
    time; a zero budget drives the block-at-a-time path with small shapes.
    A C above a few MiB written in one K block is stored with non-temporal
    stores; a zero threshold drives that path with small shapes."""
    setting = {"pack-all": None, "pack-per-block": ("set_pack_all_bytes", 0),
               "pack-all-streamed": ("set_stream_bytes", 0)}[request.param]
    if setting is None:
        yield request.param
        return
    with kernel_setting(*setting):
        yield request.param


@pytest.mark.parametrize("isa_name, dtype, shape", _edge_cases())
def test_blocking_edges(isa_name, dtype, shape, b_packing):
    """M, N, K just below/above multiples of the micro-tile and of MC/NC/KC,
    with every packing path (row-/column-major a and b, transposed c; B
    packed whole or a block at a time) and 1 vs 2 threads."""
    M, N, K = shape
    rng = rng_for("edges", isa_name, dtype_id(dtype), *shape)
    a0, b0, c0 = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    f = GEMM[dtype]
    with _dispatch.use_isa(isa_name):
        for trans_a, trans_b, c_order in ((False, False, "C"), (True, False, "F"),
                                          (False, True, "F"), (True, True, "C")):
            a = np.ascontiguousarray(a0.T) if trans_a else a0
            b = np.ascontiguousarray(b0.T) if trans_b else b0
            c = np.array(c0, order=c_order)
            got = f(-1.25, a, b, 0.5, c, trans_a=trans_a, trans_b=trans_b, overwrite_c=True)
            assert np.shares_memory(got, c)
            check_gemm(c, -1.25, a0, b0, 0.5, c0, dtype)
        results = []
        for nt in (1, 2):
            fastconv.set_num_threads(nt)
            results.append(f(1.0, a0, b0))
            check_gemm(results[-1], 1.0, a0, b0, 0.0, None, dtype)
    ref, scale = reference(1.0, a0, b0)
    check(results[1], results[0].astype(np.float64), 2 * scale, K, dtype)


@pytest.mark.parametrize("activation", ["none", "relu", "relu6"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M, N, K", [(50, 64, 30), (37, 70, 200), (13, 48, 5), (40, 33, 500)],
                         ids=str)
def test_streamed_c_epilogue(isa, dtype, M, N, K, activation):
    """C stored with non-temporal stores (threshold forced to 0) gets the
    same bias and fused relu/relu6 as plain stores, NaN kept, for a 64-byte
    aligned C (full tiles stream, edge tiles do not) and for a C whose rows
    are not vector-aligned (nothing streams).  K = 500 is two K blocks,
    which never stream."""
    rng = rng_for("streamed", isa, dtype_id(dtype), M, N, K, activation)
    a, b, bias = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (N,), dtype)
    a[3, 1] = np.nan                       # row 3 of C is NaN
    ref = a.astype(np.float64) @ b.astype(np.float64) + bias
    ref_abs = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(bias)
    if activation != "none":
        ref = np.where(ref < 0, 0.0, ref)
    if activation == "relu6":
        ref = np.where(ref > 6, 6.0, ref)
    act = {"none": 0, "relu": 1, "relu6": 2}[activation]
    aligned = empty_aligned((M, N), dtype)
    misaligned = empty_aligned((M, N + 1), dtype)[:, 1:]
    with kernel_setting("set_stream_bytes", 0):
        for c in (aligned, misaligned):
            c[...] = 7
            with _dispatch.use_isa(isa) as k:
                k.gemm(1.0, a, b, 0.0, c, 2, bias, act)
            assert np.array_equal(np.isnan(c), np.isnan(ref))
            finite = ~np.isnan(ref)
            bound = np.finfo(dtype).eps * (4 * math.sqrt(K) + 4) * ref_abs
            assert np.all(np.abs(c[finite] - ref[finite]) <= bound[finite])



@pytest.mark.parametrize("streamed", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("nt", [1, 2])
def test_paired_panels(isa, nt, streamed):
    """The AVX-512 float32 frame multiplies shallow K blocks (K <= 128) two
    B panels at a time, each row tile in two halves (6 x 64 tiles): every
    row count of a tile (M = 1..25, odd halves), a lone or partial panel
    after the pairs (N = 64, 65, 96, 127, 160), A in place or copied (rows
    2 KiB apart), alpha/beta on C, bias and relu6 fused, C stored plainly
    or streamed (threshold 0), 1 and 2 threads; on the other builds the
    same calls run the single-panel path."""
    rng = rng_for("pairs", isa, nt, streamed)
    fastconv.set_num_threads(nt)
    setting = kernel_setting("set_stream_bytes", 0) if streamed else contextlib.nullcontext()
    with setting, _dispatch.use_isa(isa) as k:
        for M in (1, 2, 7, 11, 12, 13, 23, 25, 61):
            for N in (64, 65, 96, 127, 160):
                for K in (1, 64, 128):
                    wide = randn(rng, (M, 512), np.float32)
                    for a in (np.ascontiguousarray(wide[:, :K]), wide[:, :K]):
                        b, c = randn(rng, (K, N), np.float32), randn(rng, (M, N), np.float32)
                        got = GEMM[np.float32](0.75, a, b, -1.5, c)
                        check_gemm(got, 0.75, a, b, -1.5, c, np.float32)
                        bias = randn(rng, (N,), np.float32)
                        out = empty_aligned((M, N), np.float32)
                        k.gemm(1.0, a, b, 0.0, out, nt, bias, 2)
                        ref = np.clip(a.astype(np.float64) @ b + bias, 0, 6)
                        scale = np.abs(a.astype(np.float64)) @ np.abs(b) + np.abs(bias)
                        bound = np.finfo(np.float32).eps * (4 * math.sqrt(K) + 4) * scale
                        assert np.all(np.abs(out - ref) <= bound), (M, N, K)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nt", [1, 2])
def test_short_m_path(isa, dtype, nt):
    """A short A times a transposed row-major B (x @ W.T, a 1x1
    convolution's product on a 7x7 image): the AVX-512 build (and AVX2's
    for float32, two vectors a kernel call, longer M in blocks of them)
    runs it by the short-M kernels, W's rows read in place and A^T packed,
    the last row of A riding as dot products where the rows before it fill
    whole vectors (M = 17, 33, 49 float32 on AVX-512; 9, 17, 25, 33, 41, 49
    on AVX2, the extra row in each block position; 9, 17, 49 float64).
    Every vector count (1-3 AVX-512 float32 vectors, 1-6 AVX2 ones over 1-3
    blocks, 1-6 float64), with and without that extra row; K with and
    without a tail past the
    last vector (512, 521); N a multiple of the tile's rows and not
    (M..., 61, 515); A's rows in place 3 KiB apart; alpha/beta on C (C
    also column-major); bias and relu/relu6 fused; beta 0 over a C of
    NaN; against float64 and against the same product with the path
    turned off.  Other builds run the GEMM frame for the same calls."""
    rng = rng_for("short-m", isa, dtype_id(dtype), nt)
    fastconv.set_num_threads(nt)
    f = GEMM[dtype]
    vl = 64 // np.dtype(dtype).itemsize
    rows = sorted({2, 3, vl - 1, vl, vl + 1, 9, 12, 20, 25, 2 * vl + 1, 28, 31, 40, 41, 47, 48,
                   49})
    with _dispatch.use_isa(isa) as k:
        for M in rows:
            for K in (512, 521):
                wide = randn(rng, (M, 768), dtype)
                a = wide[:, :K]                        # rows in place, 3 KiB apart
                for N in sorted({M, 61, 515}):
                    w = randn(rng, (N, K), dtype)
                    applies = k.short_m_gemm_applies(M, N, K, np.dtype(dtype).name)
                    assert applies == has_short_m(isa, dtype), (M, N, K)
                    c = randn(rng, (M, N), dtype)
                    for c_order in ("C", "F"):
                        cc = np.array(c, order=c_order)
                        got = f(0.75, a, w, -1.5, cc, trans_b=True, overwrite_c=True)
                        check_gemm(got, 0.75, a, w.T, -1.5, c, dtype)
                    nan_c = np.full((M, N), np.nan, dtype)
                    got = f(1.0, a, w, 0.0, nan_c, trans_b=True)
                    check_gemm(got, 1.0, a, w.T, 0.0, None, dtype)
                    previous = k.set_short_m(False)
                    try:
                        frame = f(1.0, a, w, trans_b=True)
                    finally:
                        k.set_short_m(previous)
                    np.testing.assert_allclose(got, frame, rtol=0,
                                               atol=float(np.abs(frame).max()) * 1e-5
                                               if dtype == np.float32 else 1e-11)
                    bias = randn(rng, (N,), dtype)
                    for act, hi in ((1, np.inf), (2, 6.0)):
                        out = empty_aligned((M, N), dtype)
                        k.gemm(1.0, a, w.T, 0.0, out, nt, bias, act)
                        exact = a.astype(np.float64) @ w.T.astype(np.float64) + bias
                        ref = np.clip(exact, 0, hi)
                        scale = np.abs(a.astype(np.float64)) @ np.abs(w.T) + np.abs(bias)
                        bound = np.finfo(dtype).eps * (4 * math.sqrt(K) + 4) * scale
                        assert np.all(np.abs(out - ref) <= bound), (M, N, K, act)


@pytest.mark.parametrize("isa", AVAILABLE)
def test_short_m_reach(isa):
    """Where the builds take the short-M kernels: 2..49 rows, N no shorter
    than M, K >= 512, and A^T as packed within 512 KiB: 49 rows are 3
    AVX-512 float32 vectors (or 6 AVX2 ones), the 49th riding as the extra
    row, and 6 AVX-512 float64 ones, so K up to 2730 float32 and 1365
    float64.  AVX2 float64 and the baseline build: never."""
    with _dispatch.use_isa(isa) as k:
        applies = k.short_m_gemm_applies
        for dtype in ("float32", "float64"):
            if not has_short_m(isa, dtype):
                for M, N, K in ((49, 512, 2048), (17, 1024, 1024), (2, 2, 512)):
                    assert not applies(M, N, K, dtype)
                continue
            most_k = 2730 if dtype == "float32" else 1365
            assert applies(49, 512, most_k, dtype) and not applies(49, 512, most_k + 1, dtype)
            assert applies(48, 512, most_k, dtype)             # whole vectors, no extra row
            assert not applies(50, 512, 1024, dtype)           # past 48 rows and one
            assert applies(2, 2, 512, dtype) and not applies(1, 2, 512, dtype)
            assert not applies(49, 48, 1024, dtype)            # W shorter than A
            assert not applies(49, 512, 511, dtype)            # too shallow


def test_short_m_concurrent_python_threads(isa):
    """4 Python threads running short-M products (x @ W.T, 17-49 rows) at
    once get exactly the results of the same calls made one at a time: the
    packed x^T is per call, W only read."""
    rng = rng_for("short-m-concurrent", isa)
    jobs = []
    for i in range(4):
        dtype = DTYPES[i % 2]
        M, N, K = 49 - 8 * i, 520 + 7 * i, 600 + 16 * i
        jobs.append((dtype, randn(rng, (M, K), dtype), randn(rng, (N, K), dtype)))
    with _dispatch.use_isa(isa) as k:
        assert all(k.short_m_gemm_applies(a.shape[0], w.shape[0], a.shape[1],
                                          np.dtype(d).name) == has_short_m(isa, d)
                   for d, a, w in jobs)
        expected = [GEMM[d](1.0, a, w, trans_b=True) for d, a, w in jobs]
        results = in_lockstep(len(jobs), 6, fastconv.get_num_threads(),
                              lambda i, r: GEMM[jobs[i][0]](1.0, jobs[i][1], jobs[i][2],
                                                            trans_b=True))
    for i, e in enumerate(expected):
        for r, got in enumerate(results[i]):
            np.testing.assert_array_equal(got, e, err_msg=f"job {i} round {r}")


# ------------------------------------------------------------- threads

THREAD_SHAPES = [
    (5, 1000, 1000),     # fewer MR panels than threads: threads split N panels
    (25, 300, 600),      # a few panels per thread
    (449, 513, 513),     # several MC, NC and KC blocks
    (3000, 8, 200),      # tall
    (8, 3000, 200),      # wide
]


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_one_vs_two_threads(isa, dtype, shape):
    M, N, K = shape
    assert 2 * M * N * K >= 4e6          # big enough that 2 threads are used
    rng = rng_for("threads", isa, dtype_id(dtype), *shape)
    a, b, c = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    out = {}
    for nt in (1, 2):
        fastconv.set_num_threads(nt)
        assert fastconv.get_num_threads() == nt
        out[nt] = GEMM[dtype](0.7, a, b, -1.1, c)
        check_gemm(out[nt], 0.7, a, b, -1.1, c, dtype)
    _, scale = reference(0.7, a, b, -1.1, c)
    check(out[2], out[1].astype(np.float64), 2 * scale, K, dtype)


@pytest.mark.parametrize("nt", [3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_more_threads_than_cores(isa, dtype, nt):
    """Thread counts that are not powers of two / exceed the cores split the
    work in other ways (e.g. 3 = 3x1 or 1x3); the answer must not change."""
    for shape in ((7, 700, 500), (40, 90, 600), (200, 40, 300)):
        M, N, K = shape
        rng = rng_for("nt", isa, dtype_id(dtype), nt, *shape)
        a, b, c = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
        fastconv.set_num_threads(nt)
        got = GEMM[dtype](1.0, a, b, 0.5, c)
        check_gemm(got, 1.0, a, b, 0.5, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_threadpoolctl_openmp_limit(isa, dtype):
    rng = rng_for("tpctl", isa, dtype_id(dtype))
    a, b = randn(rng, (200, 300), dtype), randn(rng, (300, 250), dtype)
    before = fastconv.get_num_threads()
    with threadpool_limits(1, "openmp"):
        assert fastconv.get_num_threads() == 1
        got = GEMM[dtype](1.0, a, b)
        check_gemm(got, 1.0, a, b, 0.0, None, dtype)
        got = fastconv.matmul(a, b)
        check_gemm(got, 1.0, a, b, 0.0, None, dtype)
    assert fastconv.get_num_threads() == before


@pytest.mark.parametrize("rounds", [8])
def test_concurrent_python_threads(isa, rounds):
    """4 Python threads calling sgemm/dgemm at once get exactly the results
    of the same calls made one at a time."""
    rng = rng_for("concurrent", isa)
    jobs = []
    for i in range(4):
        dtype = DTYPES[i % 2]
        M, N, K = 150 + 41 * i, 220 - 23 * i, 260 + 17 * i
        jobs.append((dtype, randn(rng, (M, K), dtype), randn(rng, (K, N), dtype),
                     randn(rng, (M, N), dtype)))
    nt = fastconv.get_num_threads()
    expected = [GEMM[d](1.1, a, b, 0.3, c) for d, a, b, c in jobs]
    for e, (d, a, b, c) in zip(expected, jobs):
        check_gemm(e, 1.1, a, b, 0.3, c, d)

    def call(i, r):
        d, a, b, c = jobs[i]
        if r % 2:
            out = c.copy()
            GEMM[d](1.1, a, b, 0.3, out, overwrite_c=True)
            return out
        return GEMM[d](1.1, a, b, 0.3, c)

    results = in_lockstep(len(jobs), rounds, nt, call)
    for i, e in enumerate(expected):
        for r in range(rounds):
            np.testing.assert_array_equal(results[i][r], e, err_msg=f"job {i} round {r}")


# -------------------------------------------------------- NaN and inf

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(9, 13, 5), (37, 45, 600)], ids=str)
def test_nan_inf_propagation(isa, dtype, shape):
    M, N, K = shape
    rng = rng_for("nan", isa, dtype_id(dtype), *shape)
    a, b, c = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype), randn(rng, (M, N), dtype)
    a[3, K - 2] = np.nan
    a[7, 1] = np.inf
    b[1, 5] = 0.0                       # inf * 0 -> NaN in C[7, 5]
    b[2, 11] = -np.inf
    b[K - 1, N - 1] = np.nan            # last K slice, last (edge) column
    c[0, 0] = np.nan
    c[M - 1, 2] = np.inf
    with np.errstate(invalid="ignore"):
        # IEEE reference: explicit products, no BLAS shortcuts
        prods = a.astype(np.float64)[:, :, None] * b.astype(np.float64)[None, :, :]
        ab = prods.sum(axis=1)
        scale_ab = np.abs(prods).sum(axis=1)
    c64 = c.astype(np.float64)
    # (alpha, beta): alpha = 0 still propagates NaN/inf "as in alpha * (a @ b)"
    for alpha, beta in ((2.0, 0.0), (2.0, 0.5), (0.0, 0.5), (0.0, 0.0)):
        with np.errstate(invalid="ignore"):
            ref = alpha * ab + (beta * c64 if beta else 0.0)
            scale = abs(alpha) * scale_ab + (abs(beta) * np.abs(c64) if beta else 0.0)
        for overwrite in (False, True):
            cc = c.copy()
            got = GEMM[dtype](alpha, a, b, beta, cc, overwrite_c=overwrite)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
            np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
            assert np.isnan(got[3]).all() and np.isnan(got[:, N - 1]).all()
            assert np.isnan(got[7, 5])
            assert np.isnan(got[0, 0]) == (beta != 0)
            fin = np.isfinite(ref)
            assert fin.sum() > M * N // 3
            check(got[fin], ref[fin], scale[fin], K, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 1, 1), (13, 29, 7), (40, 300, 600), (30, 20, 0)], ids=str)
@pytest.mark.parametrize("overwrite", [False, True])
def test_beta_zero_ignores_nan_in_c(isa, dtype, shape, overwrite):
    """beta == 0: c is written, not read, even where it holds NaN or inf
    (BLAS semantics), across K blocks, N blocks and threads."""
    M, N, K = shape
    rng = rng_for("beta0", isa, dtype_id(dtype), *shape, overwrite)
    a, b = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype)
    for nt in (1, 2):
        fastconv.set_num_threads(nt)
        c = np.full((M, N), np.nan, dtype)
        c[::2, ::3] = np.inf
        c0 = c.copy()
        got = GEMM[dtype](1.0, a, b, 0.0, c, overwrite_c=overwrite)
        assert np.isfinite(got).all()
        check_gemm(got, 1.0, a, b, 0.0, None, dtype)
        if overwrite:
            assert np.shares_memory(got, c)
        else:
            np.testing.assert_array_equal(c, c0)                 # untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_subnormals_are_not_flushed(isa, dtype):
    """IEEE gradual underflow, as numpy: no flush-to-zero in the kernels."""
    tiny = np.finfo(dtype).smallest_subnormal
    a = np.full((20, 30), 4, dtype) * tiny          # every product and sum exact
    b = np.ones((30, 40), dtype)
    b[::2] = 0.5
    got = GEMM[dtype](1.0, a, b)
    assert (got > 0).all()
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b.astype(np.float64)).astype(dtype))
    got = GEMM[dtype](1.0, np.full((3, 4), np.finfo(dtype).tiny, dtype), np.full((4, 5), 0.125, dtype))
    np.testing.assert_array_equal(got, np.full((3, 5), np.finfo(dtype).tiny / 2, dtype))


# ------------------------------------------------------ size-0 dims

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("c_mode", ["none", "copy", "overwrite"])
@pytest.mark.parametrize("beta", [0.0, 2.5])
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0),
                                   (0, 5, 0), (4, 0, 0), (1, 1, 0)], ids=str)
def test_empty_dims(isa, dtype, shape, beta, c_mode):
    M, N, K = shape
    rng = rng_for("empty", isa, dtype_id(dtype), *shape, beta, c_mode)
    a, b = randn(rng, (M, K), dtype), randn(rng, (K, N), dtype)
    c = randn(rng, (M, N), dtype)
    if c.size:
        c.flat[0] = np.nan if beta == 0 else c.flat[0]     # beta=0 ignores NaN
    c0 = c.copy()
    f = GEMM[dtype]
    if c_mode == "none":
        got = f(1.5, a, b, beta)
        expected = np.zeros((M, N))
    else:
        got = f(1.5, a, b, beta, c, overwrite_c=(c_mode == "overwrite"))
        expected = beta * c0.astype(np.float64) if beta else np.zeros((M, N))
    assert got.shape == (M, N) and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, expected.astype(dtype))
    if c_mode == "overwrite":
        assert np.shares_memory(got, c) or c.size == 0
        np.testing.assert_array_equal(c, expected.astype(dtype))
    elif c_mode == "copy":
        np.testing.assert_array_equal(c, c0)
    mm = fastconv.matmul(a, b)
    assert mm.shape == (M, N) and mm.dtype == np.dtype(dtype)
    assert not mm.any()


# --------------------------------------------------------- aliasing

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("case", ["c_is_a", "c_is_b", "c_is_a_and_b", "c_is_a_T",
                                  "c_is_a_trans_a", "partial_overlap"])
def test_aliasing_with_overwrite_c(isa, dtype, case, beta):
    """c sharing memory with a and/or b (overwrite_c=True) still gives
    alpha*a@b + beta*c computed from the values before the call."""
    rng = rng_for("alias", isa, dtype_id(dtype), case, beta)
    n = 70                               # several micro-tiles, one K block
    x = randn(rng, (n, n), dtype)
    y = randn(rng, (n, n), dtype)
    x0, y0 = x.copy(), y.copy()
    f = GEMM[dtype]
    if case == "c_is_a":
        got = f(0.9, x, y, beta, x, overwrite_c=True)
        check_gemm(x, 0.9, x0, y0, beta, x0, dtype)
    elif case == "c_is_b":
        got = f(0.9, x, y, beta, y, overwrite_c=True)
        check_gemm(y, 0.9, x0, y0, beta, y0, dtype)
    elif case == "c_is_a_and_b":
        got = f(0.9, x, x, beta, x, overwrite_c=True)
        check_gemm(x, 0.9, x0, x0, beta, x0, dtype)
    elif case == "c_is_a_T":
        got = f(0.9, x, y, beta, x.T, overwrite_c=True)
        check_gemm(x.T, 0.9, x0, y0, beta, x0.T, dtype)
    elif case == "c_is_a_trans_a":
        got = f(0.9, x, y, beta, x, trans_a=True, overwrite_c=True)
        check_gemm(x, 0.9, x0.T, y0, beta, x0, dtype)
    else:  # c overlaps part of a and part of b, all three views of one array
        big = randn(rng, (2 * n, 2 * n), dtype)
        big0 = big.copy()
        av, bv, cv = big[:n, :n], big[n // 2:n // 2 + n, n // 3:n // 3 + n], big[10:10 + n, 5:5 + n]
        got = f(0.9, av, bv, beta, cv, overwrite_c=True)
        check_gemm(cv, 0.9, big0[:n, :n], big0[n // 2:n // 2 + n, n // 3:n // 3 + n],
                   beta, big0[10:10 + n, 5:5 + n], dtype)
        outside = np.ones(big.shape, bool)
        outside[10:10 + n, 5:5 + n] = False
        np.testing.assert_array_equal(big[outside], big0[outside])
        return
    assert got.shape == (n, n)


# ------------------------------------------ read-only inputs, casting

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_read_only_inputs(isa, dtype):
    rng = rng_for("readonly", isa, dtype_id(dtype))
    a, b, c = randn(rng, (30, 40), dtype), randn(rng, (40, 50), dtype), randn(rng, (30, 50), dtype)
    for x in (a, b, c):
        x.setflags(write=False)
    check_gemm(GEMM[dtype](1.0, a, b, 0.5, c), 1.0, a, b, 0.5, c, dtype)
    check_gemm(GEMM[dtype](1.0, b, a, trans_a=True, trans_b=True), 1.0, b.T, a.T, 0.0, None, dtype)
    check_gemm(fastconv.matmul(a, b), 1.0, a, b, 0.0, None, dtype)
    # zero-stride (broadcast, read-only) operands: rows, columns, a scalar
    bb = np.broadcast_to(randn(rng, (1, 50), dtype), (40, 50))
    check_gemm(GEMM[dtype](1.0, a, bb), 1.0, a, np.array(bb), 0.0, None, dtype)
    ab = np.broadcast_to(randn(rng, (1, 40), dtype), (30, 40))
    check_gemm(GEMM[dtype](1.0, ab, b), 1.0, np.array(ab), b, 0.0, None, dtype)
    ac = np.broadcast_to(randn(rng, (30, 1), dtype), (30, 40))
    check_gemm(GEMM[dtype](1.0, ac, b), 1.0, np.array(ac), b, 0.0, None, dtype)
    bs = np.broadcast_to(np.asarray(0.5, dtype), (40, 50))
    check_gemm(GEMM[dtype](1.0, a, bs), 1.0, a, np.array(bs), 0.0, None, dtype)
    # read-only c with overwrite_c=True is refused, and c is left alone
    c0 = c.copy()
    with pytest.raises(ValueError, match=r"\bc\b.*read-only|read-only.*\bc\b"):
        GEMM[dtype](1.0, a, b, 0.5, c, overwrite_c=True)
    np.testing.assert_array_equal(c, c0)


def misaligned(x):
    """A copy of x whose data pointer is not a multiple of its itemsize."""
    buf = np.zeros(x.nbytes + x.itemsize, np.uint8)
    y = buf[1:1 + x.nbytes].view(x.dtype).reshape(x.shape)
    y[...] = x
    assert not y.flags.aligned
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_misaligned_operands(isa, dtype):
    rng = rng_for("misaligned", isa, dtype_id(dtype))
    a0, b0, c0 = randn(rng, (45, 300), dtype), randn(rng, (300, 37), dtype), randn(rng, (45, 37), dtype)
    a, b, c = misaligned(a0), misaligned(b0), misaligned(c0)
    check_gemm(GEMM[dtype](1.0, a, b, 0.5, c), 1.0, a0, b0, 0.5, c0, dtype)
    check_gemm(GEMM[dtype](1.0, b, a, trans_a=True, trans_b=True), 1.0, b0.T, a0.T, 0.0, None, dtype)
    got = GEMM[dtype](1.0, a, b, 0.5, c, overwrite_c=True)
    assert got is c
    check_gemm(c, 1.0, a0, b0, 0.5, c0, dtype)


def test_sgemm_casts_other_float_dtypes(isa):
    rng = rng_for("cast", isa)
    a16 = randn(rng, (33, 70), np.float16)
    b16 = randn(rng, (70, 41), np.float16)
    a32, b32 = a16.astype(np.float32), b16.astype(np.float32)
    got = fastconv.sgemm(1.0, a16, b16)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, fastconv.sgemm(1.0, a32, b32))
    check_gemm(got, 1.0, a16, b16, 0.0, None, np.float32)
    # float64 operands are rounded to float32
    a64 = randn(rng, (33, 70), np.float64)
    got = fastconv.sgemm(1.0, a64, b16)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, fastconv.sgemm(1.0, a64.astype(np.float32), b32))
    # dgemm upcasts float16/float32 exactly
    got = fastconv.dgemm(1.0, a16, b32)
    assert got.dtype == np.float64
    check_gemm(got, 1.0, a16, b32, 0.0, None, np.float64)


# ------------------------------------------------------------ matmul

@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (np.float64, np.float64),
                                    (np.float32, np.float64), (np.float64, np.float32)],
                         ids=lambda d: f"{dtype_id(d[0])}@{dtype_id(d[1])}")
@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 45, 300), (130, 3, 513)], ids=str)
def test_matmul(isa, dtypes, shape):
    M, N, K = shape
    rng = rng_for("matmul", isa, *map(dtype_id, dtypes), *shape)
    a, b = randn(rng, (M, K), dtypes[0]), randn(rng, (K, N), dtypes[1])
    got = fastconv.matmul(a, b)
    out_dtype = np.matmul(a[:1, :1], b[:1, :1]).dtype
    assert got.dtype == out_dtype
    # mixed float32/float64 must be computed in float64 (float64 tolerance)
    check_gemm(got, 1.0, a, b, 0.0, None, out_dtype)
    va, _ = layout(a, "neg_strided")
    vb, _ = layout(b, "strided_T")
    check_gemm(fastconv.matmul(va, vb), 1.0, a, b, 0.0, None, out_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matmul_non_native_byte_order(dtype):
    rng = rng_for("byteorder", dtype_id(dtype))
    a = randn(rng, (5, 4), dtype)
    b = randn(rng, (4, 3), dtype)
    a_be = a.astype(np.dtype(dtype).newbyteorder())
    assert a_be.dtype.type is np.dtype(dtype).type          # numpy calls it float32/64
    check_gemm(GEMM[dtype](1.0, a_be, b), 1.0, a, b, 0.0, None, dtype)   # accepted here
    got = fastconv.matmul(a_be, b)
    check_gemm(got, 1.0, a, b, 0.0, None, np.matmul(a_be, b).dtype)


# ------------------------------------------------------- property test

@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(0, 70), N=st.integers(0, 70), K=st.integers(0, 300),
       dtype=st.sampled_from(DTYPES), trans_a=st.booleans(), trans_b=st.booleans(),
       a_layout=st.sampled_from(LAYOUTS), b_layout=st.sampled_from(LAYOUTS),
       c_layout=st.sampled_from(LAYOUTS), overwrite=st.booleans(),
       alpha=st.sampled_from([1.0, -1.0, 0.25, 3.0]), beta=st.sampled_from([0.0, 1.0, -0.5]),
       isa_name=st.sampled_from(AVAILABLE), seed=st.integers(0, 2**31 - 1))
def test_random_problems(M, N, K, dtype, trans_a, trans_b, a_layout, b_layout, c_layout,
                         overwrite, alpha, beta, isa_name, seed):
    rng = np.random.default_rng(seed)
    a0 = randn(rng, (K, M) if trans_a else (M, K), dtype)
    b0 = randn(rng, (N, K) if trans_b else (K, N), dtype)
    c0 = randn(rng, (M, N), dtype)
    a, _ = layout(a0, a_layout)
    b, _ = layout(b0, b_layout)
    c, _ = layout(c0, c_layout, fill=-777.0)
    with _dispatch.use_isa(isa_name):
        got = GEMM[dtype](alpha, a, b, beta, c, trans_a=trans_a, trans_b=trans_b,
                          overwrite_c=overwrite)
    check_gemm(got, alpha, a0.T if trans_a else a0, b0.T if trans_b else b0, beta, c0, dtype)
    if overwrite:
        np.testing.assert_array_equal(c, got)
    else:
        np.testing.assert_array_equal(c, c0)


# ------------------------------------------------------------ errors



@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("bad_shape", [(4,), (2, 3, 4), ()], ids=str)
def test_error_wrong_ndim(dtype, which, bad_shape):
    a, b = np.ones((3, 4), dtype), np.ones((4, 5), dtype)
    bad = np.ones(bad_shape, dtype)
    args = (bad, b) if which == "a" else (a, bad)
    with pytest.raises(ValueError, match=rf"^{which} .*2-D"):
        GEMM[dtype](1.0, *args)
    with pytest.raises(ValueError, match=rf"^{which} .*2-D"):
        fastconv.matmul(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("bad_dtype", [np.int32, np.int64, np.uint8, np.bool_,
                                       np.complex64, np.complex128, object, "U3"], ids=str)
def test_error_non_float_dtype(dtype, which, bad_dtype):
    a, b = np.ones((3, 4), dtype), np.ones((4, 5), dtype)
    bad = (np.ones((3, 4)) if which == "a" else np.ones((4, 5))).astype(bad_dtype)
    args = (bad, b) if which == "a" else (a, bad)
    with pytest.raises(TypeError, match=rf"^{which} "):
        GEMM[dtype](1.0, *args)
    with pytest.raises(TypeError, match=rf"^{which} "):
        fastconv.matmul(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", [
    ((3, 4), (5, 6), False, False),
    ((3, 4), (4, 6), True, False),       # op(a) is 4x3
    ((3, 4), (4, 6), False, True),       # op(b) is 6x4
    ((4, 3), (6, 4), True, True),        # 3x4 @ 4x6 is fine ... the next one is not
    ((3, 4), (4, 6), True, True),
])
def test_error_inner_dimensions(dtype, a_shape, b_shape, trans_a, trans_b):
    a, b = np.ones(a_shape, dtype), np.ones(b_shape, dtype)
    opa_k = a_shape[0] if trans_a else a_shape[1]
    opb_k = b_shape[1] if trans_b else b_shape[0]
    if opa_k == opb_k:
        got = GEMM[dtype](1.0, a, b, trans_a=trans_a, trans_b=trans_b)
        np.testing.assert_array_equal(got, np.full(got.shape, opa_k, dtype))
        return
    with pytest.raises(ValueError, match="inner dimensions"):
        GEMM[dtype](1.0, a, b, trans_a=trans_a, trans_b=trans_b)
    if not (trans_a or trans_b):
        with pytest.raises(ValueError, match="inner dimensions"):
            fastconv.matmul(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("overwrite", [False, True])
def test_error_bad_c(dtype, overwrite):
    a, b = np.ones((3, 4), dtype), np.ones((4, 5), dtype)
    f = GEMM[dtype]
    other = np.float64 if dtype == np.float32 else np.float32
    for c in (np.zeros((5, 3), dtype), np.zeros((3, 4), dtype), np.zeros(15, dtype),
              np.zeros((3, 5, 1), dtype)):
        c0 = c.copy()
        with pytest.raises(ValueError, match=r"^c must have shape \(3, 5\)"):
            f(1.0, a, b, 1.0, c, overwrite_c=overwrite)
        np.testing.assert_array_equal(c, c0)
    for c in (np.zeros((3, 5), other), np.zeros((3, 5), np.int32), np.zeros((3, 5), np.float16)):
        with pytest.raises(TypeError, match=r"^c must have dtype"):
            f(1.0, a, b, 1.0, c, overwrite_c=overwrite)
    with pytest.raises(TypeError, match=r"^c must be a numpy array"):
        f(1.0, a, b, 1.0, [[0.0] * 5] * 3, overwrite_c=overwrite)


def test_error_c_with_non_element_strides_in_place():
    rec = np.zeros((3, 5), dtype=[("x", "<f4"), ("pad", "i1")])
    c = rec["x"]
    assert c.strides[1] % c.itemsize
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"^c has strides"):
        fastconv.sgemm(1.0, a, b, 1.0, c, overwrite_c=True)
    np.testing.assert_array_equal(c, 0)
    # without overwrite_c it is just read
    np.testing.assert_array_equal(fastconv.sgemm(1.0, a, b, 1.0, c), 4.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", ["alpha", "beta"])
@pytest.mark.parametrize("value", [1j, None, "1.0", [1.0]], ids=repr)
def test_error_bad_scalars(dtype, name, value):
    a, b, c = np.ones((3, 4), dtype), np.ones((4, 5), dtype), np.ones((3, 5), dtype)
    kwargs = {"alpha": 1.0, "beta": 1.0, name: value}
    with pytest.raises(TypeError, match=rf"^{name} "):
        GEMM[dtype](kwargs["alpha"], a, b, kwargs["beta"], c)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_numpy_scalars_accepted(dtype):
    a, b, c = np.ones((3, 4), dtype), np.ones((4, 5), dtype), np.ones((3, 5), dtype)
    got = GEMM[dtype](np.float32(2.0), a, b, np.int64(3), c)
    np.testing.assert_array_equal(got, np.full((3, 5), 11.0, dtype))
