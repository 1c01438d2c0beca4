"""Timing primitives, and the short fastconv-vs-BLAS comparison that
``python -m fastconv bench`` prints.

benchmarks/_harness.py builds the full benchmark scripts on these; this
module ships with the package, so it stays small and needs numpy only.
threadpoolctl (to pin OpenBLAS's thread count) and torch (MKL, a second
reference) are used when they are importable.

Measured pitfalls on a small shared machine that shape the method:

* fastconv's OpenMP threads, OpenBLAS's and torch's all spin-wait for a
  while after a call and slow down whichever library runs next.  So every
  library is timed in a block of its own, after an untimed warm-up, with a
  pause between blocks (``run_rounds``).
* the machine's speed drifts; blocks take turns over several rounds
  (A B C A B C ...) so a slow spell hits every library alike.
* another process on one of two CPUs wrecks multi-threaded timings (of
  every library, by up to 10x): ``ForeignLoad`` measures how much CPU
  others took, so a disturbed timing can be recognised.
"""
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
from typing import Callable, ContextManager, NamedTuple

import numpy as np

from ._dispatch import current_isa
from ._threads import get_num_threads, set_num_threads
from .gemm import dgemm, sgemm

# --------------------------------------------------------------- environment

#: OpenBLAS reads these when it loads.  Some images set them; they override
#: its CPU detection (kernel, cache size) and can halve its GFLOPS on Zen 4.
OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# Tells the re-executed process what was removed, so it can say so.
_REEXEC_NOTE_VAR = "_FASTCONV_BENCH_REMOVED_ENV"


def _own_command_line():
    """argv that runs this process's program again (``-m`` included)."""
    if getattr(sys, "orig_argv", None):  # Python >= 3.10: the argv as typed
        return [sys.executable] + sys.orig_argv[1:]
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    if main_spec is not None:  # started as ``python -m package``
        module = main_spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module] + sys.argv[1:]
    return [sys.executable] + sys.argv


def reexec_without_openblas_overrides():
    """Restart this process without OPENBLAS_OVERRIDES in its environment.

    Does not return while any of them is set (OpenBLAS is loaded already, so
    only a new process can drop them).  In the restarted process it returns
    a note saying what was removed, else None.
    """
    removed = {name: os.environ[name] for name in OPENBLAS_OVERRIDES if name in os.environ}
    if removed:
        env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_OVERRIDES}
        env[_REEXEC_NOTE_VAR] = " ".join(f"{k}={v}" for k, v in removed.items())
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, _own_command_line(), env)
    removed_note = os.environ.pop(_REEXEC_NOTE_VAR, None)
    if removed_note:
        return f"re-executed without {removed_note} (they override OpenBLAS's CPU detection)"
    return None


def openblas_description():
    """numpy's BLAS, e.g. 'numpy 2.4.0, OpenBLAS 0.3.31 (SkylakeX kernels)'."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return f"numpy {np.__version__} (install threadpoolctl to see its BLAS)"
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    if not blas:
        return f"numpy {np.__version__}, BLAS not found by threadpoolctl"
    parts = [f"{p['internal_api']} {p['version']} ({p.get('architecture', '?')} kernels)"
             for p in blas]
    return f"numpy {np.__version__}, {'; '.join(parts)}"


class ForeignLoad:
    """Context measuring the share of this machine's CPU time that other
    processes used while it was open: on a shared machine, the measure of
    how far to trust the timings taken inside.  ``share`` is a fraction of
    all CPUs (0.5 on 2 CPUs: one CPU's worth), or None off Linux."""

    share = None

    @staticmethod
    def _busy_seconds():
        # Busy time of all CPUs (user nice system irq softirq) since boot.
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_seconds():
        t = os.times()
        return t.user + t.system

    def __enter__(self):
        try:
            self._start = (self._busy_seconds(), self._own_seconds(), time.perf_counter())
        except (OSError, ValueError, AttributeError):
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            busy0, own0, wall0 = self._start
            others = (self._busy_seconds() - busy0) - (self._own_seconds() - own0)
            capacity = (time.perf_counter() - wall0) * os.cpu_count()
            self.share = min(1.0, max(0.0, others / capacity))
        return False


# --------------------------------------------------------------- timing

#: Calls shorter than this are repeated inside one sample, so that timer
#: resolution and per-call jitter do not dominate it.
MIN_SAMPLE_SECONDS = 2e-3
#: Untimed warm-up per block: wakes the library's thread pool and lets the
#: previous library's spinning threads go quiet.
WARMUP_SECONDS = 0.05


def sample_times(fn, budget, min_reps, warmup=WARMUP_SECONDS):
    """Seconds per call of ``fn()``: after ``warmup`` seconds (at least one
    call) untimed, at least ``min_reps`` samples and ``budget`` seconds."""
    clock = time.perf_counter
    start = clock()
    while True:
        t0 = clock()
        fn()
        t1 = clock()
        last_call = t1 - t0  # sizes the inner loop below
        if t1 - start >= warmup:
            break
    inner = max(1, math.ceil(MIN_SAMPLE_SECONDS / max(last_call, 1e-9)))
    samples = []
    start = clock()
    while len(samples) < min_reps or clock() - start < budget:
        t0 = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - t0) / inner)
    return samples


