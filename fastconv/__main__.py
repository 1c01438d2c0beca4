"""Command line: ``python -m fastconv bench`` | ``python -m fastconv config``."""
import argparse
import sys


def _bench(args):
    from ._bench import QUICK_SHAPES, quick_comparison, reexec_without_openblas_overrides
    from ._bench_conv import (QUICK_CONV_LAYERS, Progress, conv_comparison, cpu_count,
                              plot_ratios, resnet18_comparison)
    reexec_note = reexec_without_openblas_overrides()
    if reexec_note:
        print(reexec_note)
    use_torch = not args.no_torch
    ratios = []
    # GEMM cells (shapes x thread counts), conv layers, ResNet-18's two steps
    gemm_cells = len(QUICK_SHAPES) * len({1, cpu_count()})
    progress = Progress(gemm_cells + len(QUICK_CONV_LAYERS) + 2)
    ok = quick_comparison(use_torch=use_torch, progress=progress, ratios=ratios)
    ok &= conv_comparison(use_torch=use_torch, progress=progress, ratios=ratios)
    ok &= resnet18_comparison(use_torch=use_torch, progress=progress, ratios=ratios)
    if args.plot:
        plot_ratios(args.plot, ratios)
    return 0 if ok else 1


def _config(args):
    from ._config import show_config
    show_config()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fastconv",
        description="fastconv command-line tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = commands.add_parser(
        "bench", help="compare fastconv with numpy's BLAS (and torch) here, ~1 min",
        description="A short float32 comparison on this machine: fastconv's GEMM vs numpy "
                    "(OpenBLAS) and torch when installed, on squares and ResNet-50 "
                    "convolution-shaped products, 1 thread and all CPUs; then a few conv2d "
                    "layers vs a numpy im2col + matmul reference (and torch), and ResNet-18 "
                    "inference end to end (vs torch).  For the full benchmarks see "
                    "benchmarks/bench_gemm.py, bench_conv.py and bench_resnet18.py in the "
                    "source tree.")
    bench.add_argument("--no-torch", action="store_true", help="leave torch out")
    bench.add_argument("--plot", metavar="PNG",
                       help="also draw the fastconv/other ratios as a bar chart (needs "
                            "matplotlib)")
    bench.set_defaults(run=_bench)
    config = commands.add_parser("config", help="show the build and the kernels in use")
    config.set_defaults(run=_config)

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
