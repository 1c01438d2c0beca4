"""Property-based fuzzing of every public function's arguments (hypothesis,
derandomized: the same cases on every run).

Each generated call mixes ordinary and hostile arguments: zero-size
dimensions, huge zero-stride broadcast batches (2**40 images), negative,
zero, float, bool and string strides/paddings/groups, wrong dtypes
(float16, ints, bool, complex, object arrays, nested lists), wrong ndim
and shapes, read-only, misaligned, non-element-strided, negative-strided,
Fortran-ordered and broadcast operands, and for the GEMMs a ``c`` that is
``a`` or ``b`` itself, overlaps them, is read-only or of the wrong kind.
A small model of the documented argument rules says whether each call is
valid.  The property: a valid call returns what a float64 numpy reference
computes (direct tap-by-tap sums, independent of fastconv; itself checked
against PyTorch below), in the right shape and dtype, leaving its inputs
untouched; an invalid one raises ValueError or TypeError; a valid call
whose output cannot fit raises MemoryError.  Nothing else, and no crash.

The hypothesis tests run in a child pytest process
(test_fuzz_in_a_child_process): a segfault, abort or hang fails that one
test, and the last case started, logged before it runs, is the
reproducer.  The child runs under an address-space limit (what it has
after start-up plus 4 GiB), so a request that cannot fit fails at once
on any machine, overcommitting or not.
"""
import atexit
import collections
import fractions
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastconv

IN_CHILD = os.environ.get("FASTCONV_FUZZ_CHILD") == "1"
PKG_PARENT = str(pathlib.Path(fastconv.__file__).resolve().parents[1])
HUGE = 2 ** 40

# Examples per fuzz test (6,400 calls): ~1 minute in the child.
EXAMPLES = {"gemm": 1500, "matmul": 300, "conv2d": 1200, "conv2d_backward": 800,
            "conv_transpose2d": 700, "conv_transpose2d_backward": 500,
            "im2col": 700, "col2im": 700}

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=list(HealthCheck))


# ================================================================ the child

def test_fuzz_in_a_child_process():
    """Runs the fuzz tests below in a child pytest (see the module doc) and
    checks that each ran (nearly) all its examples, valid and invalid."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cases.log")
        counts_file = os.path.join(tmp, "counts.json")
        env = dict(os.environ, FASTCONV_FUZZ_CHILD="1", FASTCONV_FUZZ_LOG=log,
                   FASTCONV_FUZZ_COUNTS=counts_file, PYTHONFAULTHANDLER="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
             "-k", "fuzz_ and not in_a_child", str(pathlib.Path(__file__).resolve())],
            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += "\n*** the fuzz child hung (killed after 900 s)"
        last_cases = open(log).read().splitlines()[-3:] if os.path.exists(log) else []
        if proc.returncode != 0:
            how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            pytest.fail(f"fuzz child failed ({how}); last cases started:\n  "
                        + "\n  ".join(last_cases) + "\n--- output\n" + out[-8000:])
        counts = json.load(open(counts_file))
    print("fuzz cases:", json.dumps(counts, sort_keys=True))
    for name, n in EXAMPLES.items():
        c = counts.get(name, {})
        assert sum(c.values()) >= 0.8 * n, (name, c)
        assert c.get("ok", 0) >= 0.2 * n, (name, c)            # valid calls checked
        assert c.get("ValueError", 0) + c.get("TypeError", 0) > 0, (name, c)


# ============================================================ bookkeeping

COUNTS = collections.defaultdict(collections.Counter)
_LOG_FD = None


def _write_counts():
    path = os.environ.get("FASTCONV_FUZZ_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(COUNTS, f)


class Invalid(Exception):
    """The model's verdict: this call must raise ValueError or TypeError."""


def log_case(name, desc):
    global _LOG_FD
    path = os.environ.get("FASTCONV_FUZZ_LOG")
    if path:
        if _LOG_FD is None:
            _LOG_FD = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(_LOG_FD, f"{name}: {desc}\n".encode())


def run_case(name, desc, valid, call, check, huge=False):
    """valid: the model's verdict; huge: a valid call whose output cannot
    fit (MemoryError) unless it is empty."""
    log_case(name, desc)
    try:
        result = call()
    except MemoryError as e:
        COUNTS[name]["MemoryError"] += 1
        assert valid and huge, f"unexpected MemoryError: {e}\n{desc}"
        return
    except (ValueError, TypeError) as e:
        COUNTS[name][type(e).__name__] += 1
        assert not valid, f"valid call refused: {e!r}\n{desc}"
        return
    COUNTS[name]["ok"] += 1
    assert valid, f"invalid call accepted\n{desc}"
    check(result)


