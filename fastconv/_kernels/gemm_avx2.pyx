# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# AVX2+FMA build (x86-64-v3) of gemm_frame.pxi.
cdef extern from *:
    """
    /* 16 ymm registers: a 6x16 float tile is 12 accumulators + 2 B vectors
       + 1 broadcast (the classic Haswell shape). */
    #define FC_VBYTES 32
    #define FC_S_MR 6
    #define FC_S_NR 16
    #define FC_S_KC 256
    #define FC_S_NC 512
    #define FC_D_MR 6
    #define FC_D_NR 8
    #define FC_D_KC 256
    #define FC_D_NC 256
    """
ISA_NAME = "avx2"
include "gemm_frame.pxi"
include "conv_frame.pxi"
include "depthwise_frame.pxi"
include "winograd_frame.pxi"
include "winograd_thin_frame.pxi"
include "pool_frame.pxi"
include "batchnorm_frame.pxi"
include "groups_frame.pxi"
