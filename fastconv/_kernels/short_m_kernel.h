/* Short-M products: C (M x N) = A (M x K) @ W^T, with M at most 49 rows
 * (a 7x7 image at batch 1: 3 AVX-512 float32 vectors and one row) and W
 * (N x K) row-major: a 1x1 convolution's weights, or x @ W.T.
 *
 * The GEMM frame would pack W^T into NR-column panels, a transpose of the
 * large operand on every call (fc_pack_bt_f32 was 14 % of the samples of
 * 1x1 2048->512 @7 b1, for a product that reads each weight 49 times).
 * Here the roles swap: C^T = W @ A^T.  W's rows are read in place as the
 * broadcast operand (R rows a tile, as the frame reads A), and the small
 * A is packed transposed: K rows of NV vectors, M's values zero-padded.  A
 * tile is R x (NV * VL) accumulators along M, finished transposed into C.
 *
 * Row M - 1 of A can ride as the EXTRA row instead of a vector of its
 * own: R more accumulators of dot products along k, of that row (read in
 * place) with the lines of W's rows that the broadcasts bring into L1
 * anyway, R FMAs per VL values of k.  So 49 rows cost three vectors, not
 * four.  Zen 4, 2 threads, best ms, the frame -> these kernels: (49 x
 * 2048) @ (2048 x 512) 0.569 -> 0.485 (the kernel 87 % of the samples,
 * packing A 4 %), (49 x 512) @ (512 x 2048) 0.575 -> 0.486; as a 1x1
 * convolution, 2048->512 @7 b1 by implicit GEMM 0.553 -> 0.491.
 *
 * A kernel call takes at most NV vectors of A's rows; longer M (16
 * registers: AVX2's 6 rows of W by 2 vectors) runs as blocks of NV
 * vectors, each tile's W rows read from memory for the first block and
 * from L2 for the others (gemm_short_m).
 *
 * The including module defines FC_VBYTES and, where the path is used,
 * FC_S_SHORT_MR / FC_S_SHORT_NV (float32 rows of W a tile, vectors of A a
 * call) and FC_D_SHORT_MR / FC_D_SHORT_NV (float64); 0 (the default)
 * leaves the path out of that build.
 */
#ifndef FASTCONV_SHORT_M_KERNEL_H
#define FASTCONV_SHORT_M_KERNEL_H

#include "micro_kernel.h"

#ifndef FC_S_SHORT_MR
#define FC_S_SHORT_MR 0
#define FC_S_SHORT_NV 0
#endif
#ifndef FC_D_SHORT_MR
#define FC_D_SHORT_MR 0
#define FC_D_SHORT_NV 0
#endif

/* C[m*rsc + i*csc] (m < M, i < R) = act(alpha * sum_k w[i*ldw + k] *
 * A[m, k] + beta * C (beta 0: C not read) + bias[i]).  at: A^T packed, K
 * rows of NV*VL values; xe: A's row M - 1, contiguous, when EXTRA (then
 * at holds the rows before it).  Rows of the tile past R repeat row R - 1
 * of W (their sums are dropped), so every tile runs the full-width body. */