if IN_CHILD:
    import resource

    atexit.register(_write_counts)
    # Room for the tests; anything bigger fails with MemoryError at once.
    with open("/proc/self/status") as _f:
        _vm = next(int(line.split()[1]) * 1024 for line in _f if line.startswith("VmSize:"))
    fastconv.set_num_threads(2)                # start the OpenMP pool first
    fastconv.conv2d(np.ones((2, 40, 40, 16), np.float32), np.ones((16, 3, 3, 16), np.float32))
    resource.setrlimit(resource.RLIMIT_AS,
                       (_vm + (4 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))


# ============================================================ the model

def _is_seq(v):
    return isinstance(v, (tuple, list)) or (isinstance(v, np.ndarray) and v.ndim == 1)


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def m_int(v):
    if not _is_int(v):
        raise Invalid(f"not an int: {v!r}")
    return int(v)


def m_pair(v):
    if _is_seq(v):
        if len(v) != 2:
            raise Invalid(f"not a pair: {v!r}")
        return (m_int(v[0]), m_int(v[1]))
    v = m_int(v)
    return (v, v)


def m_positive_pair(v):
    p = m_pair(v)
    if min(p) < 1:
        raise Invalid(f"not positive: {v!r}")
    return p


def m_explicit_pads(padding):
    if isinstance(padding, str):
        raise Invalid("string padding")
    if _is_seq(padding) and len(padding) == 2 and all(_is_seq(p) for p in padding):
        pads = tuple(m_pair(p) for p in padding)
    else:
        ph, pw = m_pair(padding)
        pads = ((ph, ph), (pw, pw))
    if min(min(p) for p in pads) < 0:
        raise Invalid("negative padding")
    return pads


def m_conv_pads(padding, hw, kernel, stride, dilation):
    if padding == "valid":
        return ((0, 0), (0, 0))
    if padding == "same":                     # SAME_UPPER
        pads = []
        for n, k, s, d in zip(hw, kernel, stride, dilation):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return m_explicit_pads(padding)


def m_out_hw(hw, kernel, stride, pads, dilation):
    out = []
    for n, k, s, (lo, hi), d in zip(hw, kernel, stride, pads, dilation):
        span = (k - 1) * d + 1
        if n + lo + hi < span:
            raise Invalid("kernel larger than the padded input")
        out.append((n + lo + hi - span) // s + 1)
    return tuple(out)


def m_mode_pads(pads, hw, mode):
    for n, (lo, hi) in zip(hw, pads):
        if mode == "reflect" and max(lo, hi) >= n:
            raise Invalid("reflect padding >= size")
        if mode == "circular" and max(lo, hi) > n:
            raise Invalid("circular padding > size")
        if mode == "replicate" and n == 0 and lo + hi > 0:
            raise Invalid("replicate padding of an empty axis")


FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def m_float_array(spec, ndim):
    """The dtype a conv argument has once fastconv sees it, or Invalid."""
    dtype = np.dtype(np.float64) if spec.memory == "list" else np.dtype(spec.dtype)
    if dtype not in FLOATS:
        raise Invalid(f"dtype {dtype}")
    if len(spec.shape) != ndim:
        raise Invalid(f"ndim {len(spec.shape)}")
    return dtype


def m_choice(v, options):
    if not isinstance(v, str) or v not in options:
        raise Invalid(f"bad choice {v!r}")
    return v


# ============================================================ operands

class Spec:
    """An operand to build: logical values (float64, C order, in the
    caller's layout), the dtype and memory layout to hand to fastconv."""

    def __init__(self, values, dtype, memory):
        self.values, self.dtype, self.memory = values, dtype, memory
        self.shape = values.shape

    def __repr__(self):
        return f"<{np.dtype(self.dtype).name}{list(self.shape)} {self.memory}>"


NEUTRAL = ["contiguous", "contiguous", "contiguous", "readonly", "reversed", "strided",
           "fortran", "misaligned", "nonelement", "broadcast", "list"]
BAD_DTYPES = [np.float16, np.int32, np.int64, np.bool_, np.complex64, object]


def build(spec):
    """(array handed to fastconv, the float64 values fastconv must see)."""
    v, memory = spec.values, spec.memory
    if memory == "broadcast":
        v = np.ascontiguousarray(np.broadcast_to(v[:1], v.shape)) if v.shape[0] else v
    dtype = np.dtype(spec.dtype)
    if dtype.kind in "fc":
        typed = v.astype(dtype)
    elif dtype.kind == "b":
        typed = v > 0
    elif dtype.kind == "O":
        typed = v.astype(object)
    else:
        typed = np.round(v).astype(dtype)
    seen = typed.astype(np.float64) if dtype.kind in "f" else v
    if memory == "list":
        return typed.tolist(), seen
    if memory == "broadcast":
        return np.broadcast_to(typed[:1] if typed.shape[0] else typed, typed.shape), seen
    if memory == "readonly":
        a = typed.copy()
        a.flags.writeable = False
        return a, seen
    if memory == "reversed":
        flip = (slice(None, None, -1),) * typed.ndim
        return typed[flip].copy()[flip], seen
    if memory == "strided":
        big = np.zeros(tuple(2 * n for n in typed.shape), typed.dtype)
        view = big[(slice(None, None, 2),) * typed.ndim]
        view[...] = typed
        return view, seen
    if memory == "fortran":
        return np.asfortranarray(typed), seen
    if memory in ("misaligned", "nonelement") and typed.dtype != object:
        item = typed.dtype.itemsize
        strides = [item] * typed.ndim
        for i in range(typed.ndim - 2, -1, -1):
            strides[i] = strides[i + 1] * typed.shape[i + 1] + (1 if memory == "nonelement" else 0)
        if memory == "nonelement" and typed.ndim == 1:
            strides[0] = item + 1
        extent = sum((n - 1) * s for n, s in zip(typed.shape, strides)) + item if typed.size else 0
        raw = np.zeros(extent + 2, np.uint8)
        a = np.ndarray(typed.shape, typed.dtype, buffer=raw, offset=1, strides=strides)
        a[...] = typed
        return a, seen
    return typed.copy(), seen


def same_values(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


# ============================================================ references

NP_MODE = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def pad_hw(x, pads, mode="zeros"):
    width = ((0, 0), *pads, (0, 0))
    return np.pad(x, width) if mode == "zeros" else np.pad(x, width, mode=NP_MODE[mode])


def taps(kernel, dilation, stride, out_hw):
    """(kh, kw, rows, cols): the input slice each tap reads for out_hw outputs."""
    (KH, KW), (dh, dw), (sh, sw), (OH, OW) = kernel, dilation, stride, out_hw
    for kh in range(KH):
        for kw in range(KW):
            yield (kh, kw, slice(kh * dh, kh * dh + (OH - 1) * sh + 1, sh),
                   slice(kw * dw, kw * dw + (OW - 1) * sw + 1, sw))


def ref_conv2d(x, w, b, stride, pads, dilation, groups, mode):
    xp = pad_hw(x, pads, mode)
    N, Hp, Wp, C = xp.shape
    OC, KH, KW, Cg = w.shape
    OH = (Hp - (KH - 1) * dilation[0] - 1) // stride[0] + 1
    OW = (Wp - (KW - 1) * dilation[1] - 1) // stride[1] + 1
    y = np.zeros((N, OH, OW, OC))
    if b is not None:
        y += b
    if y.size == 0:
        return y
    OCg = OC // groups
    for kh, kw, rows, cols in taps((KH, KW), dilation, stride, (OH, OW)):
        patch = xp[:, rows, cols]
        for g in range(groups):
            y[..., g * OCg:(g + 1) * OCg] += np.einsum(
                "nhwc,oc->nhwo", patch[..., g * Cg:(g + 1) * Cg], w[g * OCg:(g + 1) * OCg, kh, kw])
    return y


def unpad_hw(grad, pads, mode, hw):
    (t, b), (l, r) = pads
    if mode == "zeros":
        return grad[:, t:grad.shape[1] - b, l:grad.shape[2] - r]
    rows = np.pad(np.arange(hw[0]), (t, b), mode=NP_MODE[mode])
    cols = np.pad(np.arange(hw[1]), (l, r), mode=NP_MODE[mode])
    out = np.zeros((grad.shape[0], *hw, grad.shape[3]))
    for i, src_i in enumerate(rows):
        for j, src_j in enumerate(cols):
            out[:, src_i, src_j] += grad[:, i, j]
    return out


def ref_conv2d_backward(dy, x, w, stride, pads, dilation, groups, mode):
    xp = pad_hw(x, pads, mode)
    dxp = np.zeros(xp.shape)
    dw = np.zeros(w.shape)
    OC, KH, KW, Cg = w.shape
    OCg = OC // groups
    if dy.size:
        for kh, kw, rows, cols in taps((KH, KW), dilation, stride, dy.shape[1:3]):
            for g in range(groups):
                c, o = slice(g * Cg, (g + 1) * Cg), slice(g * OCg, (g + 1) * OCg)
                dxp[:, rows, cols, c] += np.einsum("nhwo,oc->nhwc", dy[..., o], w[o, kh, kw])
                dw[o, kh, kw] += np.einsum("nhwo,nhwc->oc", dy[..., o], xp[:, rows, cols, c])
    return unpad_hw(dxp, pads, mode, x.shape[1:3]), dw, dy.sum(axis=(0, 1, 2))


def transpose_full_hw(hw, kernel, stride, dilation, output_padding):
    return tuple((n - 1) * s + (k - 1) * d + 1 + op
                 for n, k, s, d, op in zip(hw, kernel, stride, dilation, output_padding))


def ref_conv_transpose2d(x, w, b, stride, pads, output_padding, groups, dilation):
    N, H, W, C = x.shape
    _, KH, KW, OCg = w.shape
    Cg = C // groups
    FH, FW = transpose_full_hw((H, W), (KH, KW), stride, dilation, output_padding)
    out = np.zeros((N, FH, FW, OCg * groups))
    if x.size:
        for kh, kw, rows, cols in taps((KH, KW), dilation, stride, (H, W)):
            for g in range(groups):
                out[:, rows, cols, g * OCg:(g + 1) * OCg] += np.einsum(
                    "nhwc,cx->nhwx", x[..., g * Cg:(g + 1) * Cg], w[g * Cg:(g + 1) * Cg, kh, kw])
    (t, bt), (l, r) = pads
    y = out[:, t:FH - bt, l:FW - r]
    return y + b if b is not None else y


def ref_conv_transpose2d_backward(dy, x, w, stride, pads, output_padding, groups, dilation):
    N, H, W, C = x.shape
    _, KH, KW, OCg = w.shape
    Cg = C // groups
    FH, FW = transpose_full_hw((H, W), (KH, KW), stride, dilation, output_padding)
    (t, _), (l, _) = pads
    full = np.zeros((N, FH, FW, dy.shape[3]))
    full[:, t:t + dy.shape[1], l:l + dy.shape[2]] = dy
    gx, gw = np.zeros(x.shape), np.zeros(w.shape)
    if x.size:
        for kh, kw, rows, cols in taps((KH, KW), dilation, stride, (H, W)):
            for g in range(groups):
                c, o = slice(g * Cg, (g + 1) * Cg), slice(g * OCg, (g + 1) * OCg)
                patch = full[:, rows, cols, o]
                gx[..., c] += np.einsum("nhwx,cx->nhwc", patch, w[c, kh, kw])
                gw[c, kh, kw] += np.einsum("nhwc,nhwx->cx", x[..., c], patch)
    return gx, gw, dy.sum(axis=(0, 1, 2))


def ref_im2col(x, kernel, stride, pads, dilation, out_hw):
    xp = pad_hw(x, pads)
    N, C = x.shape[0], x.shape[3]
    cols = np.zeros((N, *out_hw, *kernel, C))
    if cols.size:
        for kh, kw, rows, cs in taps(kernel, dilation, stride, out_hw):
            cols[:, :, :, kh, kw] = xp[:, rows, cs]
    return cols.reshape(N * out_hw[0] * out_hw[1], kernel[0] * kernel[1] * C)


def ref_col2im(cols, shape, kernel, stride, pads, dilation, out_hw):
    N, H, W, C = shape
    (t, b), (l, r) = pads
    xp = np.zeros((N, H + t + b, W + l + r, C))
    c6 = cols.reshape(N, *out_hw, *kernel, C)
    if c6.size:
        for kh, kw, rows, cs in taps(kernel, dilation, stride, out_hw):
            xp[:, rows, cs] += c6[:, :, :, kh, kw]
    return xp[:, t:t + H, l:l + W]


def assert_close(got, ref, ref_abs, depth, dtype, what):
    """got (in dtype) against a float64 reference: the classic bound for a
    sum of `depth` products, relative to the sum of absolute values."""
    got = np.asarray(got)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    eps = np.finfo(dtype).eps
    bound = 4 * (depth + 2) * eps * ref_abs + 4 * np.finfo(dtype).tiny
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what}: max error {err.max()} (bound {bound.max()})"


# ============================================================ strategies

def values(draw, shape):
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return np.random.default_rng(seed).standard_normal(shape)


def chance(draw, p):
    """True with probability ~p (<= 0.5).  sampled_from draws its index
    nearly uniformly (integers() favours small values and the ends); the
    window avoids index 0, which comes up a little more often."""
    return 50 <= draw(st.sampled_from(range(100))) < 50 + round(p * 100)


def maybe(draw, good, bad, p_bad=0.1):
    """good (a strategy) most of the time, else one of the hostile values."""
    if chance(draw, p_bad):
        return draw(st.sampled_from(bad))
    return draw(good)


BAD_INTS = [0, -1, 1.5, True, "2", None, (1,), (1, 2, 3), np.float64(2.0)]
OK_INT_FORMS = lambda v: st.sampled_from([v, np.int64(v), (v, v), [v, v], np.array([v, v])])


def operand(draw, shape, dtype, bad_dtype_p=0.04, memories=NEUTRAL):
    memory = draw(st.sampled_from(memories))
    if memory == "list" and (np.dtype(dtype) != np.float64 or 0 in shape):
        memory = "contiguous"   # a list cannot hold an empty axis before a non-empty one
    if chance(draw, bad_dtype_p):
        dtype = draw(st.sampled_from(BAD_DTYPES))
        memory = "contiguous"
    return Spec(values(draw, shape), dtype, memory)


@st.composite
def geometry(draw, modes=True):
    """Shared conv geometry, mostly valid; see the model for the rules."""
    g = {}
    g["dtype"] = draw(st.sampled_from([np.float32, np.float64]))
    g["layout"] = maybe(draw, st.sampled_from(["NHWC", "NCHW"]), ["nhwc", "NWHC", 0], 0.03)
    g["groups_n"] = groups = draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
    g["N"] = draw(st.sampled_from([0, 1, 1, 2, 3]))
    g["Cg"] = draw(st.sampled_from([0, 1, 1, 2, 3]))
    g["OCg"] = draw(st.sampled_from([0, 1, 2, 3]))
    g["K"] = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    d = draw(st.sampled_from([1, 1, 2, 3]))
    # Mostly an input the dilated kernel (nearly) fits, so that most calls
    # are valid; sometimes any small size.
    g["H"], g["W"] = ((draw(st.integers(max(0, (k - 1) * d - 1), (k - 1) * d + 6)) for k in g["K"])
                      if not chance(draw, 0.15) else (draw(st.integers(0, 4)) for _ in "HW"))
    if chance(draw, 0.03):
        g["K"] = (0, g["K"][1])                       # empty kernel: invalid
    g["stride"] = maybe(draw, st.integers(1, 3).flatmap(OK_INT_FORMS), BAD_INTS, 0.06)
    g["dilation"] = maybe(draw, OK_INT_FORMS(d), BAD_INTS, 0.04)
    g["groups"] = maybe(draw, st.just(groups), [0, -1, 2.0, True, None, groups + 1], 0.04)
    g["mode"] = "zeros"
    if modes and chance(draw, 0.35):
        g["mode"] = maybe(draw, st.sampled_from(["reflect", "replicate", "circular"]),
                          ["mirror", None], 0.05)
    pad_forms = st.one_of(
        st.integers(0, 2),
        st.tuples(st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 2)),
                  st.tuples(st.integers(0, 2), st.integers(0, 2))),
        st.sampled_from(["same", "valid"]))
    g["padding"] = maybe(draw, pad_forms, [-1, (1, -1), "full", 1.0, ((1, 2), 3), (1, 2, 3)], 0.05)
    g["big_batch"] = chance(draw, 0.04)
    g["algorithm"] = "auto" if not chance(draw, 0.4) else maybe(
        draw, st.sampled_from(["implicit", "im2col", "gemm1x1", "direct", "winograd"]),
        ["fft", None], 0.05)
    g["activation"] = draw(st.sampled_from([None, None, "relu", "relu6"])) if not \
        chance(draw, 0.01) else "gelu"
    # Mostly give a forced algorithm the shape it needs.
    if g["algorithm"] == "direct" and not chance(draw, 0.2):
        # Depthwise, or narrow groups (as many outputs as inputs per group).
        g["Cg"], g["groups"] = 1, max(groups, 2)
        g["groups_n"] = g["groups"]
        if chance(draw, 0.5):
            g["Cg"] = g["OCg"] = draw(st.sampled_from([2, 4]))
    if g["algorithm"] == "winograd" and not chance(draw, 0.2):
        g["K"], g["stride"], g["dilation"] = (3, 3), 1, 1
        g["H"], g["W"] = (draw(st.integers(0, 9)) for _ in "HW")
    if g["algorithm"] == "gemm1x1" and not chance(draw, 0.2):
        g["K"], g["stride"] = (1, 1), 1
        if g["mode"] == "zeros":
            g["padding"] = draw(st.sampled_from([0, "valid", "same", ((0, 0), (0, 0))]))
    return g


