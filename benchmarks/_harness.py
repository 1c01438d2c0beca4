"""Shared pieces of the benchmark scripts (bench_gemm.py, bench_conv.py).

The timing method itself lives in fastconv._bench (``python -m fastconv
bench`` needs it too) and is re-exported here; this module adds what only
the full scripts need: the common command line, the environment report,
ResNet-50's convolution shapes and the markdown writer.

A script starts with::

    import _harness as h          # puts the source tree first on sys.path
    REEXEC_NOTE = h.reexec_without_openblas_overrides()

before it does any work, so that OpenBLAS runs with its own settings.
"""
import argparse
import contextlib
import io
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

# Benchmark the source tree this script is in (an in-place build), not
# whatever fastconv happens to be installed.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from fastconv._bench import (  # noqa: E402  (re-exported for the scripts)
    FASTCONV, NUMPY, TORCH, Block, ForeignLoad, Library, Timing, fastconv_threads, format_table,
    gflops, import_torch, max_relative_error, numpy_threads, openblas_description,
    reexec_without_openblas_overrides, run_rounds, sample_times, time_block, torch_threads)

__all__ = [
    "FASTCONV", "NUMPY", "TORCH", "Block", "ForeignLoad", "Library", "Timing", "fastconv_threads",
    "format_table", "gflops", "import_torch", "max_relative_error", "numpy_threads",
    "openblas_description", "reexec_without_openblas_overrides", "run_rounds",
    "sample_times", "time_block", "torch_threads",
    "add_common_arguments", "settings_from", "Settings", "run_cell", "wait_until_quiet",
    "libraries_from",
    "environment_report", "ConvLayer", "resnet50_layers", "write_markdown",
    "print_section", "finish_run", "positive_int_list",
]


# --------------------------------------------------------------- command line

class Settings(NamedTuple):
    """How long and how often each cell (library x shape x threads) is timed."""
    budget: float      # timed seconds per cell, over all rounds
    min_reps: int      # samples per cell, over all rounds
    rounds: int        # interleaved rounds
    pause: float       # seconds of sleep between blocks
    retries: int = 0   # re-timings of a cell that other processes disturbed

#: A cell during which other processes used more than this share of the CPUs
#: counts as disturbed (--retry-busy): on 2 CPUs one busy neighbour thread
#: already makes multi-threaded timings swing by 10x.
BUSY_SHARE = 0.05
#: With --retry-busy, at most this many seconds of waiting for the machine to
#: go quiet before each attempt at a cell.
QUIET_WAIT_MAX = 30.0


def add_common_arguments(parser):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    default_threads = ",".join(map(str, sorted({1, cpus})))
    parser.add_argument("--quick", action="store_true",
                        help="a few shapes and a short budget (a smoke run)")
    parser.add_argument("--threads", default=default_threads, type=_thread_list,
                        help=f"comma-separated thread counts (default {default_threads})")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="timed seconds per library x shape x threads cell, over all "
                             "rounds (default 0.6; 0.15 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per cell (default 3; 2 with --quick)")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the tables as GitHub markdown to PATH")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out")
    parser.add_argument("--retry-busy", type=int, default=0, metavar="N",
                        help=f"for a shared machine: wait (up to {QUIET_WAIT_MAX:g} s) for other "
                             f"processes to go quiet before each cell, and re-time a cell up to N "
                             f"times while they used > {BUSY_SHARE * 100:.0f}%% of the CPUs "
                             f"during it; the quietest attempt is kept (default 0: no waiting)")
    return parser


def positive_int_list(what):
    """An argparse type: a comma-separated list of positive ints (``what``
    names them in the error, e.g. "thread counts")."""
    def parse(text):
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}")
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{what} must be >= 1: {text!r}")
        return values
    return parse


_thread_list = positive_int_list("thread counts")


