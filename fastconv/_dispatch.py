"""Run-time choice of the kernel build (numpy-style CPU dispatch).

Every ISA build of the kernels is a separate extension module
(fastconv/_kernels/gemm_<isa>); at import the best one this CPU can run is
chosen, or the one named by the FASTCONV_ISA environment variable.
"""
import contextlib
import importlib
import importlib.util
import os

from ._kernels import _runtime

#: Preference order, best first.
ISA_ORDER = ("avx512", "avx2", "baseline")


def _built(isa):
    # Looks for the module without importing it: a build's module init is
    # compiled with that build's flags, so importing the AVX-512 build on a
    # CPU without AVX-512 dies of SIGILL before any check could run (seen on
    # Zen 3).  Only a runnable build is ever imported.
    return importlib.util.find_spec(f"fastconv._kernels.gemm_{isa}") is not None


def _runnable(isa):
    return _runtime.cpu_supports(isa) and _built(isa)


AVAILABLE = tuple(isa for isa in ISA_ORDER if _runnable(isa))


def load(isa):
    if isa not in ISA_ORDER:
        raise ValueError(f"FASTCONV_ISA / isa must be one of {', '.join(ISA_ORDER)}; got {isa!r}")
    if not _built(isa):
        raise RuntimeError(f"fastconv was built without the {isa!r} kernels on this platform "
                           f"(built and runnable here: {', '.join(AVAILABLE)})")
    if not _runtime.cpu_supports(isa):
        raise RuntimeError(f"this CPU cannot run fastconv's {isa!r} kernels "
                           f"(runnable here: {', '.join(AVAILABLE)})")
    return importlib.import_module(f"fastconv._kernels.gemm_{isa}")


kernels = load(os.environ.get("FASTCONV_ISA", "").strip().lower() or AVAILABLE[0])


def current_isa():
    """Name of the kernel build in use."""
    return kernels.ISA


@contextlib.contextmanager
def use_isa(isa):
    """Temporarily run every fastconv call on another kernel build (tests).

    Not thread-safe: it swaps a module-level reference.
    """
    global kernels
    previous = kernels
    kernels = load(isa)
    try:
        yield kernels
    finally:
        kernels = previous
