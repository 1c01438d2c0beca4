"""show_config(): what this fastconv build is and what it runs on."""
import os
import platform

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
    }


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
