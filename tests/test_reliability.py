"""Reliability: fastconv's OpenMP runtime next to numpy's BLAS and
threadpoolctl, fork() and multiprocessing, concurrent Python threads and
the GIL, memory (no leaks, requests that cannot fit, 64-bit offsets into
huge buffers), NaN/inf against PyTorch, and subnormal inputs.

Everything that could hang or crash the interpreter (fork, multiprocessing,
memory limits, huge buffers) runs in a child interpreter with a timeout, so
a hang or a segfault fails the test instead of taking pytest down.  The
children import the same fastconv as this process (the source tree or an
installed wheel), under the same FASTCONV_ISA.
"""
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastconv
from fastconv import _dispatch

PKG_PARENT = str(pathlib.Path(fastconv.__file__).resolve().parents[1])
HAVE_OPENMP = bool(_dispatch.kernels.HAVE_OPENMP)
LINUX = sys.platform.startswith("linux")
X86_64 = ("x86_64", "AMD64", "amd64")


@pytest.fixture(autouse=True)
def two_threads():
    """Each test runs with 2 OpenMP threads allowed (on any machine: a
    parallel region with more threads than cores still runs) and restores
    the caller's setting."""
    previous = fastconv.get_num_threads()
    fastconv.set_num_threads(2)
    yield
    fastconv.set_num_threads(previous)


# ------------------------------------------------------------ child runs

def run_python(code, timeout=120):
    """Run ``code`` in a fresh interpreter that imports this process's
    fastconv; returns (returncode, stdout, stderr).  The child gets its own
    process group, killed whole on timeout (grandchildren from fork()
    included), and the test fails naming the hang."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env.get("PYTHONPATH")) if p)
    env["PYTHONFAULTHANDLER"] = "1"     # a crash prints the Python stack
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"child interpreter hung (killed after {timeout} s)\n"
                        f"--- stdout\n{out}\n--- stderr\n{err}")
        finally:
            try:        # whatever the child left behind in its group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return proc.returncode, out, err


def check_python(code, timeout=120):
    """run_python that must exit 0; returns stdout."""
    rc, out, err = run_python(code, timeout)
    if rc != 0:
        what = (f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with {rc}")
        pytest.fail(f"child interpreter {what}\n--- stdout\n{out}\n--- stderr\n{err}")
    return out


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


# Shared by several children: inputs, and a check against float64 numpy.
CHILD_PRELUDE = """
import json, os, sys, time, warnings
import numpy as np
import fastconv
warnings.simplefilter("ignore", DeprecationWarning)   # 3.12+: fork() with threads

rng = np.random.default_rng(0)
A = rng.standard_normal((256, 320)).astype(np.float32)
B = rng.standard_normal((320, 288)).astype(np.float32)
X = rng.standard_normal((2, 24, 24, 16)).astype(np.float32)
W = rng.standard_normal((32, 3, 3, 16)).astype(np.float32)

def os_threads():
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1

def work():
    y = fastconv.conv2d(X, W, padding=1)
    dx, dw, db = fastconv.conv2d_backward(np.ones_like(y), X, W, padding=1)
    return [fastconv.sgemm(1.0, A, B), y, dx, dw, fastconv.conv2d(X, W[:16, :, :, :1], groups=16)]

def same(r1, r2):
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(r1, r2))
"""


# --------------------------------------------- OpenMP next to other runtimes

@pytest.mark.skipif(not HAVE_OPENMP, reason="built without OpenMP")
def test_threadpoolctl_sees_and_limits_fastconvs_openmp():
    """threadpoolctl lists the OpenMP library fastconv's kernels run on
    (libgomp for GCC builds; a wheel bundles a renamed copy), separate from
    numpy's BLAS; threadpool_limits(1, "openmp") and threadpool_limits(1)
    bring get_num_threads() to 1 with the same results, and leaving the
    context restores 2.  No torch in the child: its own bundled libgomp
    would be a second OpenMP entry."""
    out = check_python(CHILD_PRELUDE + """
from threadpoolctl import threadpool_info, threadpool_limits
from fastconv import _config
fastconv.set_num_threads(2)
ref = work()
info = [{k: i.get(k) for k in ("user_api", "internal_api", "prefix", "filepath", "num_threads")}
        for i in threadpool_info()]
res = {"info": info, "config_openmp": _config.config()["openmp"]}
with threadpool_limits(1, "openmp"):
    res["openmp_limit"] = fastconv.get_num_threads()
    res["openmp_same"] = same(work(), ref)
with threadpool_limits(1):
    res["all_limit"] = fastconv.get_num_threads()
    res["all_same"] = same(work(), ref)
