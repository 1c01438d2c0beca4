"""fastconv: cache-blocked GEMM and NHWC convolutions for CPUs.

numpy is the only run-time dependency.  The kernels are Cython + OpenMP,
compiled for several ISAs (AVX-512, AVX2, portable); the best one this CPU
runs is chosen at import (FASTCONV_ISA=avx512|avx2|baseline forces one).
"""
from ._config import __version__, release_workspace, show_config
from ._threads import get_num_threads, set_num_threads
from .conv import (PackedConv2d, col2im, conv2d, conv2d_backward, conv_transpose2d,
                   conv_transpose2d_backward, im2col)
from ._tune import (clear_tuned_algorithms, load_tuned_algorithms, save_tuned_algorithms,
                    tuned_algorithms)
from .gemm import dgemm, matmul, sgemm

__all__ = [
    "__version__", "show_config", "release_workspace", "get_num_threads", "set_num_threads",
    "sgemm", "dgemm", "matmul",
    "im2col", "col2im", "conv2d", "conv2d_backward",
    "conv_transpose2d", "conv_transpose2d_backward", "PackedConv2d",
    "tuned_algorithms", "clear_tuned_algorithms", "save_tuned_algorithms",
    "load_tuned_algorithms",
]