class Timing(NamedTuple):
    """Summary of per-call samples, in seconds."""
    best: float
    median: float
    samples: int

    @classmethod
    def of(cls, samples):
        return cls(min(samples), statistics.median(samples), len(samples))


def time_block(fn, budget, min_reps):
    """(min, median) seconds per call of ``fn()``, see :func:`sample_times`."""
    timing = Timing.of(sample_times(fn, budget, min_reps))
    return timing.best, timing.median


class Block(NamedTuple):
    """One library's turn: ``fn`` is timed inside ``enter()`` (which sets
    that library's thread count, say); ``key`` names it in the results."""
    key: object
    enter: Callable[[], ContextManager]
    fn: Callable[[], object]


def run_rounds(blocks, rounds=2, budget=0.4, min_reps=6, pause=0.3):
    """Time the blocks taking turns, ``rounds`` times over (A B C A B C).

    ``budget`` (seconds) and ``min_reps`` are per key, over all rounds;
    ``pause`` seconds of sleep before each block let the previous block's
    (or the caller's) spin-waiting threads sleep.  Returns {key: Timing}.
    """
    block_budget = budget / rounds
    block_reps = max(1, math.ceil(min_reps / rounds))
    samples = {block.key: [] for block in blocks}
    for turn in range(rounds * len(blocks)):
        block = blocks[turn % len(blocks)]
        time.sleep(pause)  # also after whatever ran before this call
        with block.enter():
            samples[block.key] += sample_times(block.fn, block_budget, block_reps)
    return {key: Timing.of(s) for key, s in samples.items()}


def gflops(m, n, k, seconds):
    return 2.0 * m * n * k / seconds / 1e9


# --------------------------------------------------------------- the libraries
# Each library: a thread-count context and gemm(a, b) -> a zero-argument call
# computing a @ b into an output allocated once (so allocation and page
# faults are not timed) and returning it.  fastconv and torch end up on one
# libgomp in the same process (whichever loaded first), so each block sets
# its own library's thread count on entry rather than once up front.

@contextlib.contextmanager
def fastconv_threads(n):
    previous = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(previous)


def fastconv_gemm(a, b):
    out = np.empty((a.shape[0], b.shape[1]), a.dtype)
    gemm = sgemm if a.dtype == np.float32 else dgemm
    return lambda: gemm(1.0, a, b, c=out, overwrite_c=True)


_blas_controller = None


def numpy_threads(n):
    """Limit numpy's BLAS to ``n`` threads (needs threadpoolctl)."""
    global _blas_controller
    if _blas_controller is None:
        from threadpoolctl import ThreadpoolController
        _blas_controller = ThreadpoolController()
    return _blas_controller.limit(limits=n, user_api="blas")


def numpy_gemm(a, b):
    out = np.empty((a.shape[0], b.shape[1]), a.dtype)
    return lambda: np.matmul(a, b, out=out)


@contextlib.contextmanager
def torch_threads(n):
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def torch_gemm(a, b):
    import torch
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=ta.dtype)
    return lambda: torch.matmul(ta, tb, out=out)


class Library(NamedTuple):
    name: str
    threads: Callable[[int], ContextManager]
    gemm: Callable[[np.ndarray, np.ndarray], Callable[[], object]]


FASTCONV = Library("fastconv", fastconv_threads, fastconv_gemm)
NUMPY = Library("numpy", numpy_threads, numpy_gemm)
TORCH = Library("torch", torch_threads, torch_gemm)