def describe(**kw):
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())


def nchw_spec(draw, nhwc_values, dtype, layout, memories=NEUTRAL, bad_dtype_p=0.04):
    """A 4-D operand: logical NHWC values, handed over in `layout`."""
    vals = nhwc_values if layout != "NCHW" else nhwc_values.transpose(0, 3, 1, 2)
    spec = operand(draw, vals.shape, dtype, bad_dtype_p, memories)
    spec.values = np.ascontiguousarray(vals)
    return spec


def to_nhwc(a, layout):
    return a if layout != "NCHW" else a.transpose(0, 2, 3, 1)


# ================================================================ GEMM

if IN_CHILD:
    SCALARS = [1.0, -2.5, 0.0, 0.5, 3, np.float32(2.0), fractions.Fraction(1, 2), np.nan,
               True, "1", 1 + 1j, None, np.bool_(True)]

    def m_scalar(v):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.floating,
                                                                  np.integer, fractions.Fraction)):
            raise Invalid(f"scalar {v!r}")
        return float(v)

    @st.composite
    def gemm_case(draw):
        routine = draw(st.sampled_from(["sgemm", "dgemm"]))
        dtype = np.float32 if routine == "sgemm" else np.float64
        M, N, K = (draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 31, 40])) for _ in range(3))
        trans_a, trans_b = draw(st.booleans()), draw(st.booleans())
        if chance(draw, 0.03):
            M = HUGE                                       # output cannot fit
        elif chance(draw, 0.03):
            K, M = HUGE, 0                                 # empty output
        a_shape = (K, M) if trans_a else (M, K)
        b_shape = (N, K) if trans_b else (K, N)
        if chance(draw, 0.04):                   # inner dimensions differ
            b_shape = (b_shape[0] + 1, b_shape[1]) if not trans_b else (b_shape[0], b_shape[1] + 1)
        if chance(draw, 0.03):
            a_shape = a_shape + (1,)                       # 3-D
        in_dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.longdouble])
        big_a, big_b = max(a_shape) >= HUGE, max(b_shape) >= HUGE
        big_any = big_a or big_b
        mem = ["broadcast"] if big_any else NEUTRAL
        a = operand(draw, (1, 1) if big_a else a_shape, draw(in_dtypes), memories=mem)
        b = operand(draw, (1, 1) if big_b else b_shape, draw(in_dtypes), memories=mem)
        if big_any:
            a.shape, b.shape = a_shape, b_shape
        c_kind = draw(st.sampled_from(["none", "none", "fresh", "strided", "fortran", "reversed",
                                       "readonly", "alias_a", "alias_b", "overlap_a",
                                       "wrong_dtype", "wrong_shape", "list", "nonelement"]))
        return dict(routine=routine, dtype=dtype, a=a, b=b, trans_a=trans_a, trans_b=trans_b,
                    alpha=maybe(draw, st.sampled_from(SCALARS[:7]), SCALARS[7:], 0.1),
                    beta=maybe(draw, st.sampled_from(SCALARS[:7]), SCALARS[7:], 0.1),
                    c_kind=c_kind, overwrite=draw(st.booleans()),
                    c_values=values(draw, (max(M, 1) if M != HUGE else 1, max(N, 1))),
                    big=big_any)

    def _materialize_huge(spec):
        dtype = np.dtype(spec.dtype)
        return np.broadcast_to(np.ones((1, 1), dtype), spec.shape), None

    @settings(FUZZ, max_examples=EXAMPLES["gemm"])
    @given(gemm_case())
    def test_fuzz_gemm(case):
        dtype, routine = case["dtype"], case["routine"]
        if case["big"]:
            a, a_seen = _materialize_huge(case["a"])
            b, b_seen = _materialize_huge(case["b"])
        else:
            a, a_seen = build(case["a"])
            b, b_seen = build(case["b"])
        a_before, b_before = (None, None) if case["big"] else (np.array(a, copy=True),
                                                               np.array(b, copy=True))
        valid, why = True, ""
        try:
            alpha = m_scalar(case["alpha"])
            beta = m_scalar(case["beta"])
            for s in (case["a"], case["b"]):
                if np.dtype(s.dtype).kind != "f":
                    raise Invalid("dtype")
                if len(s.shape) != 2:
                    raise Invalid("ndim")
            A_shape = case["a"].shape[::-1] if case["trans_a"] else case["a"].shape
            B_shape = case["b"].shape[::-1] if case["trans_b"] else case["b"].shape
            if A_shape[1] != B_shape[0]:
                raise Invalid("inner")
            M, N = A_shape[0], B_shape[1]
        except Invalid as e:
            valid, why = False, str(e)
            M = N = 1
        # c
        c = None
        kind = case["c_kind"]
        if kind != "none" and valid and not case["big"]:
            cv = case["c_values"][:M, :N]
            if kind in ("fresh", "readonly"):
                c = cv.astype(dtype)
                c.flags.writeable = kind != "readonly"
            elif kind in ("strided", "fortran", "reversed", "nonelement"):
                c = build(Spec(cv, dtype, kind))[0]
            elif kind == "alias_a":
                c = a if isinstance(a, np.ndarray) and a.shape == (M, N) and a.dtype == dtype \
                    and a.flags.writeable else None
            elif kind == "alias_b":
                c = b if isinstance(b, np.ndarray) and b.shape == (M, N) and b.dtype == dtype \
                    and b.flags.writeable else None
            elif kind == "overlap_a":
                if isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.writeable \
                        and a.ndim == 2 and a.shape[0] >= M and a.shape[1] >= N and M and N:
                    c = a[::-1][:M, :N] if a.shape[0] > M else a[:M, :N]
            elif kind == "wrong_dtype":
                c = cv.astype(np.float64 if dtype == np.float32 else np.float32)
            elif kind == "wrong_shape":
                c = np.zeros((M + 1, N), dtype)
            elif kind == "list":
                c = cv.astype(dtype).tolist()
        if valid and c is not None:
            try:
                if not isinstance(c, np.ndarray):
                    raise Invalid("c not an array")
                if c.dtype != dtype:
                    raise Invalid("c dtype")
                if c.shape != (M, N):
                    raise Invalid("c shape")
                if case["overwrite"]:
                    if not c.flags.writeable:
                        raise Invalid("c read-only")
                    if any(s % c.itemsize for s in c.strides):
                        raise Invalid("c non-element strides")
            except Invalid as e:
                valid, why = False, str(e)
        c_before = None if not isinstance(c, np.ndarray) else c.copy()
        f = getattr(fastconv, routine)
        kwargs = dict(trans_a=case["trans_a"], trans_b=case["trans_b"], overwrite_c=case["overwrite"])
        desc = describe(routine=routine, a=case["a"], b=case["b"], alpha=case["alpha"],
                        beta=case["beta"], c=kind, model=why or "valid", **kwargs)

        def check(got):
            assert isinstance(got, np.ndarray) and got.dtype == dtype and got.shape == (M, N)
            if case["overwrite"] and c is not None:
                assert got is c, "overwrite_c=True must return c itself"
            if case["big"]:
                assert got.size == 0
                return
            A = np.asarray(a_seen, np.float64).astype(dtype).astype(np.float64)
            B = np.asarray(b_seen, np.float64).astype(dtype).astype(np.float64)
            A = A.T if case["trans_a"] else A
            B = B.T if case["trans_b"] else B
            with np.errstate(all="ignore"):
                ref = alpha * (A @ B)
                scale = abs(alpha) * (np.abs(A) @ np.abs(B))
                if c is not None and beta != 0:
                    ref = ref + beta * c_before.astype(np.float64)
                    scale = scale + abs(beta) * np.abs(c_before.astype(np.float64))
            if A.shape[1] == 0:                # BLAS: C = beta*C, alpha unused
                ref = np.zeros((M, N)) if c is None or beta == 0 else beta * c_before.astype(float)
                scale = np.abs(ref)
            elif np.isnan(alpha) or (c is not None and np.isnan(beta)):
                assert np.isnan(got).all()
                return
            if c is not None and np.isnan(beta) and beta != 0:
                assert np.isnan(got).all()
                return
            assert_close(got, ref, scale, A.shape[1], dtype, routine)
            # inputs untouched (unless c is one of them)
            if c is not a and not (kind == "overlap_a" and c is not None):
                assert same_values(a, a_before), "a was modified"
            if c is not b:
                assert same_values(b, b_before), "b was modified"
            if c is not None and not case["overwrite"]:
                assert same_values(c, c_before), "c was modified without overwrite_c"

        alpha = alpha if valid else 0.0
        beta = beta if valid else 0.0
        run_case("gemm", desc, valid,
                 lambda: f(case["alpha"], a, b, case["beta"], c, **kwargs), check, huge=case["big"])

    @settings(FUZZ, max_examples=EXAMPLES["matmul"])
    @given(st.data())
    def test_fuzz_matmul(data):
        draw = data.draw
        M, K, N = (draw(st.sampled_from([0, 1, 3, 7, 20])) for _ in range(3))
        dt = st.sampled_from([np.float32, np.float64, np.float32, np.float64, np.float16, np.int32])
        a = operand(draw, (M, K), draw(dt))
        kb = K if not chance(draw, 0.05) else K + 1
        b = operand(draw, (kb, N), draw(dt))
        A, a_seen = build(a)
        B, b_seen = build(b)
        da = np.float64 if a.memory == "list" else np.dtype(a.dtype)
        db = np.float64 if b.memory == "list" else np.dtype(b.dtype)
        valid = da in FLOATS and db in FLOATS and kb == K
        out_dtype = np.result_type(da, db) if valid else None

        def check(got):
            ref = a_seen @ b_seen
            assert_close(got, ref, np.abs(a_seen) @ np.abs(b_seen), K, out_dtype, "matmul")

        run_case("matmul", describe(a=a, b=b), valid, lambda: fastconv.matmul(A, B), check)


