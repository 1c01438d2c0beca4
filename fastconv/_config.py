"""show_config(): what this fastconv build is and what it runs on."""
import os
import platform
import sys

from . import _dispatch
from ._kernels import _runtime
from ._threads import get_num_threads

__version__ = "0.1.0"


def _openmp_runtime():
    """The OpenMP library loaded in this process (from /proc/self/maps)."""
    if not _runtime.HAVE_OPENMP:
        return "none (built without OpenMP: single-threaded)"
    try:
        with open("/proc/self/maps") as f:
            libs = {line.rsplit("/", 1)[-1].strip() for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        libs = set()
    return ", ".join(sorted(libs)) or "linked (library name unknown on this platform)"


def config():
    """show_config()'s facts as a dict."""
    k = _dispatch.kernels
    return {
        "version": __version__,
        "machine": platform.machine(),
        "isa": k.ISA,
        "isa_forced": os.environ.get("FASTCONV_ISA") or None,
        "isa_available": list(_dispatch.AVAILABLE),
        "gemm_tile_float32": k.TILE_F32,
        "gemm_tile_float64": k.TILE_F64,
        "openmp": _openmp_runtime(),
        "num_threads": get_num_threads(),
        "cached_workspace_bytes": k.cached_workspace_bytes(),
    }


def release_workspace():
    """Free the workspace blocks fastconv keeps between calls; returns the
    bytes released.

    The kernels keep freed workspace blocks of 128 KiB or more (at most 128
    MiB in all, per kernel build) for the next call, which then does not
    page-fault them in again; this hands that memory back to the system."""
    builds = (sys.modules.get(f"fastconv._kernels.gemm_{isa}") for isa in _dispatch.ISA_ORDER)
    return sum(k.release_workspace() for k in builds if k is not None)


def show_config():
    """Print the version, the kernel build in use and the ones this CPU can
    run, the GEMM micro-tiles, the OpenMP runtime and the thread count."""
    c = config()
    print(f"fastconv {c['version']} on {c['machine']}")
    forced = f" (forced by FASTCONV_ISA={c['isa_forced']})" if c["isa_forced"] else ""
    print(f"  kernels in use : {c['isa']}{forced}")
    print(f"  runnable here  : {', '.join(c['isa_available'])}")
    print(f"  GEMM tile MRxNR: float32 {c['gemm_tile_float32'][0]}x{c['gemm_tile_float32'][1]}, "
          f"float64 {c['gemm_tile_float64'][0]}x{c['gemm_tile_float64'][1]}")
    print(f"  OpenMP runtime : {c['openmp']}")
    print(f"  threads        : {c['num_threads']}")
    print(f"  cached workspace: {c['cached_workspace_bytes'] / 2**20:.1f} MiB "
          f"(fastconv.release_workspace() frees it)")
