#!/usr/bin/env python
"""GEMM GFLOPS: fastconv.sgemm vs numpy (OpenBLAS) vs torch.matmul (MKL).

Sections: float32 squares; the GEMMs of every distinct ResNet-50
convolution shape at batch 1 and 8 (M = batch*OH*OW, N = OC, K = KH*KW*C;
A = im2col patches M x K, B = weights K x N, both row-major); fastconv's
ISA builds against each other; float64; short-M products x @ W.T (the
short-M kernels against fastconv's own blocked frame).  Each cell is timed per library in
blocks that take turns over several rounds (see fastconv/_bench.py), and
every fastconv result is checked once against numpy.

    python benchmarks/bench_gemm.py [--quick] [--threads 1,2] [--budget S]
        [--rounds R] [--only squares,resnet,isa,float64,shortm] [--markdown PATH]
        [--no-torch]
"""
import argparse
import contextlib
import os
import sys
import time

import _harness as h

REEXEC_NOTE = h.reexec_without_openblas_overrides()

import numpy as np  # noqa: E402

from fastconv import _dispatch  # noqa: E402

SQUARES = (64, 128, 256, 512, 1024, 2048)
QUICK_SQUARES = (256, 1024)
BATCHES = (1, 8)
#: --quick's ResNet-50 layers: one per stage.
QUICK_LAYERS = ("res2 3x3 64->64", "res3 1x1 128->512", "res4 3x3 256->256", "res5 1x1 512->2048")
FLOAT64_SHAPES = (("1024^2", 1024, 1024, 1024), ("res2 3x3 64->64", 3136, 64, 576))
#: Short-M products x @ W.T (W row-major N x K, read as a transposed view):
#: 1x1 convolutions on a 7x7 image at batch 1, nn.Linear at small batches.
SHORT_M_SHAPES = (("res5 1x1 2048->512 b1", 49, 512, 2048),
                  ("res5 1x1 512->2048 b1", 49, 2048, 512),
                  ("1x1 1024->2048 @7 b1", 49, 2048, 1024),
                  ("linear 512->1000 b8", 8, 1000, 512),
                  ("linear 2048->2048 b16", 16, 2048, 2048))
#: Largest max |fastconv - numpy| / max |numpy| accepted, per dtype.
TOLERANCE = {np.float32: 1e-4, np.float64: 1e-12}
LEGEND = ("GFLOPS: best (fastest call) / median.  Ratios: fastconv / other, of best / of "
          "median; > 1 means fastconv is faster.  others: share of the CPUs that other "
          "processes used while the row was timed (above a few %, distrust its "
          "multi-threaded numbers).")


class Cell:
    """One shape on one thread count: timings per library, fastconv's error,
    and the CPU share other processes took while it was timed."""

    def __init__(self, label, m, n, k, threads, timings, error, tolerance, foreign_load):
        self.label, self.m, self.n, self.k, self.threads = label, m, n, k, threads
        self.timings = timings
        self.error = error
        self.ok = error <= tolerance
        self.foreign_load = foreign_load

    def rate(self, name):
        t = self.timings[name]
        return h.gflops(self.m, self.n, self.k, t.best), h.gflops(self.m, self.n, self.k, t.median)


def measure(label, m, n, k, dtype, libraries, thread_counts, settings, rng, b_transposed=False):
    """Cells for one GEMM shape on each thread count (b_transposed: B is the
    transposed view of a row-major N x K array)."""
    a = rng.standard_normal((m, k), dtype=dtype)
    b = (rng.standard_normal((n, k), dtype=dtype).T if b_transposed
         else rng.standard_normal((k, n), dtype=dtype))
    calls = {lib.name: lib.gemm(a, b) for lib in libraries}
    reference = a @ b
    cells = []
    for threads in thread_counts:
        print(f"  {label:<28} {m:>6}x{n:<5}x{k:<5} {threads} thread(s)", file=sys.stderr, flush=True)
        # The split of the work depends on the thread count: check each.
        with h.fastconv_threads(threads):
            error = h.max_relative_error(calls["fastconv"](), reference)
        blocks = [h.Block(lib.name, lambda lib=lib: lib.threads(threads), calls[lib.name])
                  for lib in libraries]
        timings, foreign_load = h.run_cell(blocks, settings)
        cells.append(Cell(label, m, n, k, threads, timings, error, TOLERANCE[dtype], foreign_load))
    return cells


def comparison_table(cells, libraries, total_rows=()):
    """Headers and rows: GFLOPS per library, ratios, fastconv's error."""
    others = [lib.name for lib in libraries[1:]]
    headers = (["shape", "M", "N", "K", "thr"] + [lib.name for lib in libraries]
               + [f"fastconv/{o}" for o in others] + ["rel err", "others"])
    rows = []
    for cell in list(cells) + list(total_rows):
        fc_best, fc_median = cell.rate("fastconv")
        row = [cell.label, cell.m, cell.n, cell.k, cell.threads]
        row += ["{:.1f} / {:.1f}".format(*cell.rate(lib.name)) for lib in libraries]
        for other in others:
            best, median = cell.rate(other)
            row.append(f"{fc_best / best:.2f} / {fc_median / median:.2f}")
        row.append("" if cell.error is None else
                   f"{cell.error:.1e}" + ("" if cell.ok else " FAIL"))
        row.append(_percent(cell.foreign_load))
        rows.append(row)
    return headers, rows