# ================================================================ conv2d

def _conv_model(g, x_spec, w_spec, bias_spec):
    """(dtype, pads, out_hw, groups, stride, dilation) for a valid call, or
    raise Invalid."""
    layout = m_choice(g["layout"], ("NHWC", "NCHW"))
    dtype = m_float_array(x_spec, 4)
    if m_float_array(w_spec, 4) != dtype:
        raise Invalid("weight dtype differs")
    mode = m_choice(g["mode"], ("zeros", "reflect", "replicate", "circular"))
    groups = m_int(g["groups"])
    if groups < 1:
        raise Invalid("groups < 1")
    stride = m_positive_pair(g["stride"])
    dilation = m_positive_pair(g["dilation"])
    C = g["Cg"] * g["groups_n"]
    OC = g["OCg"] * g["groups_n"]
    if min(g["K"]) < 1:
        raise Invalid("empty kernel")
    if C % groups or OC % groups or g["Cg"] != C // groups:   # weight is (OC, KH, KW, Cg)
        raise Invalid("groups")
    pads = m_conv_pads(g["padding"], (g["H"], g["W"]), g["K"], stride, dilation)
    out_hw = m_out_hw((g["H"], g["W"]), g["K"], stride, pads, dilation)
    if mode != "zeros":
        m_mode_pads(pads, (g["H"], g["W"]), mode)
    if bias_spec is not None:
        if m_float_array(bias_spec, 1) != dtype:
            raise Invalid("bias dtype")
        if bias_spec.shape != (OC,):
            raise Invalid("bias shape")
    activation = g.get("activation")
    if not (activation is None or activation in ("relu", "relu6")):
        raise Invalid("activation")
    algorithm = m_choice(g.get("algorithm", "auto"), ("auto", "implicit", "im2col", "gemm1x1",
                                                       "direct", "winograd"))
    narrow_groups = (groups > 1 and C == OC and C // groups in (2, 4, 8, 16)
                     and g["K"][0] <= 64)
    if algorithm == "direct" and not (groups == C and C > 1 or narrow_groups):
        raise Invalid("direct needs depthwise or narrow groups")
    if algorithm == "gemm1x1" and not (g["K"] == (1, 1) and stride == (1, 1) and (
            mode != "zeros" or pads == ((0, 0), (0, 0)))):
        raise Invalid("gemm1x1 needs a pointwise convolution")
    if algorithm == "winograd" and not (g["K"] == (3, 3) and stride == (1, 1)
                                        and dilation == (1, 1)):
        raise Invalid("winograd needs 3x3, stride 1, dilation 1")
    return layout, dtype, mode, pads, out_hw, groups, stride, dilation


