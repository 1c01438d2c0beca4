"""Thread control: fastconv's kernels run on the OpenMP runtime they were
linked with, so OMP_NUM_THREADS, omp_set_num_threads and threadpoolctl's
"openmp" limits all apply to them.

Every kernel call takes its thread count from get_num_threads(), passed
explicitly (OpenMP ``num_threads`` clause), so this is the one place that
decides how many threads a call may use.

Fork safety: GNU libgomp's worker pool does not survive fork(); a child
whose parent had run a parallel region would hang at its next one.  In a
process forked after fastconv was imported (os.fork, multiprocessing's
"fork", "forkserver" workers when the server imported fastconv -- it imports
the main module by default --, fork() from C), fastconv therefore uses one
thread, whatever set_num_threads, OMP_NUM_THREADS or threadpoolctl say.
Processes started with multiprocessing's "spawn" method are fresh and use
threads as usual.
"""
import operator

from ._kernels import _runtime


def set_num_threads(n):
    """Use at most ``n`` threads in later fastconv calls from this thread.

    In a fork()ed child the limit is recorded but fastconv still uses one
    thread (see :func:`get_num_threads`)."""
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
    """The number of threads fastconv calls use at most: the OpenMP limit
    of the calling thread, or 1 in a process created by fork() (libgomp's
    thread pool cannot be used there)."""
    if _runtime.in_forked_child():
        return 1
    return _runtime.get_max_threads()