def _percent(share):
    return "" if share is None else f"{share:.0%}"


class NetworkTotal:
    """All of a network's conv GEMMs as one: each layer shape weighted by how
    often it occurs, so it reads as 'the whole network's GEMM time'."""

    def __init__(self, label, weighted_cells, threads):
        self.label, self.threads = label, threads
        self.m = self.n = self.k = ""
        self.error = self.foreign_load = None
        self.flops = sum(count * 2.0 * c.m * c.n * c.k for c, count in weighted_cells)
        names = weighted_cells[0][0].timings.keys()
        self.seconds = {name: (sum(count * c.timings[name].best for c, count in weighted_cells),
                               sum(count * c.timings[name].median for c, count in weighted_cells))
                        for name in names}

    def rate(self, name):
        best, median = self.seconds[name]
        return self.flops / best / 1e9, self.flops / median / 1e9


class Section:
    """A finished table: what print_section and write_markdown take, plus
    whether every fastconv result in it was right."""

    def __init__(self, title, headers, rows, notes, ok=True):
        self.title, self.headers, self.rows, self.notes, self.ok = title, headers, rows, notes, ok

    def as_tuple(self):
        return self.title, self.headers, self.rows, self.notes


def squares_section(args, settings, libraries, rng):
    cells = []
    for size in QUICK_SQUARES if args.quick else SQUARES:
        cells += measure(f"{size}^2", size, size, size, np.float32, libraries, args.threads,
                         settings, rng)
    cells.sort(key=lambda c: c.threads)
    return Section("float32 squares", *comparison_table(cells, libraries), [LEGEND],
                   all(c.ok for c in cells))


def resnet_section(batch, args, settings, libraries, rng):
    layers = h.resnet50_layers()
    if args.quick:
        layers = [layer for layer in layers if layer.name in QUICK_LAYERS]
    # Layers whose GEMMs coincide (a stride-2 3x3 and its stride-1 twins:
    # same output size and channels) are timed once and counted for all,
    # under the name of the commonest, "+/2" marking a strided twin.
    by_gemm = {}
    for layer in layers:
        by_gemm.setdefault(layer.gemm_shape(batch), []).append(layer)
    weighted = []
    for (m, n, k), group in by_gemm.items():
        count = sum(layer.count for layer in group)
        label = max(group, key=lambda layer: layer.count).name
        if len(group) > 1 and any(layer.stride == 2 for layer in group):
            label += " +/2"
        for cell in measure(f"{label} x{count}", m, n, k, np.float32, libraries,
                            args.threads, settings, rng):
            weighted.append((cell, count))
    totals = [] if args.quick else [
        NetworkTotal("all ResNet-50 convs", [(c, n) for c, n in weighted if c.threads == t], t)
        for t in args.threads]
    cells = sorted((c for c, _ in weighted), key=lambda c: c.threads)
    notes = [LEGEND, "M = batch*OH*OW, N = out channels, K = KH*KW*C; 'xN' = how many "
             "layers of the network have that GEMM shape (a stride-2 3x3 and its stride-1 "
             "twins coincide).  'all ResNet-50 convs' sums each library's time over the "
             "network's layers (weighted by xN)."]
    return Section(f"ResNet-50 convolutions as GEMMs, batch {batch}, float32",
                   *comparison_table(cells, libraries, totals), notes, all(c.ok for c in cells))


@contextlib.contextmanager
def fastconv_isa(isa, threads):
    with h.fastconv_threads(threads), _dispatch.use_isa(isa):
        yield