def activate(y, activation):
    if activation == "relu":
        return np.maximum(y, 0)
    if activation == "relu6":
        return np.clip(y, 0, 6)
    return y


def _conv_operands(draw, g, transposed=False):
    """x, weight (and bias) specs with NHWC logical values."""
    N, H, W = g["N"], g["H"], g["W"]
    C, OC = g["Cg"] * g["groups_n"], g["OCg"] * g["groups_n"]
    KH, KW = g["K"]
    layout = g["layout"] if g["layout"] in ("NHWC", "NCHW") else "NHWC"
    big = g["big_batch"]
    x_mem = ["broadcast"] if big else NEUTRAL
    x = nchw_spec(draw, values(draw, (1 if big else N, H, W, C)), g["dtype"], layout,
                  memories=x_mem)
    if chance(draw, 0.03):                                  # 3-D: invalid
        x.values = x.values.sum(axis=0)
        x.shape = x.values.shape
    if transposed:
        w_vals = values(draw, (C, KH, KW, g["OCg"]))
    else:
        w_vals = values(draw, (OC, KH, KW, g["Cg"]))
    w_dtype = g["dtype"] if not chance(draw, 0.03) else \
        (np.float64 if g["dtype"] == np.float32 else np.float32)
    w = nchw_spec(draw, w_vals, w_dtype, layout)
    bias = None
    if draw(st.booleans()):
        n = OC + (1 if chance(draw, 0.03) else 0)
        bias = operand(draw, (n,), g["dtype"])
    return x, w, bias


