# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# Portable build of gemm_frame.pxi: the compiler's default target (SSE2 on
# x86-64, NEON on aarch64).
cdef extern from *:
    """
    /* 16 128-bit registers assumed (SSE2; NEON has 32): a 6x8 float tile is
       12 accumulators + 2 B vectors + 1 broadcast. */
    #define FC_VBYTES 16
    #define FC_S_MR 6
    #define FC_S_NR 8
    #define FC_S_KC 256
    #define FC_S_NC 512
    #define FC_D_MR 6
    #define FC_D_NR 4
    #define FC_D_KC 256
    #define FC_D_NC 256
    """
ISA_NAME = "baseline"
include "gemm_frame.pxi"
include "conv_frame.pxi"
include "depthwise_frame.pxi"
include "winograd_frame.pxi"
include "winograd_thin_frame.pxi"
include "pool_frame.pxi"
include "batchnorm_frame.pxi"
include "groups_frame.pxi"
