"""Build of fastconv's Cython kernels.

The GEMM kernel source (fastconv/_kernels/gemm_frame.pxi) is compiled once
per ISA, each build a thin .pyx with its own micro-tile and flags; the
package picks one at import time (fastconv/_dispatch.py).  No -march=native:
a wheel must run on any x86-64 CPU.
"""
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Python's own flags carry -fwrapv, which stops GCC from vectorising the index
# arithmetic Cython emits (measured: a 14x32 micro-kernel ran ~10x slower).
COMMON = ["-O3", "-fno-wrapv", "-fno-math-errno"]

IS_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
ISA_FLAGS = {"baseline": []}
if IS_X86_64:
    # GCC prefers 256-bit vectors for x86-64-v4 by default; the AVX-512
    # micro-kernel is laid out for 512-bit ones.
    ISA_FLAGS["avx2"] = ["-march=x86-64-v3"]
    ISA_FLAGS["avx512"] = ["-march=x86-64-v4", "-mprefer-vector-width=512"]


def _compiler_has_openmp():
    """True when the C compiler builds and links an OpenMP program."""
    if os.environ.get("FASTCONV_NO_OPENMP"):
        return False
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n")
        try:
            r = subprocess.run([cc, "-fopenmp", src, "-o", os.path.join(tmp, "t")],
                               capture_output=True)
        except OSError:
            return False
        return r.returncode == 0


HAVE_OPENMP = _compiler_has_openmp()
OMP = ["-fopenmp"] if HAVE_OPENMP else []
if not HAVE_OPENMP:
    print("fastconv: no OpenMP in this compiler; building single-threaded kernels",
          file=sys.stderr)


def ext(name, source, isa="baseline"):
    return Extension(
        f"fastconv._kernels.{name}",
        [f"fastconv/_kernels/{source}"],
        include_dirs=[numpy.get_include(), "fastconv/_kernels"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=COMMON + ISA_FLAGS[isa] + OMP,
        extra_link_args=OMP,
    )


extensions = [ext("_runtime", "_runtime.pyx")]
extensions += [ext(f"gemm_{isa}", f"gemm_{isa}.pyx", isa) for isa in ISA_FLAGS]


class BuildExt(build_ext):
    # The per-ISA modules share one .pxi: rebuild them all when it changes.
    def build_extensions(self):
        self.force = self.force or bool(os.environ.get("FASTCONV_FORCE_BUILD"))
        super().build_extensions()


setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3},
        depfile=False,
    ),
    cmdclass={"build_ext": BuildExt},
)