def _build_x(x, big_n):
    arr, seen = build(x)
    if big_n and isinstance(arr, np.ndarray) and arr.ndim == 4:
        arr = np.broadcast_to(arr[:1], (HUGE, *arr.shape[1:]))
    return arr, seen


if IN_CHILD:
    @settings(FUZZ, max_examples=EXAMPLES["conv2d"])
    @given(geometry(), st.data())
    def test_fuzz_conv2d(g, data):
        x, w, bias = _conv_operands(data.draw, g)
        big = g["big_batch"]
        X, x_seen = _build_x(x, big)
        Wt, w_seen = build(w)
        B, b_seen = build(bias) if bias is not None else (None, None)
        before = [np.array(v, copy=True) for v in (X if not big else X[:1], Wt)]
        packed = chance(data.draw, 0.3)           # fastconv.PackedConv2d(weight, ...)(x)
        if packed:
            g["algorithm"] = "auto"               # not an option of PackedConv2d
        try:
            layout, dtype, mode, pads, out_hw, groups, stride, dilation = \
                _conv_model(g, x, w, bias)
            valid, why = True, "valid"
        except Invalid as e:
            valid, why = False, str(e)
        kwargs = dict(stride=g["stride"], padding=g["padding"], dilation=g["dilation"],
                      groups=g["groups"], padding_mode=g["mode"], layout=g["layout"],
                      activation=g["activation"])
        if not packed:
            kwargs["algorithm"] = g["algorithm"]
        desc = describe(x=x, weight=w, bias=bias, big_batch=big, packed=packed, model=why,
                        **kwargs)

        def check(got):
            xs, ws = to_nhwc(x_seen, layout), to_nhwc(w_seen, layout)
            got = to_nhwc(np.asarray(got), layout)
            if big:
                assert got.size == 0
                return
            ref = ref_conv2d(xs, ws, b_seen, stride, pads, dilation, groups, mode)
            ref_abs = ref_conv2d(np.abs(xs), np.abs(ws), None if b_seen is None else np.abs(b_seen),
                                 stride, pads, dilation, groups, mode)
            if g["algorithm"] == "winograd":
                # Winograd mixes each 6x6 input window: its error is bounded
                # normwise (here 10x the direct method's bound at the
                # largest output), not element by element.  (Auto, packed
                # or not, never takes it for these few channels.)
                ref_abs = np.full_like(ref_abs, ref_abs.max(initial=0) * 10)
            assert_close(got, activate(ref, g["activation"]), ref_abs,
                         int(np.prod(ws.shape[1:])), dtype, "conv2d")
            for v, b0 in zip((X, Wt), before):
                assert same_values(v, b0), "an input was modified"

        def call():
            if not packed:
                return fastconv.conv2d(X, Wt, B, **kwargs)
            layer = fastconv.PackedConv2d(Wt, B, **kwargs)
            first = layer(X)
            again = layer(X)                  # the packed weights reused
            assert same_values(first, again), "PackedConv2d: a second call differs"
            return first

        run_case("conv2d", desc, valid, call, check, huge=big)

    @settings(FUZZ, max_examples=EXAMPLES["conv2d_backward"])
    @given(geometry(), st.data())
    def test_fuzz_conv2d_backward(g, data):
        draw = data.draw
        g = dict(g, algorithm="auto", activation=None)     # forward-only options
        x, w, _ = _conv_operands(draw, g)
        big = g["big_batch"]
        X, x_seen = _build_x(x, big)
        Wt, w_seen = build(w)
        try:
            layout, dtype, mode, pads, out_hw, groups, stride, dilation = \
                _conv_model(g, x, w, None)
            valid, why = True, "valid"
            dy_shape = (g["N"], *out_hw, g["OCg"] * g["groups_n"])
        except Invalid as e:
            valid, why = False, str(e)
            layout = g["layout"] if g["layout"] in ("NHWC", "NCHW") else "NHWC"
            dy_shape = (g["N"], 1, 1, g["OCg"] * g["groups_n"])
        if chance(draw, 0.04):
            dy_shape = (dy_shape[0], dy_shape[1] + 1, *dy_shape[2:])
            valid, why = False, "grad_output shape"
        dy = nchw_spec(draw, values(draw, (1 if big else dy_shape[0], *dy_shape[1:])),
                       g["dtype"], layout, memories=["broadcast"] if big else NEUTRAL,
                       bad_dtype_p=0.02)
        if np.dtype(dy.dtype) != np.dtype(g["dtype"]) and valid:
            valid, why = False, "grad_output dtype"
        DY, dy_seen = _build_x(dy, big)
        mask = maybe(draw, st.tuples(st.booleans(), st.booleans(), st.booleans()),
                     [(True, True), [1, 0, 1, 0], None], 0.03)
        if big and valid and mask is not None and len(mask) == 3:
            mask = (True, mask[1], mask[2])   # grad_input first: it is what cannot fit
        if valid and not (_is_seq(mask) and len(mask) == 3):
            valid, why = False, "output_mask"
        kwargs = dict(stride=g["stride"], padding=g["padding"], dilation=g["dilation"],
                      groups=g["groups"], padding_mode=g["mode"], layout=g["layout"],
                      output_mask=mask)
        desc = describe(grad_output=dy, x=x, weight=w, big_batch=big, model=why, **kwargs)

        def check(got):
            gx, gw, gb = got
            if big:
                assert gx is None or gx.size == 0
                return
            xs, ws, dys = (to_nhwc(v, layout) for v in (x_seen, w_seen, dy_seen))
            rx, rw, rb = ref_conv2d_backward(dys, xs, ws, stride, pads, dilation, groups, mode)
            ax, aw, ab = ref_conv2d_backward(np.abs(dys), np.abs(xs), np.abs(ws), stride, pads,
                                             dilation, groups, mode)
            depth_x = int(np.prod(ws.shape[1:3])) * ws.shape[0]
            depth_w = dys.shape[0] * dys.shape[1] * dys.shape[2] * 4 + 1
            for want, have, ref, ref_abs, depth, name in (
                    (mask[0], gx, rx, ax, depth_x, "grad_input"),
                    (mask[1], gw, rw, aw, depth_w, "grad_weight"),
                    (mask[2], gb, rb, ab, dys.shape[0] * dys.shape[1] * dys.shape[2], "grad_bias")):
                if not want:
                    assert have is None, f"{name} computed although masked"
                    continue
                have = to_nhwc(have, layout) if have.ndim == 4 else have
                assert_close(have, ref, ref_abs, depth, dtype, name)

        run_case("conv2d_backward", desc, valid,
                 lambda: fastconv.conv2d_backward(DY, X, Wt, **kwargs), check, huge=big)


# ======================================================= conv_transpose2d