res["after"] = fastconv.get_num_threads()
print(json.dumps(res))
""")
    res = last_json(out)
    omp = [i for i in res["info"] if i["user_api"] == "openmp"
           and os.path.basename(i["filepath"]) in res["config_openmp"]]
    assert len(omp) == 1, (res["config_openmp"], res["info"])
    lib = omp[0]
    assert lib["prefix"] in ("libgomp", "libomp", "libiomp", "vcomp"), lib
    assert lib["num_threads"] == 2
    # numpy's BLAS (if it reports one) is a different library and pool.
    assert all(i["filepath"] != lib["filepath"] for i in res["info"] if i["user_api"] == "blas")
    assert res["openmp_limit"] == 1 and res["openmp_same"]
    assert res["all_limit"] == 1 and res["all_same"]
    assert res["after"] == 2


# ----------------------------------------------------------------- fork

@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_fork_after_threaded_calls_does_not_hang():
    """The parent runs 2-thread calls (libgomp's pool exists), then forks.
    Without fastconv's fork handling the child hangs at its first parallel
    region; with it the child (and a grandchild) run single-threaded, even
    after set_num_threads(2), with the parent's results, and the parent
    keeps its 2 threads."""
    out = check_python(CHILD_PRELUDE + """
fastconv.set_num_threads(2)
before = os_threads()
ref = work()
pool_started = os_threads() > before or before == -1

def wait(pid, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"

pid = os.fork()
if pid == 0:
    ok = fastconv.get_num_threads() == 1 and same(work(), ref)
    fastconv.set_num_threads(2)
    ok = ok and fastconv.get_num_threads() == 1 and same(work(), ref)
    gpid = os.fork()
    if gpid == 0:
        os._exit(0 if fastconv.get_num_threads() == 1 and same(work(), ref) else 1)
    ok = ok and wait(gpid) == 0
    os._exit(0 if ok else 1)
child = wait(pid)
print(json.dumps({"pool_started": pool_started, "child": child,
                  "parent_threads": fastconv.get_num_threads(),
                  "parent_same": same(work(), ref)}))
""", timeout=180)
    res = last_json(out)
    assert res["child"] == 0, f"forked child: {res['child']}"
    assert res["pool_started"], "the parent never started an OpenMP thread pool: nothing tested"
    assert res["parent_threads"] == 2 and res["parent_same"]


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_multiprocessing_pool_workers(method):
    """A pool of 2 workers runs conv2d (and conv2d_backward, sgemm) for a
    parent that had already run threaded calls, under each start method.
    Forked workers run single-threaded; spawned ones are fresh processes."""
    import multiprocessing
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method!r} start method on this platform")
    out = check_python(CHILD_PRELUDE + f"""
import multiprocessing
fastconv.set_num_threads(2)
ref = work()
args = [(X[i:i + 1], W) for i in range(2)] * 2
ctx = multiprocessing.get_context({method!r})
with ctx.Pool(2) as pool:
    ys = pool.starmap_async(fastconv.conv2d, args).get(timeout=120)
    backs = pool.starmap_async(fastconv.conv2d_backward,
                               [(np.ones((1, 22, 22, 32), np.float32), x, w) for x, w in args]
                               ).get(timeout=120)
    gemms = pool.starmap_async(fastconv.sgemm, [(1.0, A, B)] * 2).get(timeout=120)
    threads = pool.apply_async(fastconv.get_num_threads).get(timeout=120)
ok = all(np.allclose(y, fastconv.conv2d(x, w), rtol=1e-5, atol=1e-4) for y, (x, w) in zip(ys, args))
ok = ok and all(np.allclose(g, ref[0], rtol=1e-5, atol=1e-4) for g in gemms)
ok = ok and all(np.allclose(b[1], fastconv.conv2d_backward(np.ones((1, 22, 22, 32), np.float32), x, w)[1],
                            rtol=1e-4, atol=1e-3) for b, (x, w) in zip(backs, args))
print(json.dumps({{"ok": bool(ok), "worker_threads": threads}}))
""", timeout=300)
    res = last_json(out)
    assert res["ok"]
    if method == "fork":          # forked after fastconv was imported
        assert res["worker_threads"] == 1
    else:                         # fresh processes (forkserver's server never imported fastconv)
        assert res["worker_threads"] >= 1


# ----------------------------------------------------------- concurrency

def _concurrent_jobs(rng):
    """8 different calls: (description, function, args, kwargs)."""
    f32, f64 = np.float32, np.float64

    def r(shape, dtype=f32):
        return rng.standard_normal(shape).astype(dtype)
    x1 = r((2, 20, 18, 8))
    x2 = r((1, 16, 16, 12), f64)
    x3 = r((2, 11, 13, 6))
    x4 = r((4, 64, 64, 8))        # 16384 patch rows: chunks shared dynamically
    return [
        ("sgemm", fastconv.sgemm, (1.5, r((300, 200)), r((200, 260)), 0.5, r((300, 260))), {}),
        ("dgemm trans", fastconv.dgemm, (1.0, r((150, 170), f64), r((140, 150), f64)),
         dict(trans_a=True, trans_b=True)),
        ("conv2d", fastconv.conv2d, (x1, r((16, 3, 3, 8)), r((16,))), dict(padding=1)),
        ("conv2d NCHW grouped reflect", fastconv.conv2d,
         (x2.transpose(0, 3, 1, 2), r((12, 4, 3, 3), f64)),
         dict(groups=3, padding=2, dilation=2, padding_mode="reflect", layout="NCHW")),
        ("conv2d depthwise", fastconv.conv2d, (x3, r((12, 3, 3, 1))), dict(groups=6, stride=2)),
        ("conv2d_backward", fastconv.conv2d_backward,
         (r((2, 10, 9, 16)), x1, r((16, 3, 3, 8))), dict(stride=2, padding=1)),
        ("conv_transpose2d", fastconv.conv_transpose2d, (x3, r((6, 4, 4, 5))),
         dict(stride=2, padding=1, output_padding=1)),
        ("conv2d_backward big M", fastconv.conv2d_backward,
         (r((4, 64, 64, 16)), x4, r((16, 3, 3, 8))), dict(padding=1)),
    ]


def _exactly_equal(a, b):
    if isinstance(a, tuple):
        return all(_exactly_equal(u, v) for u, v in zip(a, b))
    return a is None and b is None or np.array_equal(a, b, equal_nan=True)


def test_concurrent_python_threads_match_sequential_results():
    """8 Python threads call sgemm/dgemm/conv2d (plain, grouped NCHW
    reflect, depthwise)/conv2d_backward/conv_transpose2d at once, each with
    2 OpenMP threads of its own, 4 rounds in lockstep: every result equals
    the one computed beforehand, one call at a time, bit for bit (the
    weight gradient's per-thread partials cover fixed chunks, so it too is
    reproducible for a given thread count)."""
    rng = np.random.default_rng(11)
    jobs = _concurrent_jobs(rng)
    expected = [f(*a, **k) for _, f, a, k in jobs]
    rounds = 4
    results = [[None] * rounds for _ in jobs]
    errors = []
    barrier = threading.Barrier(len(jobs))

    def worker(i):
        try:
            fastconv.set_num_threads(2)       # OpenMP limits are per thread
            _, f, a, k = jobs[i]
            for r in range(rounds):
                barrier.wait(timeout=120)
                results[i][r] = f(*a, **k)
        except BaseException as e:            # reported by the main thread
            errors.append((jobs[i][0], repr(e)))
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a Python thread hung"
    assert not errors, errors
    for (name, *_), e, got in zip(jobs, expected, results):
        for r in range(rounds):
            assert _exactly_equal(got[r], e), f"{name}, round {r}"


def _gil_cases():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    # 64 images: Winograd on 1 Zen 5 core took 23 ms for 16, too short for
    # the probe's 10 ms margins either end.
    x = rng.standard_normal((64, 64, 64, 96)).astype(np.float32)
    w = rng.standard_normal((96, 3, 3, 96)).astype(np.float32)
    dy = rng.standard_normal((64, 64, 64, 96)).astype(np.float32)
    return {
        "sgemm": lambda: fastconv.sgemm(1.0, a, a),
        "conv2d": lambda: fastconv.conv2d(x, w, padding=1),               # Winograd
        "conv2d implicit": lambda: fastconv.conv2d(x, w, padding=1, algorithm="implicit"),
        "conv2d_backward": lambda: fastconv.conv2d_backward(dy, x, w, padding=1,
                                                            output_mask=(True, True, False)),
    }


def counter_rate_during(call, idle=0.3):
    """(rate while idle, rate during the middle of one call(), call time):
    increments per second of a Python thread counting in a loop.  Only
    progress strictly inside the call counts, 10 ms in from either end: a
    call holding the GIL leaves nothing there (the counter can run only at
    the interpreter's 5 ms switch points, before and after it)."""
    ticks = []
    stop = threading.Event()

    def counter():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 64 == 0:
                ticks.append((time.perf_counter(), n))

    def rate(t0, t1):
        inside = [n for t, n in list(ticks) if t0 < t < t1]
        return (inside[-1] - inside[0]) / (t1 - t0) if len(inside) > 1 else 0.0

    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    try:
        t0 = time.perf_counter()
        time.sleep(idle)
        idle_rate = rate(t0 + 0.01, time.perf_counter() - 0.01)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        busy_rate = rate(t0 + 0.01, t1 - 0.01)
    finally:
        stop.set()
        thread.join()
    return idle_rate, busy_rate, t1 - t0


def test_gil_probe_detects_a_call_holding_the_gil():
    """The probe below, on a C call that holds the GIL (a regex that
    backtracks for ~200-300 ms): no progress inside the call.  With 28
    characters (50-80 ms) the counter once reached 7 % of its idle rate in
    CI: a thread switch around the call that lands past the 10 ms margins
    weighs more in a short call."""
    import re
    pattern, text = re.compile(r"(a|aa)*b"), "a" * 31 + "c"
    idle_rate, busy_rate, seconds = counter_rate_during(lambda: pattern.match(text))
    assert idle_rate > 0 and seconds > 0.03
    assert busy_rate < 0.05 * idle_rate, (busy_rate, idle_rate, seconds)


@pytest.mark.parametrize("name", ["sgemm", "conv2d", "conv2d implicit", "conv2d_backward"])
def test_kernels_release_the_gil(name):
    """A Python thread counting in a loop keeps going while one long kernel
    call runs on 1 OpenMP thread (so the counter has a core of its own on a
    2-core machine): inside the call it counts at least 25 % as fast as
    while the main thread sleeps (measured: 75-90 %).  A kernel holding the
    GIL would show none (see the probe's own test above)."""
    call = _gil_cases()[name]
    fastconv.set_num_threads(1)
    call()                                    # warm-up
    best = (0.0, 1.0, 0.0)
    for _ in range(3):                        # the best of 3: a loaded machine
        idle_rate, busy_rate, seconds = counter_rate_during(call)
        if busy_rate / max(idle_rate, 1e-9) > best[0] / max(best[1], 1e-9):
            best = (busy_rate, idle_rate, seconds)
        if busy_rate >= 0.25 * idle_rate:
            break
    busy_rate, idle_rate, seconds = best
    assert seconds > 0.03, f"{name}: the call took only {seconds * 1e3:.0f} ms: nothing measured"
    assert busy_rate >= 0.25 * idle_rate, (
        f"{name}: the counter ran at {busy_rate:.3g}/s during a {seconds * 1e3:.0f} ms call, "
        f"{idle_rate:.3g}/s while idle: the GIL seems held")


# ---------------------------------------------------------------- memory

LEAK_CHILD = """
import gc, json, os, time
import numpy as np
import fastconv
fastconv.set_num_threads(2)
rng = np.random.default_rng(0)
r = lambda *s: rng.standard_normal(s).astype(np.float32)
a, b, a64 = r(12, 9), r(9, 7), rng.standard_normal((12, 9))
x, w, bias = r(2, 6, 5, 3), r(4, 3, 3, 3), r(4)
dy = r(2, 6, 5, 4)
xt, wt = r(1, 4, 4, 4), r(4, 2, 2, 3)
dyt = r(1, 8, 8, 3)
xd, wd = r(1, 7, 7, 8), r(8, 3, 3, 1)
cols = fastconv.im2col(x, 3, padding=1)
c = np.zeros((12, 7), np.float32)
calls = {
    "sgemm": lambda: fastconv.sgemm(2.0, a, b, 1.0, c),
    "sgemm_overwrite_c": lambda: fastconv.sgemm(1.0, a, b, 0.0, c, overwrite_c=True),
    "dgemm": lambda: fastconv.dgemm(1.0, a64, b, trans_b=False),
    "matmul": lambda: fastconv.matmul(a, b),
    "conv2d": lambda: fastconv.conv2d(x, w, bias, padding=1),
    "conv2d_nchw_reflect": lambda: fastconv.conv2d(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2),
                                                   padding=1, padding_mode="reflect", layout="NCHW"),
    "conv2d_depthwise": lambda: fastconv.conv2d(xd, wd, groups=8, padding=1),
    "conv2d_backward": lambda: fastconv.conv2d_backward(dy, x, w, padding=1),
    "conv_transpose2d": lambda: fastconv.conv_transpose2d(xt, wt, stride=2),
    "conv_transpose2d_backward": lambda: fastconv.conv_transpose2d_backward(dyt, xt, wt, stride=2),
    "im2col": lambda: fastconv.im2col(x, 3, padding=1),
    "col2im": lambda: fastconv.col2im(cols, x.shape, 3, padding=1),
}
def bad_call():
    try:
        fastconv.conv2d(x, w, stride=0)
    except ValueError:
        pass
    try:
        fastconv.sgemm(1.0, a, a)
    except ValueError:
        pass
calls["errors"] = bad_call

page = os.sysconf("SC_PAGE_SIZE")
def rss():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

N = int(os.environ.get("LEAK_CALLS", "10000"))
growth = {}
t_start = time.perf_counter()
for name, f in calls.items():
    for _ in range(1000):
        f()
    before = rss()
    for _ in range(N):
        f()
    growth[name] = rss() - before
print(json.dumps({"growth": growth, "calls": N, "seconds": time.perf_counter() - t_start}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_no_memory_leak_over_10000_calls():
    """Each public function (both GEMM c modes, NCHW with reflect padding,
    depthwise, and calls that raise ValueError) called 10,000 times on small
    inputs after a 1,000-call warm-up: resident memory grows < 2 MiB."""
    res = last_json(check_python(LEAK_CHILD, timeout=600))
    grown = {k: v for k, v in res["growth"].items() if v >= 2 << 20}
    assert not grown, f"RSS growth over {res['calls']} calls (bytes): {grown}"


# A child under an address-space limit: an allocation that does not fit
# fails at once (also where the system would overcommit), without eating
# the machine's memory.
LIMITED_PRELUDE = """
import json, resource, sys
import numpy as np
import fastconv

def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

def limit(headroom):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom, hard))

def unlimit():
    resource.setrlimit(resource.RLIMIT_AS, (resource.getrlimit(resource.RLIMIT_AS)[1],) * 2)

def limit_works():
    # Whether RLIMIT_AS stops an allocation past it (qemu-user, which runs
    # aarch64 builds on x86-64 hosts, ignores it).
    limit(64 << 20)
    try:
        np.ones(256 << 20, np.uint8)
        works = False
    except MemoryError:
        works = True
    unlimit()
    return works

def outcome(f):
    try:
        f()
        return "ok"
    except MemoryError as e:
        return "MemoryError: " + str(e)
    except Exception as e:
        return type(e).__name__ + ": " + str(e)

# Start libgomp's worker threads while there is room for their stacks
# (libgomp aborts the process when it cannot create a thread).
fastconv.set_num_threads(2)
rng = np.random.default_rng(0)
a = rng.standard_normal((400, 400)).astype(np.float32)
fastconv.sgemm(1.0, a, a)
fastconv.conv2d(rng.standard_normal((2, 32, 32, 16)).astype(np.float32),
                rng.standard_normal((16, 3, 3, 16)).astype(np.float32), padding=1)
"""

SIZE_IN_MESSAGE = r"\d+(\.\d*)? ([KMGTPE]i)?B"


@pytest.mark.skipif(not LINUX, reason="needs /proc and RLIMIT_AS (Linux)")
def test_outputs_that_cannot_fit_raise_memory_error_with_the_size():
    """A batch of 2**40 images as a zero-stride broadcast costs nothing as
    input, but the output would need terabytes: every function raises
    MemoryError naming the size (numpy's message), before any kernel runs,
    and the process goes on working."""
    import re
    out = check_python(LIMITED_PRELUDE + """
f32 = np.float32
big = 2 ** 40
x = np.broadcast_to(np.ones((1, 8, 8, 3), f32), (big, 8, 8, 3))
w = np.ones((4, 3, 3, 3), f32)
dy = np.broadcast_to(np.ones((1, 6, 6, 4), f32), (big, 6, 6, 4))
a = np.broadcast_to(np.ones((1, 5), f32), (big, 5))
limit(1 << 30)
res = {
    "conv2d": outcome(lambda: fastconv.conv2d(x, w)),
    "conv2d NCHW": outcome(lambda: fastconv.conv2d(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2),
                                                   layout="NCHW")),
    "conv2d_backward": outcome(lambda: fastconv.conv2d_backward(dy, x, w)),
    "conv_transpose2d": outcome(lambda: fastconv.conv_transpose2d(x, w.transpose(3, 1, 2, 0))),
    "im2col": outcome(lambda: fastconv.im2col(x, 3)),
    "col2im": outcome(lambda: fastconv.col2im(np.broadcast_to(np.zeros((1, 27), f32), (big, 27)),
                                              (big, 3, 3, 3), 3)),
    "sgemm": outcome(lambda: fastconv.sgemm(1.0, a, np.ones((5, 3), f32))),
    "matmul": outcome(lambda: fastconv.matmul(a, np.ones((5, 3), f32))),
}
res["after"] = outcome(lambda: fastconv.conv2d(np.ones((1, 8, 8, 3), f32), w))
print(json.dumps(res))
""")
    res = last_json(out)
    assert res.pop("after") == "ok"
    for name, outcome in res.items():
        assert outcome.startswith("MemoryError"), (name, outcome)
        assert re.search(SIZE_IN_MESSAGE, outcome), (name, outcome)


@pytest.mark.skipif(not LINUX, reason="needs /proc and RLIMIT_AS (Linux)")
def test_kernel_workspace_allocation_failure_raises_memory_error():
    """Under an address-space limit that leaves room for the inputs and
    the output but not the kernels' own workspace (packed weights, patch
    chunks, per-thread partials), each kernel's malloc failure path raises
    MemoryError, frees what it had (no growth over 20 failures) and the
    next call works."""
    out = check_python(LIMITED_PRELUDE + """