def settings_from(args):
    budget = args.budget if args.budget is not None else (0.15 if args.quick else 0.6)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 3)
    return Settings(budget=budget, min_reps=6, rounds=max(1, rounds), pause=0.3,
                    retries=max(0, args.retry_busy))


def wait_until_quiet(max_wait=QUIET_WAIT_MAX, window=1.0):
    """Sleep until other processes use at most BUSY_SHARE of the CPUs over
    ``window`` seconds, or ``max_wait`` seconds have passed."""
    deadline = time.perf_counter() + max_wait
    while True:
        with ForeignLoad() as load:
            time.sleep(window)
        if load.share is None or load.share <= BUSY_SHARE or time.perf_counter() > deadline:
            return


def run_cell(blocks, settings):
    """run_rounds under ``settings``.  With settings.retries, each attempt
    first waits for a quiet machine (wait_until_quiet), and a disturbed
    attempt (see BUSY_SHARE) is repeated up to settings.retries times.
    Returns (timings, share of the CPUs others used) of the quietest attempt."""
    best = None
    for _ in range(settings.retries + 1):
        if settings.retries:
            wait_until_quiet()
        with ForeignLoad() as load:
            timings = run_rounds(blocks, settings.rounds, settings.budget, settings.min_reps,
                                 settings.pause)
        if best is None or (load.share or 0.0) < (best[1] or 0.0):
            best = (timings, load.share)
        if load.share is None or load.share <= BUSY_SHARE:
            break
    return best


def libraries_from(args):
    """(libraries to compare, torch module or None): fastconv, numpy, and
    torch unless --no-torch or not installed."""
    torch = None if args.no_torch else import_torch()
    libraries = [FASTCONV, NUMPY] + ([TORCH] if torch is not None else [])
    return libraries, torch


# --------------------------------------------------------------- environment