def _transpose_model(g, x_spec, w_spec, bias_spec, output_padding):
    layout = m_choice(g["layout"], ("NHWC", "NCHW"))
    dtype = m_float_array(x_spec, 4)
    if m_float_array(w_spec, 4) != dtype:
        raise Invalid("weight dtype differs")
    groups = m_int(g["groups"])
    if groups < 1:
        raise Invalid("groups < 1")
    stride = m_positive_pair(g["stride"])
    dilation = m_positive_pair(g["dilation"])
    op = m_pair(output_padding)
    C = g["Cg"] * g["groups_n"]
    if min(g["K"]) < 1:
        raise Invalid("empty kernel")
    if C % groups:
        raise Invalid("groups")
    OCg = g["OCg"]                # weight is (C, KH, KW, OCg): C_out = OCg * groups
    pads = m_explicit_pads(g["padding"])
    for o, s, d in zip(op, stride, dilation):
        if o < 0 or o >= max(s, d):
            raise Invalid("output_padding")
    full = transpose_full_hw((g["H"], g["W"]), g["K"], stride, dilation, op)
    out_hw = tuple(f - lo - hi for f, (lo, hi) in zip(full, pads))
    if min(out_hw) < 1:
        raise Invalid("padding too large")
    if bias_spec is not None:
        if m_float_array(bias_spec, 1) != dtype:
            raise Invalid("bias dtype")
        if bias_spec.shape != (OCg * groups,):
            raise Invalid("bias shape")
    return layout, dtype, pads, out_hw, groups, stride, dilation, op


if IN_CHILD:
    @settings(FUZZ, max_examples=EXAMPLES["conv_transpose2d"])
    @given(geometry(modes=False), st.data())
    def test_fuzz_conv_transpose2d(g, data):
        draw = data.draw
        x, w, bias = _conv_operands(draw, g, transposed=True)
        if g["padding"] in ("same", "valid") and draw(st.booleans()):
            g["padding"] = 1
        op = maybe(draw, st.sampled_from([0, 0, 0, 1, 2, (0, 1)]), [-1, 5, 1.5, (0, 0, 0)], 0.05)
        big = g["big_batch"]
        X, x_seen = _build_x(x, big)
        Wt, w_seen = build(w)
        B, b_seen = build(bias) if bias is not None else (None, None)
        try:
            layout, dtype, pads, out_hw, groups, stride, dilation, opp = \
                _transpose_model(g, x, w, bias, op)
            valid, why = True, "valid"
        except Invalid as e:
            valid, why = False, str(e)
        kwargs = dict(stride=g["stride"], padding=g["padding"], output_padding=op,
                      groups=g["groups"], dilation=g["dilation"], layout=g["layout"])
        desc = describe(x=x, weight=w, bias=bias, big_batch=big, model=why, **kwargs)

        def check(got):
            got = to_nhwc(np.asarray(got), layout)
            if big:
                assert got.size == 0
                return
            xs, ws = to_nhwc(x_seen, layout), to_nhwc(w_seen, layout)
            ref = ref_conv_transpose2d(xs, ws, b_seen, stride, pads, opp, groups, dilation)
            ref_abs = ref_conv_transpose2d(np.abs(xs), np.abs(ws),
                                           None if b_seen is None else np.abs(b_seen),
                                           stride, pads, opp, groups, dilation)
            assert_close(got, ref, ref_abs, int(np.prod(ws.shape[:3])), dtype, "conv_transpose2d")

        run_case("conv_transpose2d", desc, valid,
                 lambda: fastconv.conv_transpose2d(X, Wt, B, **kwargs), check, huge=big)

    @settings(FUZZ, max_examples=EXAMPLES["conv_transpose2d_backward"])
    @given(geometry(modes=False), st.data())
    def test_fuzz_conv_transpose2d_backward(g, data):
        draw = data.draw
        g["big_batch"] = False
        x, w, _ = _conv_operands(draw, g, transposed=True)
        if g["padding"] in ("same", "valid") and draw(st.booleans()):
            g["padding"] = 0
        op = maybe(draw, st.sampled_from([0, 0, 0, 1, 2, (1, 0)]), [-1, 5], 0.05)
        X, x_seen = build(x)
        Wt, w_seen = build(w)
        try:
            layout, dtype, pads, out_hw, groups, stride, dilation, opp = \
                _transpose_model(g, x, w, None, op)
            valid, why = True, "valid"
            dy_shape = (g["N"], *out_hw, g["OCg"] * groups)
        except Invalid as e:
            valid, why = False, str(e)
            layout = g["layout"] if g["layout"] in ("NHWC", "NCHW") else "NHWC"
            dy_shape = (g["N"], 1, 1, 1)
        dy = nchw_spec(draw, values(draw, dy_shape), g["dtype"], layout, bad_dtype_p=0.02)
        if np.dtype(dy.dtype) != np.dtype(g["dtype"]) and valid:
            valid, why = False, "grad_output dtype"
        DY, dy_seen = build(dy)
        mask = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
        kwargs = dict(stride=g["stride"], padding=g["padding"], output_padding=op,
                      groups=g["groups"], dilation=g["dilation"], layout=g["layout"],
                      output_mask=mask)
        desc = describe(grad_output=dy, x=x, weight=w, model=why, **kwargs)

        def check(got):
            xs, ws, dys = (to_nhwc(v, layout) for v in (x_seen, w_seen, dy_seen))
            refs = ref_conv_transpose2d_backward(dys, xs, ws, stride, pads, opp, groups, dilation)
            abss = ref_conv_transpose2d_backward(np.abs(dys), np.abs(xs), np.abs(ws), stride, pads,
                                                 opp, groups, dilation)
            depths = (int(np.prod(ws.shape[1:])), xs.shape[0] * xs.shape[1] * xs.shape[2] + 1,
                      dys.shape[0] * dys.shape[1] * dys.shape[2])
            for want, have, ref, ref_abs, depth, name in zip(
                    mask, got, refs, abss, depths, ("grad_input", "grad_weight", "grad_bias")):
                if not want:
                    assert have is None, f"{name} computed although masked"
                    continue
                have = to_nhwc(have, layout) if have.ndim == 4 else have
                assert_close(have, ref, ref_abs, depth, dtype, name)

        run_case("conv_transpose2d_backward", desc, valid,
                 lambda: fastconv.conv_transpose2d_backward(DY, X, Wt, **kwargs), check)


# ========================================================= im2col / col2im