if not limit_works():
    print(json.dumps({"rlimit": "ignored"}))
    sys.exit(0)
f32 = np.float32
C = 1 << 22                   # K = 2*C: workspace >= 2 threads x 6 rows x K floats = 400 MB
x = np.ones((1, 1, 2, C), f32)
w = np.ones((1, 1, 2, C), f32)
dy = np.ones((1, 1, 1, 1), f32)
xd = np.ones((1, 64, 64, 8192), f32)          # depthwise grad weight: partials
wd = np.ones((8192, 64, 64, 1), f32)          # 2 x 64*64*8192 floats = 256 MiB
dyd = np.ones((1, 1, 1, 8192), f32)
# Weight gradients: of one output channel, an accumulator as large as the
# result per thread (126 MB: the result fits, result and accumulator do
# not); of 17, the GEMM's chunks of 252 patch rows of K = 9*32768 values
# (297 MB per thread) for a 20 MB result.
CF = 15 << 20
xf = np.ones((1, 1, 2, CF), f32)
wf = np.ones((1, 1, 2, CF), f32)
xg = np.ones((1, 16, 16, 1 << 15), f32)
wg = np.ones((17, 3, 3, 1 << 15), f32)
dyg = np.ones((1, 16, 16, 17), f32)
limit(200 << 20)
res = {}
for name, f in {
    "conv2d": lambda: fastconv.conv2d(x, w),
    "grad_input": lambda: fastconv.conv2d_backward(dy, x, w, output_mask=(True, False, False)),
    "grad_weight": lambda: fastconv.conv2d_backward(dy, xf, wf, output_mask=(False, True, False)),
    "grad_weight GEMM": lambda: fastconv.conv2d_backward(
        dyg, xg, wg, padding=1, output_mask=(False, True, False)),
    "depthwise grad_weight": lambda: fastconv.conv2d_backward(
        dyd, xd, wd, groups=8192, output_mask=(False, True, False)),
}.items():
    res[name] = outcome(f)
    vm0 = vm_size()
    for _ in range(20):
        outcome(f)
    res[name + " growth"] = vm_size() - vm0
