# cython: language_level=3
"""CPU feature detection and OpenMP thread control, built for the baseline
target so it imports on any CPU.

Fork safety: GNU libgomp keeps its worker threads in a pool that fork()
does not copy, so a child whose parent had run a parallel region hangs at
its next one with more than one thread.  A pthread_atfork child handler
(run for every fork(): os.fork, multiprocessing's "fork" and "forkserver",
C code) marks the process as a forked child; fastconv._threads then runs
every kernel there with one thread."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define FASTCONV_HAVE_OPENMP 1
    #else
    #define FASTCONV_HAVE_OPENMP 0
    static int omp_get_max_threads(void) { return 1; }
    static void omp_set_num_threads(int n) { (void)n; }
    #endif

    /* Set in the child of every fork() of this process (and inherited by
       its own children).  Only an int is written: async-signal-safe. */
    static volatile int fastconv_forked = 0;
    #if defined(_WIN32)
    static int fastconv_register_atfork(void) { return 0; }
    #else
    #include <pthread.h>
    static void fastconv_atfork_child(void) { fastconv_forked = 1; }
    static int fastconv_register_atfork(void) {
        return pthread_atfork(NULL, NULL, fastconv_atfork_child);
    }
    #endif

    #if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    /* __builtin_cpu_supports also checks that the OS saves the wide
       registers (XCR0), not only the CPUID bits. */
    static int fastconv_has_x86_64_v3(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2")
            && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe")
            && __builtin_cpu_supports("lzcnt");
    }
    static int fastconv_has_x86_64_v4(void) {
        __builtin_cpu_init();
        return fastconv_has_x86_64_v3()
            && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
            && __builtin_cpu_supports("avx512vl");
    }
    #else
    static int fastconv_has_x86_64_v3(void) { return 0; }
    static int fastconv_has_x86_64_v4(void) { return 0; }
    #endif
    """
    int FASTCONV_HAVE_OPENMP
    int omp_get_max_threads() nogil
    void omp_set_num_threads(int n) nogil
    int fastconv_has_x86_64_v3()
    int fastconv_has_x86_64_v4()
    int fastconv_forked
    int fastconv_register_atfork()

HAVE_OPENMP = bool(FASTCONV_HAVE_OPENMP)

if fastconv_register_atfork() != 0:
    raise ImportError("fastconv: pthread_atfork failed (out of memory)")


def cpu_supports(isa):
    """Whether this CPU (and OS) can run the named kernel build."""
    if isa == "avx512":
        return bool(fastconv_has_x86_64_v4())
    if isa == "avx2":
        return bool(fastconv_has_x86_64_v3())
    if isa == "baseline":
        return True
    raise ValueError(f"unknown ISA {isa!r}")


def get_max_threads():
    return omp_get_max_threads()


def set_max_threads(int n):
    omp_set_num_threads(n)


def in_forked_child():
    """True in a process created by fork() after this module was imported
    (and in its descendants)."""
    return bool(fastconv_forked)


def buffer_address(obj):
    """The address of a contiguous buffer's first byte (what
    ndarray.ctypes.data gives, in a quarter of the time: the facade aligns
    every output with it)."""
    cdef Py_buffer view
    PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)
    cdef size_t address = <size_t>view.buf
    PyBuffer_Release(&view)
    return address