if IN_CHILD:
    @settings(FUZZ, max_examples=EXAMPLES["im2col"])
    @given(geometry(modes=False), st.data())
    def test_fuzz_im2col(g, data):
        draw = data.draw
        big = g["big_batch"]
        C = g["Cg"] * g["groups_n"]
        x = operand(draw, (1 if big else g["N"], g["H"], g["W"], C), g["dtype"],
                    memories=["broadcast"] if big else NEUTRAL)
        if chance(draw, 0.03):
            x.values = x.values.sum(axis=0)
            x.shape = x.values.shape
        kernel = maybe(draw, st.just(g["K"]), [0, (2,), -1, 2.5, "3"], 0.05)
        X, x_seen = _build_x(x, big)
        try:
            m_float_array(x, 4)
            k = m_positive_pair(kernel)
            stride = m_positive_pair(g["stride"])
            dilation = m_positive_pair(g["dilation"])
            pads = m_conv_pads(g["padding"], (g["H"], g["W"]), k, stride, dilation)
            out_hw = m_out_hw((g["H"], g["W"]), k, stride, pads, dilation)
            valid, why = True, "valid"
        except Invalid as e:
            valid, why = False, str(e)
        kwargs = dict(stride=g["stride"], padding=g["padding"], dilation=g["dilation"])
        desc = describe(x=x, kernel_size=kernel, big_batch=big, model=why, **kwargs)

        def check(got):
            if big:
                assert got.size == 0
                return
            ref = ref_im2col(x_seen, k, stride, pads, dilation, out_hw)
            assert got.dtype == np.dtype(x.dtype if x.memory != "list" else np.float64)
            assert got.shape == ref.shape
            assert np.array_equal(got.astype(np.float64), ref), "im2col is a copy: exact"

        run_case("im2col", desc, valid, lambda: fastconv.im2col(X, kernel, **kwargs), check,
                 huge=big)

    @settings(FUZZ, max_examples=EXAMPLES["col2im"])
    @given(geometry(modes=False), st.data())
    def test_fuzz_col2im(g, data):
        draw = data.draw
        C = g["Cg"] * g["groups_n"]
        N = HUGE if g["big_batch"] else g["N"]
        shape = (N, g["H"], g["W"], C)
        shape_arg = maybe(draw, st.sampled_from([shape, list(shape), np.array(shape)]),
                          [(N, g["H"], g["W"]), (N, -1, g["W"], C), (N, 2.0, g["W"], C), "x"],
                          0.05)
        kernel = g["K"]
        try:
            k = m_positive_pair(kernel)
            stride = m_positive_pair(g["stride"])
            dilation = m_positive_pair(g["dilation"])
            if not _is_seq(shape_arg) or len(shape_arg) != 4:
                raise Invalid("input_shape")
            shp = tuple(m_int(s) for s in shape_arg)
            if min(shp) < 0:
                raise Invalid("input_shape negative")
            pads = m_conv_pads(g["padding"], shp[1:3], k, stride, dilation)
            out_hw = m_out_hw(shp[1:3], k, stride, pads, dilation)
            cols_shape = (shp[0] * out_hw[0] * out_hw[1], k[0] * k[1] * shp[3])
            valid, why = True, "valid"
        except Invalid as e:
            valid, why = False, str(e)
            cols_shape = (3, 4)
        if chance(draw, 0.05):
            cols_shape = (cols_shape[0], cols_shape[1] + 1)
            if valid:
                valid, why = False, "cols shape"
        big = N == HUGE
        cols = operand(draw, (1, cols_shape[1]) if big else cols_shape, g["dtype"],
                       memories=["broadcast"] if big else NEUTRAL)
        if big:
            cols.shape, cols.dtype = cols_shape, g["dtype"]
            arr = np.broadcast_to(np.ones((1, cols_shape[1]), g["dtype"]), cols_shape)
            seen = None
        else:
            arr, seen = build(cols)
        if valid:
            try:
                m_float_array(cols, 2)
            except Invalid as e:
                valid, why = False, str(e)
        kwargs = dict(stride=g["stride"], padding=g["padding"], dilation=g["dilation"])
        desc = describe(cols=cols, input_shape=shape_arg, kernel_size=kernel, model=why, **kwargs)

        def check(got):
            if big:
                assert got.size == 0
                return
            ref = ref_col2im(seen, shp, k, stride, pads, dilation, out_hw)
            abs_ref = ref_col2im(np.abs(seen), shp, k, stride, pads, dilation, out_hw)
            dtype = np.dtype(cols.dtype if cols.memory != "list" else np.float64)
            assert_close(got, ref, abs_ref, k[0] * k[1], dtype, "col2im")

        run_case("col2im", desc, valid,
                 lambda: fastconv.col2im(arr, shape_arg, kernel, **kwargs), check, huge=big)


# ================================================ the reference, checked

@pytest.mark.parametrize("case", range(6))
def test_numpy_reference_matches_pytorch(case):
    """The fuzz tests' numpy references agree with PyTorch (float64) on
    a few cases covering groups, strides, dilation, every padding mode,
    asymmetric padding and output_padding."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(case)
    groups = [1, 2, 3, 1, 2, 4][case]
    mode = ["zeros", "reflect", "replicate", "circular", "zeros", "zeros"][case]
    stride, dilation = (1 + case % 2, 1 + case % 3), (1 + (case + 1) % 2, 1)
    pads = ((case % 3, (case + 1) % 3), (1, 0))
    x = rng.standard_normal((2, 7, 8, 2 * groups))
    w = rng.standard_normal((3 * groups, 3, 2, 2))
    b = rng.standard_normal(3 * groups)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))
    tx, tw = t(x).requires_grad_(), t(w).requires_grad_()
    (tp, bp), (lp, rp) = pads
    xp = F.pad(tx, (lp, rp, tp, bp), mode={"zeros": "constant"}.get(mode, mode))
    ty = F.conv2d(xp, tw, torch.from_numpy(b), stride, 0, dilation, groups)
    y = ref_conv2d(x, w, b, stride, pads, dilation, groups, mode)
    np.testing.assert_allclose(y, ty.detach().permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-10)
    dy = rng.standard_normal(y.shape)
    ty.backward(t(dy))
    gx, gw, gb = ref_conv2d_backward(dy, x, w, stride, pads, dilation, groups, mode)
    np.testing.assert_allclose(gx, tx.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw, tw.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-10)

    # transposed: weight (C_in, KH, KW, C_out/groups)
    op = (stride[0] - 1, 0)
    wt = rng.standard_normal((2 * groups, 3, 2, 2))
    txt = t(x).requires_grad_()
    twt = torch.from_numpy(np.ascontiguousarray(wt.transpose(0, 3, 1, 2))).requires_grad_()
    full = F.conv_transpose2d(txt, twt, None, stride, 0, op, groups, dilation)
    crop = full[:, :, tp:full.shape[2] - bp, lp:full.shape[3] - rp]
    yt = ref_conv_transpose2d(x, wt, None, stride, pads, op, groups, dilation)
    np.testing.assert_allclose(yt, crop.detach().permute(0, 2, 3, 1).numpy(), rtol=1e-10,
                               atol=1e-10)
    dyt = rng.standard_normal(yt.shape)
    crop.backward(t(dyt))
    gx, gw, _ = ref_conv_transpose2d_backward(dyt, x, wt, stride, pads, op, groups, dilation)
    np.testing.assert_allclose(gx, txt.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw, twt.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-10)

    # im2col against unfold (channel order (c, kh, kw) there, (kh, kw, c) here)
    xpad = F.pad(t(x), (lp, rp, tp, bp))
    un = F.unfold(xpad, (3, 2), dilation=dilation, stride=stride)     # (N, C*KH*KW, L)
    N, CKK, L = un.shape
    un = un.reshape(N, 2 * groups, 3, 2, L).permute(0, 4, 2, 3, 1).reshape(N * L, -1)
    out_hw = m_out_hw((7, 8), (3, 2), stride, pads, dilation)
    cols = ref_im2col(x, (3, 2), stride, pads, dilation, out_hw)
    np.testing.assert_array_equal(cols, un.numpy())