unlimit()
y = fastconv.conv2d(x[..., :64], w[..., :64])
res["after"] = bool(y.shape == (1, 1, 1, 1) and y[0, 0, 0, 0] == 128)
print(json.dumps(res))
""")
    res = last_json(out)
    if res == {"rlimit": "ignored"}:
        pytest.skip("RLIMIT_AS has no effect here (qemu-user emulation): no allocation fails")
    assert res.pop("after")
    for name, value in res.items():
        if name.endswith("growth"):
            assert value < 16 << 20, (name, value)
        else:
            assert value.startswith("MemoryError"), (name, value)


@pytest.mark.skipif(not LINUX, reason="needs /proc and RLIMIT_AS (Linux)")
def test_gemm_packing_buffer_allocation_failure_is_clean():
    """With no address space left at all, sgemm into a preallocated c
    either finds its packing buffer in the heap or raises MemoryError:
    never a crash, and c holds the right result when it returns."""
    out = check_python(LIMITED_PRELUDE + """
rng = np.random.default_rng(1)
a = rng.standard_normal((200, 700)).astype(np.float32)
b = rng.standard_normal((700, 900)).astype(np.float32)
c = np.zeros((200, 900), np.float32)
ref = a.astype(np.float64) @ b
limit(0)
r = outcome(lambda: fastconv.sgemm(1.0, a, b, 0.0, c, overwrite_c=True))
unlimit()
print(json.dumps({"outcome": r, "right": bool(np.allclose(c, ref, rtol=1e-4, atol=1e-3))}))
""")
    res = last_json(out)
    assert res["outcome"] == "ok" and res["right"] or res["outcome"].startswith("MemoryError"), res


@pytest.mark.skipif(not LINUX or sys.maxsize < 2 ** 40, reason="needs a 64-bit Linux address space")
def test_offsets_beyond_32_bits():
    """Views into an 8.6 GB buffer (mapped lazily: only the pages read
    are ever touched) whose element offsets pass 2**31 and byte offsets
    2**32, in every axis the kernels index: results equal those of
    compact copies.  A 32-bit offset anywhere would read the wrong
    elements or fault."""
    out = check_python("""
