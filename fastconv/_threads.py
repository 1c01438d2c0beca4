"""Thread control: fastconv's kernels run on the OpenMP runtime they were
linked with, so OMP_NUM_THREADS, omp_set_num_threads and threadpoolctl's
"openmp" limits all apply to them."""
import operator

from ._kernels import _runtime


def set_num_threads(n):
    """Use at most ``n`` threads in later fastconv calls from this thread."""
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n must be an int, got {type(n).__name__}") from None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _runtime.set_max_threads(n)


def get_num_threads():
    """The number of threads fastconv calls use at most."""
    return _runtime.get_max_threads()