def isa_section(args, settings, libraries, rng, size=1024, threads=1):
    """fastconv's kernel builds against each other on one square."""
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    reference = a @ b
    call = h.FASTCONV.gemm(a, b)   # dispatches at call time, so use_isa applies
    errors = {}
    for isa in _dispatch.AVAILABLE:
        with fastconv_isa(isa, threads):
            errors[isa] = h.max_relative_error(call(), reference)
    print(f"  ISA builds {', '.join(_dispatch.AVAILABLE)} on {size}^2", file=sys.stderr, flush=True)
    blocks = [h.Block(isa, lambda isa=isa: fastconv_isa(isa, threads), call)
              for isa in _dispatch.AVAILABLE]
    timings, foreign_load = h.run_cell(blocks, settings)
    best_isa = _dispatch.AVAILABLE[0]
    top = timings[best_isa]
    headers = ["ISA build", "GFLOPS", f"of {best_isa}", "rel err"]
    rows = []
    for isa, t in timings.items():
        ok = errors[isa] <= TOLERANCE[np.float32]
        rows.append([isa, f"{h.gflops(size, size, size, t.best):.1f} / "
                          f"{h.gflops(size, size, size, t.median):.1f}",
                     f"{top.best / t.best:.2f} / {top.median / t.median:.2f}",
                     f"{errors[isa]:.1e}" + ("" if ok else " FAIL")])
    notes = [f"float32 {size}^2, {threads} thread; GFLOPS best / median; 'of {best_isa}' = "
             f"speed relative to the {best_isa} build (best / median); other processes "
             f"used {_percent(foreign_load)} of the CPUs meanwhile."]
    if "avx2" in timings and "avx512" in timings:
        ratio = timings["avx512"].median / timings["avx2"].median
        notes.append(f"avx2 / avx512 (median): {ratio:.2f}")
    return Section(f"fastconv ISA builds, {size}^2 float32, {threads} thread", headers, rows,
                   notes, all(e <= TOLERANCE[np.float32] for e in errors.values()))


def float64_section(args, settings, libraries, rng):
    cells = []
    for label, m, n, k in FLOAT64_SHAPES[:1] if args.quick else FLOAT64_SHAPES:
        cells += measure(label, m, n, k, np.float64, libraries, args.threads, settings, rng)
    cells.sort(key=lambda c: c.threads)
    return Section("float64 (fastconv.dgemm)", *comparison_table(cells, libraries), [LEGEND],
                   all(c.ok for c in cells))


def _frame_gemm(a, b):
    """fastconv's GEMM with the short-M kernels turned off: the blocked
    frame, which packs all of B."""
    call = h.FASTCONV.gemm(a, b)

    def run():
        previous = _dispatch.kernels.set_short_m(False)
        try:
            return call()
        finally:
            _dispatch.kernels.set_short_m(previous)
    return run


FRAME = h.Library("fastconv frame", h.fastconv_threads, _frame_gemm)


def short_m_section(args, settings, libraries, rng):
    cells = []
    for label, m, n, k in SHORT_M_SHAPES[:2] if args.quick else SHORT_M_SHAPES:
        cells += measure(label, m, n, k, np.float32, libraries + [FRAME], args.threads,
                         settings, rng, b_transposed=True)
    cells.sort(key=lambda c: c.threads)
    applies = {label: _dispatch.kernels.short_m_gemm_applies(m, n, k, "float32")
               for label, m, n, k in SHORT_M_SHAPES}
    notes = [LEGEND, "x @ W.T with W a row-major N x K array (B its transposed view). "
             "'fastconv frame': the same call with the short-M kernels turned off "
             "(fastconv's blocked GEMM, which packs all of W^T into panels first).  "
             "Short-M kernels in this build for: "
             + (", ".join(label for label, on in applies.items() if on) or "none") + "."]
    return Section("Short-M products x @ W.T, float32",
                   *comparison_table(cells, libraries + [FRAME]), notes,
                   all(c.ok for c in cells))


SECTIONS = {
    "squares": lambda *a: [squares_section(*a)],
    "resnet": lambda args, *a: [resnet_section(batch, args, *a)
                                for batch in (BATCHES[:1] if args.quick else BATCHES)],
    "isa": lambda *a: [isa_section(*a)],
    "float64": lambda *a: [float64_section(*a)],
    "shortm": lambda *a: [short_m_section(*a)],
}


def _section_list(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {text!r}")
    return names


def main():
    parser = h.add_common_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--only", type=_section_list, default=list(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    args = parser.parse_args()
    settings = h.settings_from(args)
    libraries, torch = h.libraries_from(args)
    rng = np.random.default_rng(20240601)
    started = time.perf_counter()

    preamble = h.environment_report(torch, REEXEC_NOTE)
    preamble.append(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    preamble.append(f"method: per cell {settings.budget:g} s timed, >= {settings.min_reps} "
                    f"samples, {settings.rounds} interleaved rounds, {settings.pause:g} s pause "
                    f"before each library's block; outputs preallocated"
                    + (f"; disturbed cells re-timed up to {settings.retries} times"
                       if settings.retries else ""))
    print("\n".join(preamble), flush=True)

    sections = []
    with h.ForeignLoad() as load:
        for name in args.only:
            for section in SECTIONS[name](args, settings, libraries, rng):
                h.print_section(*section.as_tuple())
                sections.append(section)
    failed = not all(section.ok for section in sections)

    summary = f"total time {time.perf_counter() - started:.0f} s"
    if load.share is not None:
        summary += f"; other processes used {load.share:.0%} of the CPUs meanwhile"
    print(f"\n{summary}" + ("\nSOME FASTCONV RESULTS ARE WRONG (FAIL)" if failed else ""))
    if args.markdown:
        h.write_markdown(args.markdown, "fastconv GEMM benchmark", preamble + [summary],
                         [section.as_tuple() for section in sections])
        print(f"markdown written to {args.markdown}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
