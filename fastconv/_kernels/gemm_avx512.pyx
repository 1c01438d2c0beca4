# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# AVX-512 build (x86-64-v4) of gemm_frame.pxi.
cdef extern from *:
    """
    /* 32 zmm registers: a 14x32 float tile is 28 accumulators + 2 B vectors
       + 1 broadcast.  KC x NR of B (32 KiB) streams from L2 while the A
       micro-panel (14 KiB) stays in L1; a KC x NC block of B is 512 KiB, half
       of a Zen 4 / Skylake-SP L2. */
    #define FC_VBYTES 64
    #define FC_S_MR 12
    #define FC_S_NR 32
    #define FC_S_KC 256
    #define FC_S_NC 256
    #define FC_D_MR 14
    #define FC_D_NR 16
    #define FC_D_KC 256
    #define FC_D_NC 256
    """
ISA_NAME = "avx512"
include "gemm_frame.pxi"
include "conv_frame.pxi"
include "depthwise_frame.pxi"