#define FC_DEFINE_SHORT_M_KERNEL(SUFFIX, T, MR, NV, EXTRA)                      \
    static __attribute__((noinline)) void                                       \
    fc_short_m_kernel_##SUFFIX##_##NV##_##EXTRA(                                \
        ptrdiff_t K, const T *restrict w, ptrdiff_t ldw, ptrdiff_t R,           \
        const T *restrict at, const T *restrict xe, ptrdiff_t M,                \
        T *restrict c, ptrdiff_t rsc, ptrdiff_t csc, T alpha, T beta,           \
        const T *restrict bias, int act)                                        \
    {                                                                           \
        typedef fc_vec_##SUFFIX VEC;                                            \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        VEC acc[MR][NV], dot[MR];                                               \
        FC_UNROLL for (int i = 0; i < (MR); i++) {                              \
            dot[i] = (VEC){0};                                                  \
            FC_UNROLL for (int j = 0; j < (NV); j++)                            \
                acc[i][j] = (VEC){0};                                           \
        }                                                                       \
        /* Row i as a byte offset from row 0, which steps through k (the   \
           addressing of the frame's micro-kernel). */                        \
        const char *a = (const char *)w;                                        \
        ptrdiff_t off[MR];                                                      \
        FC_UNROLL for (int i = 0; i < (MR); i++)                                \
            off[i] = (i < R ? i : R - 1) * ldw * (ptrdiff_t)sizeof(T);          \
        ptrdiff_t k0 = 0;                                                       \
        for (; k0 + VL <= K; k0 += VL) {                                        \
            if (EXTRA) {                                                        \
                VEC xv;                                                         \
                memcpy(&xv, xe + k0, FC_VBYTES);                                \
                FC_UNROLL for (int i = 0; i < (MR); i++) {                      \
                    VEC wv;                                                     \
                    memcpy(&wv, a + off[i], FC_VBYTES);                         \
                    dot[i] += wv * xv;                                          \
                }                                                               \
            }                                                                   \
            FC_UNROLL for (int kk = 0; kk < VL; kk++) {                         \
                VEC bv[NV];                                                     \
                FC_UNROLL for (int j = 0; j < (NV); j++)                        \
                    memcpy(&bv[j], at + j * VL, FC_VBYTES);                     \
                FC_UNROLL for (int i = 0; i < (MR); i++) {                      \
                    T wi;                                                       \
                    memcpy(&wi, a + off[i] + kk * sizeof(T), sizeof(T));        \
                    FC_UNROLL for (int j = 0; j < (NV); j++)                    \
                        acc[i][j] += wi * bv[j];                                \
                }                                                               \
                at += (NV) * VL;                                                \
            }                                                                   \
            a += FC_VBYTES;                                                     \
        }                                                                       \
        /* Rows and columns padded to whole squares for the transposed     \
           stores below (the padding's sums are never stored). */             \
        enum { SQ = 32 / sizeof(T), SUM_ROWS = (MR) > SQ ? (MR) : SQ };         \
        T sum[SUM_ROWS][(NV) * VL + SQ];                                        \
        FC_UNROLL for (int i = 0; i < (MR); i++) {                              \
            memcpy(sum[i], acc[i], sizeof acc[i]);                              \
            T d = 0;                                                            \
            for (int l = 0; l < VL; l++)                                        \
                d += dot[i][l];                                                 \
            sum[i][(NV) * VL] = d;                                              \
        }                                                                       \
        for (; k0 < K; k0++) {      /* the last K % VL values of k */          \
            for (int i = 0; i < (MR); i++) {                                    \
                T wi;                                                           \
                memcpy(&wi, a + off[i], sizeof(T));                             \
                for (int m = 0; m < (NV) * VL; m++)                             \
                    sum[i][m] += wi * at[m];                                    \
                if (EXTRA)                                                      \
                    sum[i][(NV) * VL] += wi * xe[k0];                           \
            }                                                                   \
            at += (NV) * VL;                                                    \
            a += sizeof(T);                                                     \
        }                                                                       \
        /* The extra row is row M - 1: its sums go after the vectors'      \
           rows 0..M-2 (the padded lanes' sums are never stored). */          \
        if (EXTRA)                                                              \
            for (int i = 0; i < (MR); i++)                                      \
                sum[i][M - 1] = sum[i][(NV) * VL];                              \
        /* Sums stored as they are (the Winograd products: alpha 1, beta 0, \
           no bias or activation) for a full tile of C's contiguous rows   \
           (AVX2 float32: 6 rows of W): squares of the tile transposed in  \
           registers, then a row of MR values an m, where one value at a   \
           time took ~10 instructions.  Zen 3, the kernel alone, K = 256    \
           (16 x 256 by 6 rows, in L1/L2), 15 alternating runs: max /      \
           median 70.8 / 64.4 -> 79.5 / 67.6 GFLOPS; in one process        \
           alternating, 256->256 @14 b1 and (16 x 2048) @ (2048 x 512)     \
           1-4 % faster in 4 of 4 runs (best and median). */                  \
        if (FC_VBYTES == 32 && (MR) <= SQ && R == (MR) && csc == 1               \
                && alpha == 1 && beta == 0 && !bias && !act) {                  \
            T tr[SQ][SQ];                                                       \
            FC_UNROLL for (int i = (MR); i < SQ; i++)                           \
                memset(sum[i], 0, sizeof sum[i]);                               \
            for (ptrdiff_t m0 = 0; m0 < M; m0 += SQ) {                          \
                fc_transpose_sq_##SUFFIX(&sum[0][m0], (NV) * VL + SQ, tr[0], SQ, 1); \
                ptrdiff_t mn = M - m0 < SQ ? M - m0 : SQ;                       \
                for (ptrdiff_t m = 0; m < mn; m++)                              \
                    memcpy(c + (m0 + m) * rsc, tr[m], (MR) * sizeof(T));        \
            }                                                                   \
            return;                                                             \
        }                                                                       \
        for (ptrdiff_t m = 0; m < M; m++) {                                     \
            T *crow = c + m * rsc;                                              \
            for (ptrdiff_t i = 0; i < R; i++) {                                 \
                T v = alpha * sum[i][m];                                        \
                if (beta != 0)                                                  \
                    v += beta * crow[i * csc];                                  \
                if (bias)                                                       \
                    v += bias[i];                                               \
                if (act && v < 0)   /* a NaN compares false: stays NaN */      \
                    v = 0;                                                      \
                if (act == 2 && v > 6)                                          \
                    v = 6;                                                      \
                crow[i * csc] = v;                                              \
            }                                                                   \
        }                                                                       \
    }

