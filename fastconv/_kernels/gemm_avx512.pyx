# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# AVX-512 build (x86-64-v4) of gemm_frame.pxi.
cdef extern from *:
    """
    /* 32 zmm registers: a 12x32 float tile is 24 accumulators + 2 B vectors
       + 1 broadcast (12x32 measured ahead of 14x32 and 8x48 on Zen 4).  The
       A slice (12 x KC, 18 KiB) stays in L1 while B panels (KC x NR, 48 KiB)
       stream from L2; a KC x NC block of B is 768 KiB, most of a 1 MiB L2.
       KC 384 rather than 256: Zen 5, in one process alternating, best
       GFLOPS 1 / 2 threads: 3136x512x1152 238 -> 247 / 476 -> 492,
       6272x128x1152 237 -> 244 / 464 -> 482, 1568x256x2304 237 -> 243 /
       458 -> 475; 512 gained about as much but makes a 24 KiB A slice, most
       of a 32 KiB L1.  NC 512 rather than 256 (each A slice, read or copied
       once per block, serves twice the panels): Zen 5, alike, 2048^3 218 ->
       228 / 425 -> 445, 6272x576x128 245 -> 245 / 477 -> 484; 768 (past L2) no
       better; the convolutions measured (1x1 64->256 and 3x3/2 at batch 8,
       3x3 256->256 @14 by Winograd and implicit GEMM, 3x3/2 input
       gradient) within 1 %. */
    #define FC_VBYTES 64
    #define FC_S_MR 12
    #define FC_S_NR 32
    #define FC_S_KC 384
    #define FC_S_NC 512
    /* Implicit-GEMM tiles also as 6 x 64 (two B panels at once: 24
       accumulators, 4 B vectors + 1 broadcast), which reads each pixel's
       runs once per 64 output channels instead of per 32: see
       multiply_pixel_rows. */
    #define FC_S_PAIR_MR 6
    /* Short-M products (short_m_kernel.h): 6 rows of W by 3 vectors of A
       and the extra row, 18 + 6 accumulators. */
    #define FC_S_SHORT_MR 6
    #define FC_S_SHORT_NV 3
    #define FC_D_MR 14
    #define FC_D_NR 16
    #define FC_D_KC 256
    #define FC_D_NC 256
    /* 3 rows by 6 vectors and the extra row: 18 + 3 accumulators. */
    #define FC_D_SHORT_MR 3
    #define FC_D_SHORT_NV 6
    """
ISA_NAME = "avx512"
include "gemm_frame.pxi"
include "conv_frame.pxi"
include "depthwise_frame.pxi"
include "winograd_frame.pxi"
include "winograd_thin_frame.pxi"
include "pool_frame.pxi"
include "batchnorm_frame.pxi"
include "groups_frame.pxi"
