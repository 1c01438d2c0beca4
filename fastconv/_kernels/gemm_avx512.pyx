# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# AVX-512 build (x86-64-v4) of gemm_frame.pxi.
cdef extern from *:
    """
    /* 32 zmm registers: a 12x32 float tile is 24 accumulators + 2 B vectors
       + 1 broadcast (12x32 measured ahead of 14x32 and 8x48 on Zen 4).  The
       A slice (12 x KC, 12 KiB) stays in L1 while B panels (KC x NR, 32 KiB)
       stream from L2; a KC x NC block of B is 256 KiB. */
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
include "winograd_frame.pxi"
include "pool_frame.pxi"
include "groups_frame.pxi"