/* Both variants (with and without the extra row) of NV vectors, and
 * their dispatch cases; X-macros over NV = 1..2, 1..3 and 1..6. */
#define FC_DEFINE_SHORT_M_KERNELS(SUFFIX, T, MR, NV)                            \
    FC_DEFINE_SHORT_M_KERNEL(SUFFIX, T, MR, NV, 0)                              \
    FC_DEFINE_SHORT_M_KERNEL(SUFFIX, T, MR, NV, 1)
#define FC_SHORT_M_CASE(SUFFIX, T, MR, NV)                                      \
    case 2 * (NV):                                                              \
        fc_short_m_kernel_##SUFFIX##_##NV##_0(K, w, ldw, R, at, xe, M, c, rsc,  \
                                              csc, alpha, beta, bias, act);     \
        break;                                                                  \
    case 2 * (NV) + 1:                                                          \
        fc_short_m_kernel_##SUFFIX##_##NV##_1(K, w, ldw, R, at, xe, M, c, rsc,  \
                                              csc, alpha, beta, bias, act);     \
        break;
#define FC_SHORT_M_UP_TO_2(X, SUFFIX, T, MR)                                    \
    X(SUFFIX, T, MR, 1) X(SUFFIX, T, MR, 2)
#define FC_SHORT_M_UP_TO_3(X, SUFFIX, T, MR)                                    \
    FC_SHORT_M_UP_TO_2(X, SUFFIX, T, MR) X(SUFFIX, T, MR, 3)
#define FC_SHORT_M_UP_TO_6(X, SUFFIX, T, MR)                                    \
    FC_SHORT_M_UP_TO_3(X, SUFFIX, T, MR)                                        \
    X(SUFFIX, T, MR, 4) X(SUFFIX, T, MR, 5) X(SUFFIX, T, MR, 6)

/* fc_short_m_kernel_SUFFIX: the kernel for nv vectors and extra (a build
 * without short-M kernels never calls it). */
#define FC_DEFINE_SHORT_M_DISPATCH(SUFFIX, T, CASES)                            \
    static inline void fc_short_m_kernel_##SUFFIX(                              \
        int nv, int extra, ptrdiff_t K, const T *w, ptrdiff_t ldw, ptrdiff_t R, \
        const T *at, const T *xe, ptrdiff_t M, T *c, ptrdiff_t rsc,             \
        ptrdiff_t csc, T alpha, T beta, const T *bias, int act)                 \
    {                                                                           \
        switch (2 * nv + (extra != 0)) { CASES }                                \
    }

/* Vectors of A 1..NV, each with and without the extra row: a short M
 * pays for the vectors it fills. */
#if FC_S_SHORT_MR > 0 && FC_S_SHORT_NV != 2 && FC_S_SHORT_NV != 3
#error "float32 short-M kernels exist for 2 or 3 vectors"
#endif
#if FC_D_SHORT_MR > 0 && FC_D_SHORT_NV != 6
#error "float64 short-M kernels exist for 6 vectors"
#endif
#define FC_SHORT_M_NONE(X, SUFFIX, T, MR)
#if FC_S_SHORT_MR > 0 && FC_S_SHORT_NV == 2
#define FC_S_SHORT_M_EACH FC_SHORT_M_UP_TO_2
#elif FC_S_SHORT_MR > 0
#define FC_S_SHORT_M_EACH FC_SHORT_M_UP_TO_3
#else
#define FC_S_SHORT_M_EACH FC_SHORT_M_NONE
#endif
#if FC_D_SHORT_MR > 0
#define FC_D_SHORT_M_EACH FC_SHORT_M_UP_TO_6
#else
#define FC_D_SHORT_M_EACH FC_SHORT_M_NONE
#endif
FC_S_SHORT_M_EACH(FC_DEFINE_SHORT_M_KERNELS, f32, float, FC_S_SHORT_MR)
FC_DEFINE_SHORT_M_DISPATCH(f32, float,
                           FC_S_SHORT_M_EACH(FC_SHORT_M_CASE, f32, float, FC_S_SHORT_MR))
FC_D_SHORT_M_EACH(FC_DEFINE_SHORT_M_KERNELS, f64, double, FC_D_SHORT_MR)
FC_DEFINE_SHORT_M_DISPATCH(f64, double,
                           FC_D_SHORT_M_EACH(FC_SHORT_M_CASE, f64, double, FC_D_SHORT_MR))

#endif