import json, mmap
import numpy as np
import fastconv
fastconv.set_num_threads(2)
n = (1 << 31) + (1 << 23)              # float32 elements: > 2**31, > 8 GiB
flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0)
try:
    buf = mmap.mmap(-1, n * 4, flags=flags)
except (OSError, OverflowError, MemoryError) as e:
    print(json.dumps({"skip": repr(e)}))
    raise SystemExit(0)
big = np.frombuffer(buf, np.float32)
S = 1 << 29                            # 2 GiB apart: offsets 2**29 .. 2**31 + ...
rng = np.random.default_rng(0)
def place(shape, strides_el, offset):
    v = np.lib.stride_tricks.as_strided(big[offset:], shape, [s * 4 for s in strides_el])
    v[...] = rng.standard_normal(shape).astype(np.float32)
    return v
res = {}
# GEMM operands with a row stride of 2**29 elements: row 4 is past 2**31.
a = place((5, 40), (S, 1), 7)
b = place((40, 30), (1, S // 8), 3)            # column-major, columns 2**26 apart
res["sgemm"] = bool(np.array_equal(fastconv.sgemm(1.0, a, b),
                                   fastconv.sgemm(1.0, a.copy(), b.copy())))
c = place((5, 30), (S // 4 + 1, 1), 1 << 20)
ref = fastconv.sgemm(2.0, a.copy(), b.copy(), 0.5, c.copy())
fastconv.sgemm(2.0, a, b, 0.5, c, overwrite_c=True)
res["sgemm into c"] = bool(np.array_equal(c, ref))
# Images whose batch stride is 2**29 elements (5 images: the last starts
# past 2**31) and whose row stride is 2**20.
x = place((5, 6, 7, 4), (S, 1 << 20, 4, 1), 11)
w = np.random.default_rng(1).standard_normal((3, 3, 3, 4)).astype(np.float32)
xc = x.copy()
dy = np.ones((5, 6, 7, 3), np.float32)
res["conv2d"] = bool(np.array_equal(fastconv.conv2d(x, w, padding=1), fastconv.conv2d(xc, w, padding=1)))
wd = np.random.default_rng(2).standard_normal((4, 3, 3, 1)).astype(np.float32)
res["depthwise"] = bool(np.array_equal(fastconv.conv2d(x, wd, groups=4, padding=1),
                                       fastconv.conv2d(xc, wd, groups=4, padding=1)))
gd1 = fastconv.conv2d_backward(dy[..., :1].repeat(4, axis=3), x, wd, groups=4, padding=1)
gd2 = fastconv.conv2d_backward(dy[..., :1].repeat(4, axis=3), xc, wd, groups=4, padding=1)
res["depthwise backward"] = bool(np.array_equal(gd1[0], gd2[0]) and np.array_equal(gd1[1], gd2[1]))
g1 = fastconv.conv2d_backward(dy, x, w, padding=1)
g2 = fastconv.conv2d_backward(dy, xc, w, padding=1)
res["conv2d_backward"] = bool(np.array_equal(g1[0], g2[0]) and np.allclose(g1[1], g2[1], rtol=1e-5))
res["im2col"] = bool(np.array_equal(fastconv.im2col(x, 2, stride=2), fastconv.im2col(xc, 2, stride=2)))
res["conv_transpose2d"] = bool(np.array_equal(fastconv.conv_transpose2d(x, w.transpose(3, 1, 2, 0)),
                                              fastconv.conv_transpose2d(xc, w.transpose(3, 1, 2, 0))))
print(json.dumps(res))
""", timeout=300)
    res = last_json(out)
    if "skip" in res:
        pytest.skip(f"cannot map 8.6 GB of address space: {res['skip']}")
    assert all(res.values()), res


@pytest.mark.skipif(not LINUX, reason="needs /proc and RLIMIT_AS (Linux)")
def test_broadcast_inputs_beyond_2_31_elements():
    """Zero-stride broadcast inputs of 2**33 .. 2**44 elements: index
    arithmetic in 64 bits (a 65536 x 65536 image read at a stride of 2**15,
    a 2**20-dilated kernel), empty outputs of huge inputs, and outputs
    that cannot fit refused with MemoryError, all under a 1 GiB headroom."""
    out = check_python(LIMITED_PRELUDE + """
f32 = np.float32
one = np.arange(1, 3, dtype=f32).reshape(1, 1, 1, 2)
x = np.broadcast_to(one, (1, 1 << 16, 1 << 16, 2))          # 2**33 elements
w = np.ones((3, 1, 1, 2), f32)
limit(1 << 30)
res = {}
def check(name, f, expect):
    try:
        got = f()
        res[name] = bool(expect(got))
    except MemoryError as e:
        res[name] = "MemoryError: " + str(e)
s = 1 << 15
check("conv2d strided", lambda: fastconv.conv2d(x, w, stride=s),
      lambda y: y.shape == (1, 2, 2, 3) and (y == 3).all())
check("conv2d dilated", lambda: fastconv.conv2d(x, np.ones((1, 2, 2, 2), f32), dilation=(1 << 16) - 1),
      lambda y: y.shape == (1, 1, 1, 1) and y[0, 0, 0, 0] == 12)
check("im2col strided", lambda: fastconv.im2col(x, 1, stride=s),
      lambda c: c.shape == (4, 2) and (c == [1, 2]).all())
check("grad_weight strided", lambda: fastconv.conv2d_backward(np.ones((1, 2, 2, 3), f32), x, w, stride=s,
                                                             output_mask=(False, True, True)),
      lambda g: g[0] is None and (g[1] == np.array([4, 8], f32).reshape(1, 1, 1, 2)).all())
huge = np.broadcast_to(one, (1 << 40, 4, 4, 2))              # 2**45 elements
check("empty output of a huge input", lambda: fastconv.conv2d(huge, np.ones((0, 3, 3, 2), f32)),
      lambda y: y.shape == (1 << 40, 2, 2, 0))
check("empty grad of a huge input", lambda: fastconv.conv2d_backward(
          np.ones((1 << 40, 2, 2, 0), f32), huge, np.ones((0, 3, 3, 2), f32)),
      lambda g: g[0].shape == huge.shape and g[1].shape == (0, 3, 3, 2))
check("sgemm empty", lambda: fastconv.sgemm(1.0, np.broadcast_to(f32(1), (0, 1 << 40)),
                                            np.broadcast_to(f32(1), (1 << 40, 5))),
      lambda c: c.shape == (0, 5))
print(json.dumps(res))
""", timeout=300)
    res = last_json(out)
    # The huge-input empty gradient needs a zeroed grad_input of 2**45
    # elements: MemoryError is the right answer there.
    grad = res.pop("empty grad of a huge input")
    assert grad is True or grad.startswith("MemoryError"), grad
    assert all(v is True for v in res.values()), res


# ------------------------------------------------------------ NaN and inf

def _torch_conv(x, w, b=None, **kw):
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))
    return F.conv2d(t(x), t(w), None if b is None else torch.from_numpy(b), **kw
                    ).permute(0, 2, 3, 1).numpy()


def _same_specials(got, ref):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("oc, case", [
    (8, dict(padding=1)),                         # patch GEMM
    (8, dict(stride=2, padding=2, dilation=2)),
    (8, dict()),                                  # valid
    (6, dict(kernel=1)),                          # pointwise: a plain GEMM
    (4, dict(groups=4, padding=1)),               # depthwise, multiplier 1
    (8, dict(groups=4, padding=1)),               # depthwise, multiplier 2
    (8, dict(groups=2, padding=1)),               # grouped GEMM
    (4, dict(groups=2, padding=1)),               # narrow groups: 2 in, 2 out
], ids=["gemm", "strided-dilated", "valid", "pointwise", "depthwise", "depthwise-x2", "groups",
        "narrow-groups"])
def test_nan_and_inf_propagate_like_pytorch(dtype, oc, case, monkeypatch):
    """NaN, +inf and -inf in the input (and in the weights, where no tap
    reads padding) give NaN/inf exactly where PyTorch does, forward and
    backward (specials in grad_output for grad_input, in x for
    grad_weight).  Left out: a special weight, or a special grad_output for
    grad_weight, meeting zero padding.  Whether 0 * inf = NaN is computed
    there depends on whether padding is materialised: PyTorch gives NaN for
    float64 and not for float32 (and fastconv's patch GEMM gives NaN, its
    depthwise kernels do not).  Winograd, which auto takes for 3x3 stride-1
    layers with few input (forward) or output (input gradient) channels on
    AVX-512, spreads specials over its tiles instead (test_winograd*.py):
    the 3x3 stride-1 cases here run implicit GEMM, both ways."""
    rng = np.random.default_rng(5)
    case = dict(case)
    k = case.pop("kernel", 3)
    groups = case.get("groups", 1)
    fc_case = dict(case)
    if k == 3 and case.get("stride", 1) == 1 and groups == 1:
        fc_case["algorithm"] = "implicit"
        monkeypatch.setattr(fastconv.conv, "_thin_winograd_pays", lambda *args: False)
    x = rng.standard_normal((2, 9, 8, 4)).astype(dtype)
    w = rng.standard_normal((oc, k, k, 4 // groups)).astype(dtype)
    x[0, 2, 3, 1] = np.nan
    x[1, 5, 5, 0] = np.inf
    x[1, 1, 6, 3] = -np.inf
    x[0, 7, 1, 2] = np.inf
    x[0, 7, 2, 2] = -np.inf                       # inf - inf in one output
    y = fastconv.conv2d(x, w, **fc_case)
    _same_specials(y, _torch_conv(x, w, **case))

    # backward: specials in grad_output for grad_input, in x for grad_weight
    dy = rng.standard_normal(y.shape).astype(dtype)
    dys = dy.copy()
    dys[0, 1, 1, 2] = np.nan
    dys[1, 0, 2, 0] = np.inf
    xf = rng.standard_normal(x.shape).astype(dtype)
    for grad_output, inp, checked in ((dys, xf, "grad_input"), (dy, x, "grad_weight")):
        gx, gw, gb = fastconv.conv2d_backward(grad_output, inp, w, **case)
        tx = torch.from_numpy(inp.transpose(0, 3, 1, 2).copy()).requires_grad_()
        tw = torch.from_numpy(w.transpose(0, 3, 1, 2).copy()).requires_grad_()
        F.conv2d(tx, tw, **case).backward(torch.from_numpy(grad_output.transpose(0, 3, 1, 2).copy()))
        if checked == "grad_input":
            _same_specials(gx, tx.grad.permute(0, 2, 3, 1).numpy())
            _same_specials(gb, grad_output.sum(axis=(0, 1, 2), dtype=np.float64).astype(dtype))
        else:
            _same_specials(gw, tw.grad.permute(0, 2, 3, 1).numpy())

    # weights with specials, no padding: every tap reads the image
    kw = {k: v for k, v in case.items() if k != "padding"}
    w2 = w.copy()
    w2[1, 0, 0, 0] = np.nan
    w2[3, k - 1, k // 2, 0] = np.inf
    fc_kw = {k: v for k, v in fc_case.items() if k != "padding"}
    _same_specials(fastconv.conv2d(xf, w2, **fc_kw), _torch_conv(xf, w2, **kw))


@pytest.mark.parametrize("algorithm, groups, oc", [
    ("implicit", 1, 8), ("direct", 4, 4), ("direct", 2, 4)],
    ids=["implicit", "depthwise", "narrow-groups"])
@pytest.mark.parametrize("activation", ["relu", "relu6"])
def test_fused_activation_keeps_nan_like_pytorch(algorithm, groups, oc, activation):
    """The fused relu/relu6 epilogues replace only values below 0 (above
    6): a NaN output stays NaN, as torch.relu leaves it.  (Winograd is left
    out: a NaN there spreads over its whole 4x4 output tile, as documented.)"""
    rng = np.random.default_rng(6)
    x = (4 * rng.standard_normal((1, 7, 6, 4))).astype(np.float32)
    w = rng.standard_normal((oc, 3, 3, 4 // groups)).astype(np.float32)
    x[0, 2, 3, :] = np.nan
    y = fastconv.conv2d(x, w, padding=1, groups=groups, algorithm=algorithm,
                        activation=activation)
    ref = torch.from_numpy(_torch_conv(x, w, padding=1, groups=groups))
    ref = (F.relu if activation == "relu" else F.relu6)(ref).numpy()
    assert np.isnan(ref).any() and (ref == 0).any()
    _same_specials(y, ref)


def test_nan_and_inf_in_conv_transpose2d_like_pytorch():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 5, 6, 4))
    w = rng.standard_normal((4, 3, 3, 3))
    x[0, 1, 2, 0] = np.nan
    x[0, 3, 3, 1] = np.inf
    y = fastconv.conv_transpose2d(x, w, stride=2, padding=1)
    t = F.conv_transpose2d(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()),
                           torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), stride=2, padding=1)
    _same_specials(y, t.permute(0, 2, 3, 1).numpy())


# -------------------------------------------------------------- subnormals

def test_importing_fastconv_leaves_subnormals_on():
    """No flush-to-zero / denormals-are-zero behind the user's back (a
    library built with -ffast-math sets them for the whole process when it
    is loaded): after importing fastconv and running its kernels, numpy
    still produces and reads subnormals, and so do the kernels."""
    out = check_python("""
import numpy as np
tiny = np.finfo(np.float32).smallest_normal
a = np.full(16, tiny, np.float32)
import fastconv
fastconv.conv2d(np.ones((1, 4, 4, 2), np.float32), np.ones((2, 3, 3, 2), np.float32))
sub = a * np.float32(0.25)                     # subnormal results
print(bool((sub > 0).all()), bool(((sub * np.float32(4)) == a).all()))
""")
    assert out.split() == ["True", "True"]
    rng = np.random.default_rng(0)
    x = (rng.uniform(1, 2, (1, 6, 6, 4)) * np.finfo(np.float32).smallest_normal / 64).astype(np.float32)
    w = np.full((2, 3, 3, 4), 0.5, np.float32)
    y = fastconv.conv2d(x, w)
    ref = _torch_conv(x.astype(np.float64), w.astype(np.float64))
    assert (y > 0).all() and (y < np.finfo(np.float32).smallest_normal).all()
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=np.finfo(np.float32).smallest_subnormal * 8)


def _best_time(f, reps):
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def _numpy_subnormal_ratio():
    """How much slower numpy's own element-wise multiply-add runs on
    subnormal inputs than on normal ones, here: the platform's penalty,
    which no kernel that computes subnormals avoids (qemu-user emulates
    subnormal arithmetic in software: 4.3x, measured on an aarch64 build)."""
    rng = np.random.default_rng(3)
    a = rng.uniform(0.5, 1.0, 1 << 20).astype(np.float32)
    sa = (a * (np.finfo(np.float32).smallest_normal / 64)).astype(np.float32)
    out = np.empty_like(a)

    def multiply_add(v):
        return lambda: np.add(np.multiply(v, a, out=out), v, out=out)
    return min(_best_time(multiply_add(sa), 5) / _best_time(multiply_add(a), 5) for _ in range(3))


def _subnormal_cases():
    rng = np.random.default_rng(2)
    tiny = np.finfo(np.float32).smallest_normal
    a = rng.uniform(0.5, 1.0, (512, 512)).astype(np.float32)
    b = rng.uniform(0.5, 1.0, (512, 512)).astype(np.float32)
    x = rng.uniform(0.5, 1.0, (4, 32, 32, 32)).astype(np.float32)
    w = rng.uniform(0.5, 1.0, (64, 3, 3, 32)).astype(np.float32)
    wd = rng.uniform(0.5, 1.0, (32, 3, 3, 1)).astype(np.float32)
    # every element subnormal, and so every product and partial sum
    sa, sx = (a * (tiny / 64)).astype(np.float32), (x * (tiny / 64)).astype(np.float32)
    assert 0 < sa.min() and sa.max() < tiny
    return {
        "sgemm 512": (lambda: fastconv.sgemm(1.0, a, b), lambda: fastconv.sgemm(1.0, sa, b)),
        "conv2d 3x3": (lambda: fastconv.conv2d(x, w, padding=1),
                       lambda: fastconv.conv2d(sx, w, padding=1)),
        "conv2d depthwise": (lambda: fastconv.conv2d(x, wd, padding=1, groups=32),
                             lambda: fastconv.conv2d(sx, wd, padding=1, groups=32)),
    }


@pytest.mark.parametrize("name", ["sgemm 512", "conv2d 3x3", "conv2d depthwise"])
def test_subnormal_inputs_are_not_much_slower(name):
    """Subnormal inputs (products and sums subnormal too) cost less than 2x
    the time of normal ones: min of interleaved runs, 1 thread.  Some CPUs
    take microcode assists on subnormal arithmetic (tens to hundreds of
    cycles each); fastconv does not flush them to zero (see above)."""
    normal, subnormal = _subnormal_cases()[name]
    fastconv.set_num_threads(1)
    normal(), subnormal()
    tn = ts = np.inf
    for _ in range(7):
        tn = min(tn, _best_time(normal, 2))
        ts = min(ts, _best_time(subnormal, 2))
    message = f"{name}: subnormal {ts * 1e3:.2f} ms vs normal {tn * 1e3:.2f} ms ({ts / tn:.2f}x)"
    allowed = 2.0
    if platform.machine() not in X86_64:
        # Elsewhere the platform's own penalty counts (numpy's measured in
        # this run); on x86-64 the FMA builds must stay under 2x.
        platform_ratio = _numpy_subnormal_ratio()
        allowed = 2.0 * max(1.0, platform_ratio)
        message += f"; numpy's own multiply-add {platform_ratio:.2f}x"
    if (ts >= allowed * tn and _dispatch.current_isa() == "baseline"
            and platform.machine() in X86_64):
        # SSE2 has no FMA: a separate multiply rounds each product to a
        # subnormal, which some x86 CPUs handle in microcode.  Measured on
        # the AMD EPYC (Zen 4) CI machine, only on one of its two vCPUs and
        # not every run: 1.0x to 3.4x.  The FMA builds (avx2, avx512) show
        # 1.0x there.  Flushing to zero would be the fix, and only as an
        # opt-in; it is not implemented.
        pytest.xfail("known subnormal penalty of the non-FMA baseline build on x86-64: " + message)
    assert ts < allowed * tn, message


# -------------------------------------------------------- workspace cache

def test_workspace_cache_is_bounded_reused_and_released():
    """Freed workspace blocks are kept for the next call (at most 128 MiB),
    reused without changing any result, and handed back by
    fastconv.release_workspace()."""
    kernels = fastconv._dispatch.kernels
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 30, 30, 64)).astype(np.float32)
    w = rng.standard_normal((64, 3, 3, 64)).astype(np.float32)
    big = rng.standard_normal((1, 7, 7, 512)).astype(np.float32)
    wbig = rng.standard_normal((512, 3, 3, 512)).astype(np.float32)
    fastconv.release_workspace()
    assert kernels.cached_workspace_bytes() == 0
    first = [fastconv.conv2d(x, w, padding=1, algorithm=a) for a in ("winograd", "implicit")]
    cached = kernels.cached_workspace_bytes()
    assert cached > 0
    for _ in range(3):                       # reused blocks: same results, no growth
        again = [fastconv.conv2d(x, w, padding=1, algorithm=a) for a in ("winograd", "implicit")]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        assert kernels.cached_workspace_bytes() == cached
    fastconv.conv2d(big, wbig, padding=1, algorithm="winograd")   # 38 MiB of filters
    assert kernels.cached_workspace_bytes() <= 128 << 20
    released = fastconv.release_workspace()
    assert released > 0 and kernels.cached_workspace_bytes() == 0
    assert fastconv._config.config()["cached_workspace_bytes"] == 0
    np.testing.assert_array_equal(fastconv.conv2d(x, w, padding=1, algorithm="winograd"),
                                  first[0])


def _memory_owner(a):
    """The object at the root of a's chain of bases (a buffer's exporter)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_large_outputs_borrow_workspace_blocks():
    """Outputs of at least 32 MiB (past glibc's largest mmap threshold, so
    np.empty would fault them in afresh every call) come from the workspace
    cache: correct, writable, 64-byte aligned, and back in the cache once
    the array and every view of it are gone."""
    kernels = fastconv._dispatch.kernels
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 512, 520, 3)).astype(np.float32)
    w = rng.standard_normal((32, 1, 1, 3)).astype(np.float32)
    fastconv.release_workspace()
    y = fastconv.conv2d(x, w)
    assert y.nbytes >= fastconv.gemm.WORKSPACE_ARRAY_BYTES
    assert y.flags.writeable and y.ctypes.data % 64 == 0
    assert type(_memory_owner(y)).__name__ == "WorkspaceBlock"
    np.testing.assert_allclose(y, np.einsum("nhwc,oc->nhwo", x, w[:, 0, 0]), rtol=1e-5,
                               atol=1e-5)
    view = y[0, 100:]
    held = kernels.cached_workspace_bytes()
    del y
    assert kernels.cached_workspace_bytes() == held      # the view keeps the block
    view[:] = 1.0
    del view
    assert kernels.cached_workspace_bytes() >= held + 512 * 520 * 32 * 4
    again = fastconv.conv2d(x, w)                        # served from the cache
    np.testing.assert_allclose(again, np.einsum("nhwc,oc->nhwo", x, w[:, 0, 0]), rtol=1e-5,
                               atol=1e-5)
    small = fastconv.conv2d(x[:, :8], w)                 # below the threshold: numpy's
    assert isinstance(_memory_owner(small), np.ndarray)
    fastconv.release_workspace()
    assert kernels.cached_workspace_bytes() == 0


def test_large_outputs_of_concurrent_calls_never_share_a_block():
    """Python threads making and dropping >= 32 MiB outputs at once each get
    a block of their own from the cache: every result stays exact while
    the others' blocks come and go."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 512, 520, 3)).astype(np.float32)
    weights = [rng.standard_normal((32, 1, 1, 3)).astype(np.float32) for _ in range(3)]
    expected = [fastconv.conv2d(x, w) for w in weights]
    errors = []

    def worker(i):
        try:
            for r in range(4):
                y = fastconv.conv2d(x, weights[(i + r) % 3])
                kept = y.copy()
                time.sleep(0.01)                  # let the others reuse freed blocks
                if not np.array_equal(y, kept) or not np.array_equal(y, expected[(i + r) % 3]):
                    errors.append((i, r))
                del y
        except Exception as e:                    # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    fastconv.release_workspace()