def _cpu_model():
    """lscpu's model name (plus family/model, which tell a generic
    'AMD EPYC' of a VM apart)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        model = fields.get("Model name", "?")
        if "CPU family" in fields:
            model += f" (family {fields['CPU family']}, model {fields.get('Model', '?')})"
        caches = ", ".join(f"{k.split()[0]} {fields[k]}" for k in ("L1d cache", "L2 cache", "L3 cache")
                           if k in fields)
        return f"{model}, {fields.get('CPU(s)', '?')} CPUs" + (f"; {caches}" if caches else "")
    except (OSError, subprocess.CalledProcessError, ValueError):
        return platform.processor() or platform.machine()


def _source_revision():
    """The git commit of the tree benchmarked, '+ local changes' if dirty."""
    def git(*argv):
        return subprocess.run(["git", "-C", REPO_ROOT, *argv], capture_output=True,
                              text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"git {commit}" + (" + local changes" if dirty else "")


def environment_report(torch=None, reexec_note=None):
    """Lines describing what is measured: CPU, Python, BLAS, torch, fastconv."""
    import fastconv
    lines = []
    if reexec_note:
        lines.append(f"note: {reexec_note}")
    lines.append(f"cpu: {_cpu_model()}")
    lines.append(f"python {platform.python_version()}; {openblas_description()}")
    if torch is not None:
        build = torch.__config__.show()
        blas = build.split("BLAS_INFO=", 1)[1].split(",", 1)[0] if "BLAS_INFO=" in build else "?"
        lines.append(f"torch {torch.__version__}, BLAS {blas}, MKL available: "
                     f"{'yes' if torch.backends.mkl.is_available() else 'no'}, "
                     f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                     f"{torch.get_num_threads()} threads")
    else:
        lines.append("torch: not used")
    overrides = [k for k in os.environ if k.startswith(("OMP_", "OPENBLAS_", "MKL_", "GOMP_"))]
    lines.append("threading env: " + (", ".join(f"{k}={os.environ[k]}" for k in sorted(overrides))
                                      or "none set"))
    lines.append(f"source: {_source_revision()}")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        fastconv.show_config()
    lines.append(f"fastconv from {os.path.dirname(fastconv.__file__)}:")
    lines += shown.getvalue().rstrip().splitlines()
    return lines


# --------------------------------------------------------------- ResNet-50

class ConvLayer(NamedTuple):
    """A square convolution on an NHWC image, and the GEMM im2col makes of it."""
    name: str
    in_hw: int
    in_c: int
    out_c: int
    kernel: int
    stride: int
    padding: int
    count: int = 1   # how many layers of the network have this shape

    @property
    def out_hw(self):
        return (self.in_hw + 2 * self.padding - self.kernel) // self.stride + 1

    def gemm_shape(self, batch):
        """(M, N, K) = (pixels, out channels, KH*KW*C)."""
        return batch * self.out_hw ** 2, self.out_c, self.kernel ** 2 * self.in_c


def resnet50_layers():
    """Every distinct convolution shape of ResNet-50 (torchvision's v1.5:
    the stride is on the 3x3) at 224x224, with how often each occurs."""
    layers = {}

    def add(name, in_hw, in_c, out_c, kernel, stride):
        key = (in_hw, in_c, out_c, kernel, stride)
        if key in layers:
            layers[key] = layers[key]._replace(count=layers[key].count + 1)
        else:
            layers[key] = ConvLayer(name, in_hw, in_c, out_c, kernel, stride, kernel // 2)

    add("conv1 7x7/2 3->64", 224, 3, 64, 7, 2)
    hw, in_c = 56, 64          # after the 3x3/2 max pool
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)), start=2):
        out_c = 4 * width
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 2 else 1
            add(f"res{stage} 1x1 {in_c}->{width}", hw, in_c, width, 1, 1)
            s = "/2" if stride == 2 else ""
            add(f"res{stage} 3x3{s} {width}->{width}", hw, width, width, 3, stride)
            out_hw = hw // stride
            add(f"res{stage} 1x1 {width}->{out_c}", out_hw, width, out_c, 1, 1)
            if block == 0:
                add(f"res{stage} down 1x1{s} {in_c}->{out_c}", hw, in_c, out_c, 1, stride)
            hw, in_c = out_hw, out_c
    return list(layers.values())


# --------------------------------------------------------------- output

def print_section(title, headers, rows, notes=(), label_columns=1):
    print(f"\n## {title}")
    for note in notes:
        print(note)
    print()
    print(format_table(headers, rows, label_columns))
    sys.stdout.flush()


def _markdown_table(headers, rows, label_columns=1):
    align = ["---" if i < label_columns else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(map(str, headers)) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path, title, preamble, sections):
    """Write GitHub markdown: ``title``, the ``preamble`` lines as a code
    block, then per section (heading, headers, rows, notes[, label_columns])
    a heading, its notes as paragraphs and the table."""
    parts = [f"# {title}", "```\n" + "\n".join(preamble) + "\n```"]
    for heading, headers, rows, notes, *label_columns in sections:
        parts.append(f"## {heading}")
        parts += list(notes)
        parts.append(_markdown_table(headers, rows, *label_columns))
    with open(path, "w") as f:
        f.write("\n\n".join(parts) + "\n")


def finish_run(started, shares, ok, failure, markdown, title, preamble, sections):
    """The closing lines of a benchmark script: total time and how busy the
    machine was (shares: other processes' CPU share per timed cell), the
    failure line when a fastconv result was wrong, the markdown file.
    Returns the exit status."""
    summary = f"total time {time.perf_counter() - started:.0f} s"
    if shares:
        summary += (f"; other processes used {statistics.mean(shares):.0%} of the CPUs on "
                    f"average while cells were timed (max {max(shares):.0%})")
    print(f"\n{summary}" + ("" if ok else f"\n{failure}"))
    if markdown:
        write_markdown(markdown, title, preamble + [summary], sections)
        print(f"markdown written to {markdown}")
    return 0 if ok else 1