def import_torch():
    """torch, or None when it is not installed (fastconv never needs it)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def max_relative_error(result, reference):
    """max |result - reference| / max |reference| (in float64)."""
    result = np.asarray(result, np.float64)
    reference = np.asarray(reference, np.float64)
    scale = np.abs(reference).max() or 1.0
    return float(np.abs(result - reference).max() / scale)


# --------------------------------------------------------------- tables

def format_table(headers, rows, label_columns=1):
    """Aligned plain-text table: the first ``label_columns`` columns
    left-aligned, the (numeric) rest right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(cell.ljust(w) if i < label_columns else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


# --------------------------------------------------------------- python -m fastconv bench

#: A few squares and the GEMMs (M = pixels, N = out channels, K = KH*KW*C)
#: of four ResNet-50 convolutions at batch 1, one per stage.
QUICK_SHAPES = (
    ("256^2", 256, 256, 256),
    ("512^2", 512, 512, 512),
    ("1024^2", 1024, 1024, 1024),
    ("res2 3x3 64->64", 3136, 64, 576),
    ("res3 1x1 128->512", 784, 512, 128),
    ("res4 3x3 256->256", 196, 256, 2304),
    ("res5 1x1 512->2048", 49, 2048, 512),
)


def quick_comparison(use_torch=True, budget=0.12, rounds=2, pause=0.15, seed=0,
                     progress=None, ratios=None):
    """Print fastconv vs numpy (and torch) float32 GEMM GFLOPS for
    QUICK_SHAPES, on 1 thread and on all of this machine's CPUs.
    progress: an object whose step(label) announces each cell (see
    _bench_conv.Progress); ratios: a list that gets (label, {other:
    fastconv/other}) per cell."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if importlib.util.find_spec("threadpoolctl") is not None:  # numpy_threads needs it
        thread_counts = sorted({1, cpus})
        numpy_lib = NUMPY
    else:
        # Without threadpoolctl OpenBLAS runs on all CPUs: compare there only.
        print("threadpoolctl not installed: comparing on all CPUs only")
        thread_counts = [cpus]
        numpy_lib = NUMPY._replace(threads=lambda n: contextlib.nullcontext())
    libraries = [FASTCONV, numpy_lib]
    torch = import_torch() if use_torch else None
    if torch is not None:
        libraries.append(TORCH)

    print(f"fastconv {current_isa()} kernels vs {openblas_description()}"
          + (f" and torch {torch.__version__}" if torch is not None else ""))
    print(f"float32 GFLOPS, median of >= {budget:g} s per cell over {rounds} "
          f"interleaved rounds; x = fastconv / other (> 1: fastconv faster)\n")
    rng = np.random.default_rng(seed)
    headers = ["shape", "M", "N", "K", "threads"] + [lib.name for lib in libraries]
    headers += [f"x {lib.name}" for lib in libraries[1:]]
    rows = []
    worst_error = 0.0
    with ForeignLoad() as load:
        for label, m, n, k in QUICK_SHAPES:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            calls = {lib.name: lib.gemm(a, b) for lib in libraries}
            worst_error = max(worst_error, max_relative_error(calls["fastconv"](), a @ b))
            for threads in thread_counts:
                if progress is not None:
                    progress.step(f"GEMM {label}, {threads} thread(s)")
                blocks = [Block(lib.name, lambda lib=lib: lib.threads(threads), calls[lib.name])
                          for lib in libraries]
                times = run_rounds(blocks, rounds=rounds, budget=budget, min_reps=4, pause=pause)
                rate = {name: gflops(m, n, k, t.median) for name, t in times.items()}
                if ratios is not None:
                    ratios.append((f"GEMM {label}, {threads} thr",
                                   {lib.name: rate["fastconv"] / rate[lib.name]
                                    for lib in libraries[1:]}))
                rows.append([label, m, n, k, threads]
                            + [f"{rate[lib.name]:.1f}" for lib in libraries]
                            + [f"{rate['fastconv'] / rate[lib.name]:.2f}" for lib in libraries[1:]])
    if progress is not None:
        progress.clear()
    print(format_table(headers, rows))
    print(f"\nlargest relative error of fastconv vs numpy: {worst_error:.1e}")
    if load.share is not None:
        print(f"other processes used {load.share:.0%} of the CPUs meanwhile"
              + ("; timings, multi-threaded ones most, are unreliable" if load.share > 0.1 else ""))
    return worst_error < 1e-4
