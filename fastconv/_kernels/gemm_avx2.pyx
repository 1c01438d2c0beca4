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
    /* Short-M products (short_m_kernel.h): 6 rows of W by 2 vectors of A a
       call (the 6x16 shape again), 49 rows as 3 blocks and the extra row.
       Zen 3, 2 threads, best ms, implicit GEMM -> gemm1x1 by these, 7x7
       batch 1: 2048->512 0.75-0.79 -> 0.63-0.65, 512->2048 0.73 -> 0.60-0.62,
       1024->2048 1.52 -> 1.16-1.21, 512->512 0.20 -> 0.175; 1x1 64->3 @224
       (narrow_output_gemm) 0.80 -> 0.50.  3 rows by 3 vectors (2 blocks)
       tied on those and lost the narrow one (0.83: 3 broadcasts and a load
       for 3 FMAs). */
    #define FC_S_SHORT_MR 6
    #define FC_S_SHORT_NV 2
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
